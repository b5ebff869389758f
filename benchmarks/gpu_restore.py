"""Restore a cached prefix into GPU memory: tieredkv against a plain host-to-device copy, and against prefill.

Needs a CUDA device (run it on a GPU server; on a CPU-only machine it says so and exits 2).

Rows, each a median over ``--repeats`` runs, measured in the same run:
- ``hot -> cuda``: ``TieredCache.lookup`` + ``load`` of a prefix held in the hot tier into a CUDA tensor
  (through the cache's pinned staging buffer), against ``pinned.to("cuda")`` of the same bytes (the best a
  host-to-device copy can do) and a pageable ``tensor.to("cuda")``;
- ``warm -> cuda``: the same from the warm tier only (the hot segment removed, as after a reboot; the page
  cache is warm), against the same copies;
- ``TTFT``: a random-weight model with the KV geometry of the seed's 7B-class example (28 layers, 2 KV
  heads, head_dim 128: 28,672 bytes per token in fp16): full prefill of the prompt against
  ``CachedPrefill.prefill`` with the prefix restored from the hot tier (restore + 1 computed token).

    python benchmarks/gpu_restore.py --prefix-tokens 4096 --json out/gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def _median_ms(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--no-model", action="store_true", help="skip the TTFT rows")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("gpu_restore: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from tieredkv import KVSpec, TieredCache

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    n = args.prefix_tokens
    spec = KVSpec(model_id="bench/gpu-restore", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16",
                  chunk_tokens=64)
    shape = (spec.num_layers, 2, spec.num_kv_heads, n, spec.head_dim)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    tokens = np.arange(n + 1, dtype=np.int64)
    nbytes = kv.nbytes
    out = torch.empty(shape, dtype=torch.float16, device=dev)
    pinned = torch.from_numpy(kv).pin_memory()
    pageable = torch.from_numpy(kv.copy())
    rows: dict[str, float] = {}
    rows["pinned.to(cuda) ms"] = _median_ms(lambda: out.copy_(pinned, non_blocking=True), args.repeats, sync)
    rows["pageable.to(cuda) ms"] = _median_ms(lambda: out.copy_(pageable), args.repeats, sync)

    with tempfile.TemporaryDirectory() as warm_dir:
        name = f"/tieredkv-bench-gpu-{time.time_ns()}"
        blocks = n // spec.chunk_tokens + 8
        # First the hot tier (every block written through to warm too), then warm alone: the hot
        # segment removed as after a reboot, and promotion off so every repeat reads warm.
        for tier, extra in (("hot", {"demotion": "write_through"}), ("warm", {"promotion": "never"})):
            with TieredCache(spec, hot_blocks=blocks, hot_name=name, warm_dir=warm_dir,
                             warm_bytes=2 * blocks * spec.block_bytes, **extra) as cache:
                if tier == "hot":
                    cache.store(tokens, kv)
                hit = cache.lookup(tokens)
                where = hit.hot_blocks if tier == "hot" else hit.warm_blocks
                assert hit.tokens == n and where == hit.blocks, hit

                def restore(cache=cache):
                    assert cache.load(cache.lookup(tokens), out) == n

                rows[f"{tier} -> cuda ms"] = _median_ms(restore, args.repeats, sync)
                if not torch.equal(out.cpu(), torch.from_numpy(kv)):
                    print(f"gpu_restore: WRONG BYTES after the {tier} restore", file=sys.stderr)
                    return 1
                cache.unlink_hot()

    if not args.no_model:
        rows.update(_ttft(spec, n, args.repeats, dev, sync))

    doc = {
        "device": torch.cuda.get_device_name(0),
        "prefix_tokens": n,
        "prefix_MiB": round(nbytes / 2**20, 1),
        "rows_ms": {k: round(v, 3) for k, v in rows.items()},
        "pinned_GBps": round(nbytes / rows["pinned.to(cuda) ms"] / 1e6, 2),
        "hot_restore_x_pinned_copy": round(rows["hot -> cuda ms"] / rows["pinned.to(cuda) ms"], 3),
        "warm_restore_x_pinned_copy": round(rows["warm -> cuda ms"] / rows["pinned.to(cuda) ms"], 3),
    }
    if "full prefill ms" in rows:
        doc["cached_ttft_x_full_prefill"] = round(rows["cached prefill ms"] / rows["full prefill ms"], 4)
    width = max(map(len, rows))
    print(f"{doc['device']}: restore a {n}-token prefix ({doc['prefix_MiB']} MiB)")
    for k, v in rows.items():
        print(f"  {k:<{width}}  {v:9.3f}")
    for k in ("pinned_GBps", "hot_restore_x_pinned_copy", "warm_restore_x_pinned_copy", "cached_ttft_x_full_prefill"):
        if k in doc:
            print(f"  {k:<{width}}  {doc[k]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


def _ttft(spec, n: int, repeats: int, dev, sync) -> dict[str, float]:
    import torch
    from transformers import Qwen2Config

    from tieredkv import TieredCache
    from tieredkv.integrations.hf import CachedPrefill
    from tieredkv.integrations.models import random_model

    # Qwen2.5-1.5B's shape: 28 layers, 2 KV heads of 128 -> 28,672 bytes per token in fp16.
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4 * n)
    model = random_model(cfg, seed=0, dtype=torch.float16).to(dev).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(0))
    ids_dev = ids.to(dev)
    rows = {}
    with torch.inference_mode():
        rows["full prefill ms"] = _median_ms(lambda: model(ids_dev), repeats, sync)
        name = f"/tieredkv-bench-gpu-ttft-{time.time_ns()}"
        with TieredCache(spec, hot_blocks=n // spec.chunk_tokens + 8, hot_name=name) as cache:
            runner = CachedPrefill(model, cache, spec=spec)
            first = runner.prefill(ids)
            assert first.cached_tokens == 0
            res = runner.prefill(ids)
            assert res.cached_tokens == n, res.cached_tokens
            rows["cached prefill ms"] = _median_ms(lambda: runner.prefill(ids), repeats, sync)
            cache.unlink_hot()
    return rows


if __name__ == "__main__":
    sys.exit(main())
