"""TTFT of a long cached prompt in a vLLM engine: tieredkv's connector (sync vs layer-wise loads) against
vLLM's own prefix cache and against no cache, CPU engines, ratios measured in one run.

Two engine processes (CPU build, ``demo_llama_config``: 8 layers x 8 KV heads x head_dim 32, float32,
16 KiB of KV per token, so a 4096-token prefix is 64 MiB), one after the other:

- ``vllm``: no connector, vLLM's prefix cache on. Per repetition a fresh prompt is served twice: the
  first time from scratch (**no cache**), the second time with its prefix in vLLM's own cache
  (**prefix caching**, warm).
- ``tieredkv``: the connector (hot tier only). Per repetition a fresh prompt is served from scratch
  (**no cache**, plus the store), then from vLLM's own prefix cache (**prefix caching**: the same
  engine, the connector has nothing to load), then twice more with vLLM's local prefix cache emptied
  before each
  (``reset_prefix_cache``: the prefix comes from the hot tier): once with ``load_mode="sync"`` (every
  load done before the forward) and once with ``load_mode="layer"`` (loads on a thread, each attention
  layer waits for its own layer), alternating which goes first. The engine runs a connector subclass
  that reads the mode for the next step from a file this script writes, so both modes are measured in
  the same engine, interleaved.

The connector subclass also adds up, per step with loads, how long the forward's thread was held
by them (``start_load_kv`` plus every ``wait_for_layer_load``) and how much of the loads was left
when the forward ended (waited for in ``wait_for_save``): a steadier view of the overlap than TTFT on a
loaded machine. TTFT is the wall time of a one-token ``generate``. Each row is a median over ``--reps`` prompts, with
its ratio to the **no cache** median measured in the same engine (and the load average when the row's
engine finished). A third, engine-free part checks that the loads' copies release the GIL: how far a
Python loop gets in the main thread while a thread runs the tier copy + the paged copies of the same
prefix, against the loop alone.

    python benchmarks/vllm_ttft.py                      # 4096-token prefix, 5 repetitions
    python benchmarks/vllm_ttft.py --prefix-tokens 1024 --reps 3
    python benchmarks/vllm_ttft.py --json ttft.json

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

BLOCK, CHUNK = 32, 64
#: The file naming the next step's load mode (read by ``SwitchingConnector`` in the engine core).
MODE_ENV = "TIEREDKV_BENCH_LOAD_MODE_FILE"


# ---- the engine side ----------------------------------------------------------------------------------
def _switching_class() -> Any:
    from tieredkv.integrations.vllm import TieredKVConnector

    class SwitchingConnector(TieredKVConnector):
        """The connector, whose load mode for each step is read from a file, and which adds up how long
        the forward's thread was held in ``start_load_kv`` and ``wait_for_layer_load`` in each step
        with loads (appended to a file beside it). Benchmark only."""

        _held = 0.0
        _loading = False

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            if self._loader is not None:
                self._loader.mode = Path(os.environ[MODE_ENV]).read_text().strip()
            t0 = time.perf_counter()
            super().start_load_kv(forward_context, **kwargs)
            self._held = time.perf_counter() - t0
            self._loading = self._loader is not None and self._loader._job is not None

        def wait_for_layer_load(self, layer_name: str) -> None:
            t0 = time.perf_counter()
            super().wait_for_layer_load(layer_name)
            self._held += time.perf_counter() - t0

        def wait_for_save(self) -> None:
            t0 = time.perf_counter()
            self._finish_loads()  # what the forward did not wait for is still part of the step
            if self._loading:
                with open(os.environ[MODE_ENV] + ".held", "a") as f:
                    f.write(f"{self._held * 1e3:.3f} {(time.perf_counter() - t0) * 1e3:.3f}\n")
            self._loading = False
            super().wait_for_save()

    return SwitchingConnector


def __getattr__(name: str) -> Any:  # vLLM imports the connector class by name from this module
    if name == "SwitchingConnector":
        return _switching_class()
    raise AttributeError(name)


def _engine_main(job: dict) -> None:
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                      VLLM_CPU_KVCACHE_SPACE=str(job["kv_space_gib"]))
    os.environ["PYTHONPATH"] = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")  # the core imports us
    mode_file = Path(job["root"]) / "load_mode"
    os.environ[MODE_ENV] = str(mode_file)
    mode_file.write_text("layer")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if job["extra"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SwitchingConnector", kv_connector_module_path="vllm_ttft", kv_role="kv_both",
            kv_connector_extra_config=job["extra"], kv_load_failure_policy="recompute")
    llm = LLM(model=job["model"], skip_tokenizer_init=True, max_model_len=job["max_model_len"], enforce_eager=True,
              dtype="float32", block_size=BLOCK, max_num_seqs=2, enable_prefix_caching=True, **kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    held_file = Path(str(mode_file) + ".held")

    def timed(prompt: list[int]) -> tuple[float, int]:
        held_file.unlink(missing_ok=True)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return time.perf_counter() - t0, int(out.num_cached_tokens)

    def held() -> tuple[float, float]:
        """ms the forward's thread was held by the step's loads, and ms of them left after the forward."""
        lines = held_file.read_text().split() if held_file.exists() else ["0", "0"]
        return float(lines[0]), float(lines[1])

    rng = np.random.default_rng(job["seed"])
    timed(rng.integers(1, 2000, 300).tolist())  # warm-up: not timed
    rows: dict[str, list] = {}
    for rep in range(job["reps"]):
        prompt = rng.integers(1, 2000, job["prompt_tokens"]).tolist()
        rows.setdefault("no_cache", []).append(timed(prompt))
        rows.setdefault("prefix_caching", []).append(timed(prompt))  # vLLM's own cache (the connector: idle)
        if job["extra"] is None:
            continue
        for mode in (("sync", "layer") if rep % 2 == 0 else ("layer", "sync")):
            assert llm.reset_prefix_cache()  # vLLM's own copy goes: the prefix comes from the hot tier
            mode_file.write_text(mode)
            rows.setdefault(f"tieredkv_{mode}", []).append(timed(prompt))
            rows.setdefault(f"held_{mode}", []).append(held())
        mode_file.write_text("layer")
    Path(job["out"]).write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg()}))


def _run_engine(args, work: Path, model: str, name: str, extra: dict | None) -> dict:
    root = work / name
    root.mkdir()
    job = {"model": model, "extra": extra, "root": str(root), "reps": args.reps, "seed": 11,
           "prompt_tokens": args.prefix_tokens + args.suffix_tokens, "kv_space_gib": args.kv_space_gib,
           "max_model_len": args.prefix_tokens + args.suffix_tokens + 64, "out": str(root / "out.json")}
    (root / "job.json").write_text(json.dumps(job))
    with open(root / "engine.log", "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--worker", str(root / "job.json")],
                              stdout=subprocess.DEVNULL, stderr=log, timeout=3600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"engine {name} failed:\n{(root / 'engine.log').read_text()[-3000:]}")
    return json.loads((root / "out.json").read_text())


def engines(args, work: Path) -> dict:
    import posix_ipc

    from tieredkv.integrations.models import demo_llama_config, save_random_model

    length = args.prefix_tokens + args.suffix_tokens + 64
    model = save_random_model(demo_llama_config(max_position_embeddings=length), work / "model")
    hot_name = f"/tieredkv-bench-ttft-{os.getpid()}"
    extra = {"hot_bytes": args.hot_bytes, "hot_name": hot_name, "chunk_tokens": CHUNK}
    out: dict = {"settings": {"prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                              "reps": args.reps, "kv_space_gib": args.kv_space_gib, "block_size": BLOCK,
                              "chunk_tokens": CHUNK, "model": "demo_llama_config (random weights), float32"},
                 "engines": {}}
    try:
        for name, ext in (("vllm", None), ("tieredkv", extra)):
            print(f"  engine {name}: starting ...", flush=True)
            out["engines"][name] = _run_engine(args, work, model, name, ext)
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:
            pass
    table = []
    for name, run in out["engines"].items():
        base = statistics.median(t for t, _ in run["rows"]["no_cache"])
        for mode in ("sync", "layer"):
            samples = run["rows"].pop(f"held_{mode}", None)
            if samples:
                out[f"forward_held_ms_{mode}"] = statistics.median(h for h, _ in samples)
                out[f"after_forward_ms_{mode}"] = statistics.median(a for _, a in samples)
        for row, samples in run["rows"].items():
            med = statistics.median(t for t, _ in samples)
            table.append({"engine": name, "row": row, "ttft_p50_ms": med * 1e3, "vs_no_cache": med / base,
                          "cached_tokens": sorted({c for _, c in samples}),
                          "ttft_ms": [round(t * 1e3, 1) for t, _ in samples],
                          "loadavg": [round(x, 2) for x in run["loadavg"]]})
    out["table"] = table
    rows = {r["row"]: r for r in table if r["engine"] == "tieredkv"}
    if "tieredkv_sync" in rows and "tieredkv_layer" in rows:
        out["layer_vs_sync"] = rows["tieredkv_layer"]["ttft_p50_ms"] / rows["tieredkv_sync"]["ttft_p50_ms"]
    return out


# ---- do the copies release the GIL? ---------------------------------------------------------------------
def gil(args, work: Path) -> dict:
    import posix_ipc
    import torch

    from tieredkv import KVSpec, TieredCache
    from tieredkv.integrations.paged import PagedKV

    layers, heads, dim, tokens = 8, 8, 32, args.prefix_tokens
    spec = KVSpec(model_id="bench/ttft-gil", num_layers=layers, num_kv_heads=heads, head_dim=dim,
                  dtype="float32", chunk_tokens=CHUNK)
    n_blocks = tokens // BLOCK + 8
    # The CPU backend's pages: [B, H, N, 2D] per layer, a (block, head) page [K: N x D][V: N x D].
    raw = torch.zeros(layers, n_blocks, heads, 2, BLOCK, dim)
    paged = PagedKV([raw[i].permute(0, 2, 1, 3, 4) for i in range(layers)], BLOCK)
    ids = np.random.default_rng(0).permutation(n_blocks)[:tokens // BLOCK].tolist()
    token_ids = np.arange(tokens + 1) % 1000
    hot_name = f"/tieredkv-bench-ttftg-{os.getpid()}"
    staging = torch.empty(layers, 2, heads, tokens, dim)
    try:
        with TieredCache(spec, hot_bytes=2 * tokens * spec.bytes_per_token + (16 << 20), hot_name=hot_name) as cache:
            cache.store(token_ids[:tokens], torch.randn(layers, 2, heads, tokens, dim))
            hit = cache.lookup(token_ids)

            def restore() -> None:
                cache.load(hit, staging)
                for layer in range(layers):
                    paged.write(ids, staging, layers=(layer,))

            def spin(stop: threading.Event | None, seconds: float) -> int:
                n, end = 0, time.perf_counter() + seconds
                while (not stop.is_set()) if stop is not None else time.perf_counter() < end:
                    n += 1
                return n

            restore()  # first touch of the pages, not measured
            t0 = time.perf_counter()
            for _ in range(args.gil_reps):
                restore()
            per_restore = (time.perf_counter() - t0) / args.gil_reps
            alone = spin(None, per_restore * args.gil_reps) / args.gil_reps
            beside = []
            for _ in range(args.gil_reps):
                stop = threading.Event()
                worker = threading.Thread(target=lambda s=stop: (restore(), s.set()))
                t0 = time.perf_counter()
                worker.start()
                n = spin(stop, 0)
                worker.join()
                beside.append(n / ((time.perf_counter() - t0) / per_restore))
            cache.unlink_hot()
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:
            pass
    return {"restore_ms": per_restore * 1e3, "bytes": tokens * spec.bytes_per_token,
            "main_thread_progress_vs_alone": statistics.median(beside) / alone,
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def _print(doc: dict) -> None:
    if "gil" in doc:
        g = doc["gil"]
        print(f"\nGIL: a tier + paged restore of {g['bytes'] / 2**20:.0f} MiB on a thread takes "
              f"{g['restore_ms']:.1f} ms; "
              f"the main thread's Python loop runs at {g['main_thread_progress_vs_alone']:.2f}x its speed alone "
              f"meanwhile (1.0: the copies never hold the GIL; ~0: they hold it throughout), load {g['loadavg']}")
    if "engines" in doc:
        e = doc["engines"]
        s = e["settings"]
        print(f"\nTTFT of a {s['prefix_tokens']}-token cached prefix (+{s['suffix_tokens']} new tokens), median of "
              f"{s['reps']} prompts: {s}")
        print(f"{'engine':<10}{'row':<18}{'TTFT p50 ms':>12}{'vs no cache':>12}{'cached tokens':>15}  load average")
        for r in e["table"]:
            print(f"{r['engine']:<10}{r['row']:<18}{r['ttft_p50_ms']:>12.1f}{r['vs_no_cache']:>12.3f}"
                  f"{str(r['cached_tokens']):>15}  {r['loadavg']}")
        if "layer_vs_sync" in e:
            print(f"layer-wise / sync TTFT (same engine, interleaved): {e['layer_vs_sync']:.3f}")
        for mode in ("sync", "layer"):
            if f"forward_held_ms_{mode}" in e:
                print(f"{mode}: the forward's thread waited {e[f'forward_held_ms_{mode}']:.1f} ms for the step's loads "
                      f"(median), {e[f'after_forward_ms_{mode}']:.1f} ms of them were left after the forward")
        for r in e["table"]:
            print(f"  {r['engine']} {r['row']}: TTFT ms {r['ttft_ms']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="JOB.json", help=argparse.SUPPRESS)
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="the cached prefix (a multiple of 64)")
    parser.add_argument("--suffix-tokens", type=int, default=16, help="new tokens after it")
    parser.add_argument("--reps", type=int, default=5, help="prompts per row")
    parser.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per engine")
    parser.add_argument("--hot-bytes", default="512M", help="the connector's hot tier")
    parser.add_argument("--gil-reps", type=int, default=10)
    parser.add_argument("--skip", choices=("engines", "gil"), action="append", default=[])
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if args.worker:
        _engine_main(json.loads(Path(args.worker).read_text()))
        return
    if args.prefix_tokens % CHUNK or args.suffix_tokens <= 0:
        raise SystemExit(f"--prefix-tokens must be a multiple of {CHUNK} and --suffix-tokens positive")
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:]}
    with tempfile.TemporaryDirectory(prefix="tieredkv-ttft-bench-") as tmp:
        if "gil" not in args.skip:
            doc["gil"] = gil(args, Path(tmp))
        if "engines" not in args.skip:
            doc["engines"] = engines(args, Path(tmp))
    _print(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
