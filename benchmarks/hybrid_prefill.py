"""What caching a hybrid model's state costs: a prefill in pieces against a one-shot prefill, on CPU.

The model: random weights with Qwen3-Next-80B-A3B's per-layer geometry (transformers' ``Qwen3NextConfig``
defaults: hidden 2048; gated delta net with 16 key / 32 value heads of 128; attention with 16 heads,
2 KV heads of 256), cut to ``--layers`` layers in its 3:1 ratio of linear-attention to attention layers,
in bfloat16. Its MoE (10 routed experts of 512 and a shared one of 512 per token) is replaced by the
config's dense MLP of 5632, which costs the same multiply-adds per token (3 x 2048 x 5632 = 10 x 3 x 2048
x 512 + 3 x 2048 x 512) without transformers' per-expert loop on CPU; the ``--vocab`` is cut (only the
embedding lookup and one position's logits depend on it). Compute does not depend on the weights'
values, so the timings are those of the real model's layers on transformers' reference PyTorch
kernels (``flash-linear-attention`` and ``causal-conv1d`` are not installed here). One untimed
forward warms the kernels up first.

Rows, each a median over ``--repeats`` rounds (every row once per round, in turn) of a ``--tokens``-token
prompt, measured in the same run, in wall and in CPU milliseconds (the process's CPU time; with
``--threads 1`` on a machine that other work loads it is the steadier of the two):

- ``one-shot``: ``CachedPrefill(model, None).prefill``: one forward (the baseline);
- ``pieces of C``: the same prompt in forwards of ``C`` tokens, no store (the compute cost of ending a
  piece at every boundary);
- ``cold, ends`` / ``cold, every``: ``CachedPrefill.prefill`` into an empty cache with
  ``state_boundaries="ends"`` (pieces end at the prompt's last boundaries only) / ``"every"`` (a piece and
  a stored state per chunk), stores included;
- ``hit``: the prompt again: its prefix K/V and the state at its last boundary restored from the hot
  tier, the rest computed.

Also printed: the bytes of one boundary's state and of one chunk's attention K/V, for this cut and
scaled to the real 48 layers (36 gated-delta-net, 12 attention).

    python benchmarks/hybrid_prefill.py --tokens 1024 --chunk 64 --json out/hybrid.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid


def _timed(fn) -> tuple[float, float]:
    """``fn()``'s wall and CPU milliseconds (the process's CPU time: on a machine other work loads, the
    work done, which the wall time is not)."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3NextConfig
    from transformers.cache_utils import DynamicCache

    from tieredkv import TieredCache
    from tieredkv.integrations import hf
    from tieredkv.integrations.hf_state import hybrid_layout
    from tieredkv.integrations.models import random_model

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4) \
        + ["linear_attention"] * (args.layers % 4)
    config = Qwen3NextConfig(num_hidden_layers=args.layers, layer_types=layer_types,
                             mlp_only_layers=list(range(args.layers)), vocab_size=args.vocab,
                             max_position_embeddings=max(8192, 2 * args.tokens))
    model = random_model(config, dtype=args.dtype)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    C = args.chunk
    spec = hf.spec_for_model(model, chunk_tokens=C, model_id=f"bench-hybrid-{uuid.uuid4().hex[:8]}")
    layout = hybrid_layout(model)
    n_state_layers = len({t.layer for t in layout.tensors})
    base = hf.CachedPrefill(model, None)
    base.prefill(ids[:, :C])  # warm-up: oneDNN's first calls

    def pieces() -> None:
        kv = DynamicCache(config=model.config)
        with torch.inference_mode():
            for start in range(0, args.tokens, C):
                end = min(start + C, args.tokens)
                model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end)[None],
                      past_key_values=kv, use_cache=True, logits_to_keep=1)

    boundaries = args.tokens // C
    hot_bytes = (boundaries * (-(-layout.state_bytes // spec.block_bytes) + 1) + 64) * spec.block_bytes + (8 << 20)

    def cold(mode: str, times: dict[str, list[float]]) -> None:
        with TieredCache(spec, hot_bytes=hot_bytes, hot_name=f"/{spec.model_id}-{mode}") as cache:
            try:
                runner = hf.CachedPrefill(model, cache, state_boundaries=mode)
                times[f"cold, {mode}"].append(_timed(lambda: runner.prefill(ids)))
                if mode == "ends":
                    got: list = []
                    times["hit"].append(_timed(lambda: got.append(runner.prefill(ids))))
                    assert got[0].cached_tokens == (args.tokens - 1) // C * C, got[0].cached_tokens
            finally:
                cache.unlink_hot()

    # Rounds of every row in turn: a load that drifts during the run weighs on all rows alike.
    names = ("one-shot", f"pieces of {C}", "cold, ends", "cold, every", "hit")
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    for _ in range(args.repeats):
        times["one-shot"].append(_timed(lambda: base.prefill(ids)))
        times[f"pieces of {C}"].append(_timed(pieces))
        cold("ends", times)
        cold("every", times)
    rows = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    kv_chunk = spec.block_bytes
    out = {
        "tokens": args.tokens, "chunk": C, "layers": args.layers, "dtype": args.dtype, "threads": args.threads,
        "load_average": {"start": load_start, "end": os.getloadavg()}, "wall_ms": rows, "cpu_ms": cpu,
        "x_one_shot_wall": {k: v / rows["one-shot"] for k, v in rows.items()},
        "x_one_shot_cpu": {k: v / cpu["one-shot"] for k, v in cpu.items()},
        "state_bytes_per_boundary": layout.state_bytes, "kv_bytes_per_chunk": kv_chunk,
        "state_tensors": [f"{t.kind} {t.shape} {t.dtype}" for t in layout.tensors[:2]],
        "real_48_layers": {"state_bytes_per_boundary": layout.state_bytes // n_state_layers * 36,
                           "kv_bytes_per_chunk": kv_chunk // len(layout.attention) * 12},
    }
    print(json.dumps(out, indent=2))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
