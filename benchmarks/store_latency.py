"""What the warm tier costs the request that stores: ``TieredCache.store`` of a new prompt, per demotion rule.

    python benchmarks/store_latency.py [--quick] [--json OUT]

Cases, each on fresh prompts (every block new) of the seed 7B geometry, measured in the same run:

- ``hot only`` (the baseline): no warm tier;
- ``write_behind`` (the default with a warm dir): the warm write is queued for a background thread;
- ``write_through``: the warm write happens before ``store`` returns;
- ``on_evict``: nothing is written to warm while the hot tier has room.

The ratio is the case's median ``store`` time over the baseline's. Between two measured stores the
write-behind queue is flushed (outside the timing): each store starts with an idle writer thread.
Two settings of what happens then, also outside the timing:

- ``settled``: the warm tier's files are also ``fdatasync``'d, so the kernel is not writing the
  previous store's pages back to disk while the next store runs: the cost of ``store`` itself;
- ``busy``: no sync: the kernel's writeback of what the warm tier just wrote overlaps the next store,
  as on a server that stores continuously (on a machine with few cores this is visible).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time

import numpy as np
import posix_ipc

from tieredkv import KVSpec, TieredCache

SPEC = KVSpec(model_id="bench/seed-7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16")
CASES = [("hot only", None), ("write_behind", "write_behind"), ("write_through", "write_through"),
         ("on_evict", "on_evict")]


def _settle(cache: TieredCache) -> None:
    """Write the warm tier's dirty pages to disk now (so that no writeback overlaps the next store)."""
    for path in cache.warm.path.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)


def measure(demotion: str | None, prompt_tokens: int, repeats: int, kv: np.ndarray, settled: bool) -> list[float]:
    spec = SPEC
    n_blocks = prompt_tokens // spec.chunk_tokens
    name = f"/tieredkv-bench-store-{os.getpid()}-{secrets.token_hex(3)}"
    warm_dir = tempfile.mkdtemp(prefix="tieredkv-bench-store-") if demotion else None
    capacity = (repeats + 2) * n_blocks * spec.block_bytes
    kw = dict(warm_dir=warm_dir, warm_bytes=capacity, demotion=demotion) if demotion else {}
    rng = np.random.default_rng(7)
    times = []
    try:
        with TieredCache(spec, hot_bytes=capacity + (64 << 20), hot_name=name, **kw) as cache:
            for i in range(repeats + 1):
                tokens = rng.integers(0, 50_000, prompt_tokens)      # new blocks every time
                t0 = time.perf_counter()
                stored = cache.store(tokens, kv)
                elapsed = time.perf_counter() - t0
                assert stored == n_blocks
                assert cache.flush(60)                               # idle writer for the next store
                if settled and cache.warm is not None:
                    _settle(cache)
                if i:                                                # the first call warms up
                    times.append(elapsed)
            if demotion in ("write_behind", "write_through"):
                assert cache.warm.stats().used_blocks == (repeats + 1) * n_blocks
    finally:
        if warm_dir:
            shutil.rmtree(warm_dir, ignore_errors=True)
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
    return times


def run(prompt_tokens: int, repeats: int) -> dict:
    spec = SPEC
    kv = np.random.default_rng(1).standard_normal(
        (spec.num_layers, 2, spec.num_kv_heads, prompt_tokens, spec.head_dim)).astype(np.float16)
    rows = []
    for settled in (True, False):
        raw = {label: [] for label, _ in CASES}
        # Interleave the cases round by round: a burst of load on the shared machine hits all of them.
        for _ in range(3):
            for label, demotion in CASES:
                raw[label] += measure(demotion, prompt_tokens, repeats, kv, settled)
        base = statistics.median(raw["hot only"])
        for label, _ in CASES:
            t = sorted(raw[label])
            med = statistics.median(t)
            rows.append({"case": label, "disk": "settled" if settled else "busy", "store_ms_median": med * 1e3,
                         "store_ms_p90": t[int(0.9 * (len(t) - 1))] * 1e3, "ratio_to_hot_only": med / base,
                         "samples": len(t)})
    return {"prompt_tokens": prompt_tokens, "blocks": prompt_tokens // spec.chunk_tokens,
            "bytes": prompt_tokens // spec.chunk_tokens * spec.block_bytes, "cases": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512-token prompts, few repeats (< 30 s)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = ap.parse_args(argv)
    report = run(512 if args.quick else 2048, 3 if args.quick else 8)
    print(f"store of a new {report['prompt_tokens']}-token prompt ({report['blocks']} blocks, "
          f"{report['bytes'] / 2**20:.0f} MiB, seed 7B geometry)")
    print("| disk | case | store ms (median) | p90 | x hot only |")
    print("|---|---|---|---|---|")
    for r in report["cases"]:
        print(f"| {r['disk']} | {r['case']} | {r['store_ms_median']:.1f} | {r['store_ms_p90']:.1f} | "
              f"{r['ratio_to_hot_only']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
