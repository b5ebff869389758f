"""The serving scenario at benchmark size: restore vs prefill vs memcpy, and a workers x prefix sweep.

Two parts, each a ratio measured in the same run against its baseline on the same data:

1. ``restore``: one process, one model. For each prefix length, a prompt of ``prefix + 64`` tokens:
   - full prefill time (no cache) vs the TTFT of the same prompt when its prefix is in the hot tier;
   - restore time (lookup + load + cache build, inside ``CachedPrefill.prefill``) vs a plain memcpy of
     the same KV bytes, into a buffer already touched (``memcpy``) and into a new one (``memcpy_fresh``:
     what a fresh destination costs, page faults included). The goal is restore <= 1.5x memcpy: one
     copy from the tier into the tensors the model's cache then holds.
2. ``serving``: the demo's scenario (``tieredkv.demo``) for every (prefix length, worker count):
   no_cache, private and shared, on real worker processes.

    python benchmarks/serving.py                 # full sweep: prefixes 1k/4k/16k, workers 1/2/4/8
    python benchmarks/serving.py --quick         # smoke run, under a minute
    python benchmarks/serving.py --json out.json --plot out.png

Prints tables; writes JSON and a plot on request. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tieredkv import demo  # noqa: E402


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _time_memcpy(n_bytes: int, reps: int) -> tuple[float, float]:
    """Median ms of copying ``n_bytes``: into a touched buffer, and into a fresh torch allocation (the
    allocator the model's cache tensors come from, page faults included)."""
    import torch

    src = torch.ones(n_bytes, dtype=torch.uint8)
    dst = torch.zeros(n_bytes, dtype=torch.uint8)
    warm, fresh = [], []
    for _ in range(max(3, reps)):
        t = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - t)
        t = time.perf_counter()
        new = torch.empty(n_bytes, dtype=torch.uint8)
        new.copy_(src)
        fresh.append(time.perf_counter() - t)
        del new
    return _median_ms(warm), _median_ms(fresh)


def restore_part(prefix_lengths: list[int], reps: int, model_name: str, progress: bool) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    from tieredkv import TieredCache
    from tieredkv.integrations.hf import CachedPrefill

    settings = demo.Settings(model=model_name, namespace_tag=uuid.uuid4().hex[:8])
    model = demo._build_model(settings)
    spec = demo.run_spec(settings, model)
    vocab = int(model.config.get_text_config().vocab_size)
    rng = np.random.default_rng(0)
    rows = []
    for prefix_tokens in prefix_lengths:
        prefix = rng.integers(0, vocab, prefix_tokens)
        prompts = [np.concatenate([prefix, rng.integers(0, vocab, 64)]) for _ in range(reps + 1)]
        blocks = prefix_tokens // spec.chunk_tokens + 2 * (reps + 2)
        hot_bytes = blocks * spec.block_bytes + (8 << 20)
        with TieredCache(spec, hot_bytes=hot_bytes) as cache:
            try:
                plain = CachedPrefill(model, None, spec=spec)
                cached = CachedPrefill(model, cache, spec=spec, reuse_host_buffer=False)
                reusing = CachedPrefill(model, cache, spec=spec, reuse_host_buffer=True)
                default_reuses = CachedPrefill(model, cache, spec=spec).reuse_host_buffer
                plain.prefill(prompts[0][:64])  # warm the kernels
                full = []
                for p in prompts[1:] if prefix_tokens <= 4096 else prompts[1:2]:
                    t = time.perf_counter()
                    plain.prefill(p)
                    full.append(time.perf_counter() - t)
                cached.prefill(prompts[0])  # stores the prefix
                ttft, restore, restore_reused, hit_tokens = [], [], [], 0
                for p in prompts[1:]:
                    t = time.perf_counter()
                    res = cached.prefill(p)
                    ttft.append(time.perf_counter() - t)
                    restore.append(res.restore_ms / 1e3)
                    hit_tokens = res.cached_tokens
                    del res
                for p in prompts[1:]:
                    restore_reused.append(reusing.prefill(p).restore_ms / 1e3)
            finally:
                cache.hot.unlink()
        kv_bytes = hit_tokens * spec.bytes_per_token
        memcpy_ms, memcpy_fresh_ms = _time_memcpy(kv_bytes, reps)
        row = {"prefix_tokens": prefix_tokens, "cached_tokens": hit_tokens, "kv_bytes": kv_bytes,
               "full_prefill_ms": _median_ms(full), "cached_ttft_ms": _median_ms(ttft),
               "restore_ms": _median_ms(restore), "restore_reused_ms": _median_ms(restore_reused),
               "memcpy_ms": memcpy_ms, "memcpy_fresh_ms": memcpy_fresh_ms,
               "default_reuses_buffer": bool(default_reuses)}
        row["ttft_ratio"] = row["cached_ttft_ms"] / row["full_prefill_ms"]
        row["restore_vs_prefill"] = row["restore_ms"] / row["full_prefill_ms"]
        # Like with like: a fresh buffer against a copy into fresh memory, a reused one against a copy
        # into memory already touched.
        row["restore_vs_memcpy"] = row["restore_reused_ms"] / memcpy_ms if memcpy_ms else float("nan")
        row["restore_vs_memcpy_fresh"] = row["restore_ms"] / memcpy_fresh_ms if memcpy_fresh_ms else float("nan")
        rows.append(row)
        if progress:
            print(f"  restore: prefix {prefix_tokens} done", file=sys.stderr, flush=True)
    return rows


def serving_part(prefix_lengths: list[int], worker_counts: list[int], requests: int, configs: tuple,
                 model_name: str, progress: bool) -> list[dict]:
    rows = []
    for prefix_tokens in prefix_lengths:
        for workers in worker_counts:
            with tempfile.TemporaryDirectory(prefix="tieredkv-bench-") as warm:
                settings = demo.Settings(workers=workers, requests_per_worker=requests,
                                         prefix_tokens=prefix_tokens, suffix_tokens=64, new_tokens=8,
                                         model=model_name, warm_dir=warm, configs=configs,
                                         namespace_tag=uuid.uuid4().hex[:8])
                doc = demo.run_demo(settings, progress=False)
            for config, numbers in doc["configs"].items():
                rows.append({"prefix_tokens": prefix_tokens, "workers": workers, "config": config, **numbers})
            if progress:
                print(f"  serving: prefix {prefix_tokens}, {workers} workers done", file=sys.stderr, flush=True)
    return rows


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_restore(rows: list[dict]) -> str:
    head = (f"{'prefix':>7} {'KV bytes':>10} {'full prefill':>13} {'cached TTFT':>12} {'TTFT ratio':>10} | "
            f"{'restore':>9} {'memcpy':>9} {'ratio':>6} | {'restore*':>9} {'memcpy*':>9} {'ratio*':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['prefix_tokens']:>7} {_mib(r['kv_bytes']):>10} {r['full_prefill_ms']:>10.1f} ms "
                     f"{r['cached_ttft_ms']:>9.1f} ms {100 * r['ttft_ratio']:>9.1f}% | "
                     f"{r['restore_ms']:>6.2f} ms {r['memcpy_fresh_ms']:>6.2f} ms "
                     f"{r['restore_vs_memcpy_fresh']:>5.2f}x | "
                     f"{r['restore_reused_ms']:>6.2f} ms {r['memcpy_ms']:>6.2f} ms {r['restore_vs_memcpy']:>5.2f}x")
    lines.append("restore/memcpy: into fresh memory (reuse_host_buffer=False); restore*/memcpy*: into the kept "
                 "buffer (the default, memory already touched)")
    return "\n".join(lines)


def format_serving(rows: list[dict]) -> str:
    head = f"{'prefix':>7} {'workers':>7} {'config':<9} {'TTFT p50':>10} {'TTFT p99':>10} {'tok/s':>7} " \
           f"{'hit':>5} {'ideal':>5} {'prefix KV held':>15} {'PSS':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['prefix_tokens']:>7} {r['workers']:>7} {r['config']:<9} {r['ttft_p50_ms']:>7.1f} ms "
                     f"{r['ttft_p99_ms']:>7.1f} ms {r['tokens_per_s']:>7.1f} {100 * r['prefix_hit_rate']:>4.0f}% "
                     f"{100 * r['ideal_prefix_hit_rate']:>4.0f}% {_mib(r['prefix_kv_bytes']):>15} "
                     f"{_mib(r['pss_bytes']):>11}")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    restore = doc["restore"]
    x = [r["prefix_tokens"] for r in restore]
    axes[0].plot(x, [r["full_prefill_ms"] for r in restore], "o-", label="full prefill")
    axes[0].plot(x, [r["cached_ttft_ms"] for r in restore], "o-", label="TTFT, prefix in hot tier")
    axes[0].plot(x, [r["restore_ms"] for r in restore], "o-", label="restore (lookup+load)")
    axes[0].plot(x, [r["memcpy_ms"] for r in restore], "o--", label="memcpy of the same bytes")
    axes[0].set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="ms", title="one request")
    axes[0].legend(fontsize=8)
    serving = doc["serving"]
    prefixes = sorted({r["prefix_tokens"] for r in serving})
    biggest = prefixes[-1] if prefixes else None
    for config in ("no_cache", "private", "shared"):
        pts = [r for r in serving if r["config"] == config and r["prefix_tokens"] == biggest]
        if pts:
            axes[1].plot([r["workers"] for r in pts], [r["ttft_p50_ms"] for r in pts], "o-", label=config)
            axes[2].plot([r["workers"] for r in pts], [r["prefix_kv_bytes"] / (1 << 20) for r in pts], "o-",
                         label=config)
    axes[1].set(xlabel="workers", ylabel="TTFT p50 (ms)", title=f"serving, {biggest}-token prefix")
    axes[2].set(xlabel="workers", ylabel="MiB", title="KV of the shared prefix held, all workers")
    for ax in axes[1:]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized run (< 60 s)")
    parser.add_argument("--prefix-lengths", default="1024,4096,16384")
    parser.add_argument("--serving-prefix-lengths", default=None,
                        help="prefix lengths of the serving sweep (default: --prefix-lengths)")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--requests-per-worker", type=int, default=2)
    parser.add_argument("--configs", default="no_cache,private,shared")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--skip", choices=("restore", "serving"), action="append", default=[])
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--plot", metavar="OUT.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefix_lengths, args.serving_prefix_lengths, args.workers, args.reps = "256,1024", "256", "1,2", 2
    prefixes = [int(x) for x in args.prefix_lengths.split(",")]
    serving_prefixes = [int(x) for x in (args.serving_prefix_lengths or args.prefix_lengths).split(",")]
    workers = [int(x) for x in args.workers.split(",")]
    configs = tuple(c for c in demo.CONFIGS if c in args.configs.split(","))
    started = time.perf_counter()
    doc = {"settings": {**vars(args), "cpu_count": os.cpu_count(),
                        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "")},
           "restore": [], "serving": []}
    if "restore" not in args.skip:
        doc["restore"] = restore_part(prefixes, args.reps, args.model, progress=True)
        print(format_restore(doc["restore"]))
    if "serving" not in args.skip:
        doc["serving"] = serving_part(serving_prefixes, workers, args.requests_per_worker, configs, args.model,
                                      progress=True)
        print(format_serving(doc["serving"]))
    doc["settings"]["wall_s"] = time.perf_counter() - started
    print(f"done in {doc['settings']['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
