"""The speed table: every figure of the copy/read paths as a ratio to its baseline, in one run.

    python benchmarks/speed.py [--quick] [--skip-model] [--json OUT]

Runs the relevant parts of hot_tier.py, tiered.py, warm_tier.py, restore_processes.py, serving.py and
the simulator, and prints one row per figure: ours, its baseline measured in the same run on the
same bytes, and the ratio (higher is better unless the row says otherwise). Medians over repeats;
baselines and subjects are interleaved or measured back to back, so both see the same machine load.
To compare two versions of tieredkv, run this file from each checkout (the benchmarks import the
``tieredkv`` next to them) and compare the ratios, not the absolute times.

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the tieredkv of this checkout

import block_overhead  # noqa: E402
import hot_tier  # noqa: E402
import restore_processes  # noqa: E402
import tiered  # noqa: E402
import warm_tier  # noqa: E402


def _row(rows, figure, ours, baseline, ratio, goal, unit=""):
    rows.append({"figure": figure, "ours": ours, "baseline": baseline, "ratio": ratio, "goal": goal, "unit": unit})
    print(f"| {figure} | {ours} | {baseline} | **{ratio:.2f}** | {goal} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    ap.add_argument("--skip-model", action="store_true", help="skip the SmolLM2 restore row (loads a model)")
    ap.add_argument("--skip-sim", action="store_true", help="skip the simulator row")
    ap.add_argument("--trace", default=os.path.join(HERE, "traces", "mooncake_synthetic_trace.jsonl"),
                    help="the Mooncake trace for the simulator row (default: benchmarks/traces/)")
    ap.add_argument("--json", metavar="OUT", help="write the rows as JSON")
    args = ap.parse_args(argv)
    q = args.quick
    reps = 5 if q else 9
    rows: list[dict] = []
    import tieredkv

    print(f"tieredkv from {Path(tieredkv.__file__).parent}; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| figure | ours | baseline | ratio | goal |\n|---|---|---|---|---|")

    big = hot_tier.bandwidth("1.75MiB", hot_tier.SPECS["1.75MiB"], 32 if q else 128, 16, reps)
    _row(rows, "hot get, 1.75 MiB blocks, batches of 16 (x memcpy)", f"{big['get_gbps']:.2f} GB/s",
         f"{big['memcpy_gbps']:.2f} GB/s", big["get_ratio"], ">= 0.95")
    _row(rows, "hot put, 1.75 MiB (x memcpy)", f"{big['put_overhead_us_per_block']:.0f} us/block overhead",
         "np.copyto", big["put_ratio"], ">= 0.95")
    huge = restore_processes._mount_huge(512 << 20) if restore_processes._tiers_take_a_directory() else None
    if huge:
        try:
            hb = hot_tier.bandwidth("1.75MiB", hot_tier.SPECS["1.75MiB"], 32 if q else 128, 16, reps, shm_dir=huge)
        finally:
            restore_processes._unmount(huge)
        _row(rows, "hot get, 1.75 MiB blocks, batches of 16, segment on a huge=always tmpfs (x memcpy)",
             f"{hb['get_gbps']:.2f} GB/s", f"{hb['memcpy_gbps']:.2f} GB/s", hb["get_ratio"], ">= 0.95")
        _row(rows, "hot put, 1.75 MiB, segment on a huge=always tmpfs (x memcpy)",
             f"{hb['put_overhead_us_per_block']:.0f} us/block overhead", "np.copyto", hb["put_ratio"], ">= 0.95")
    small = hot_tier.bandwidth("64KiB", hot_tier.SPECS["64KiB"], 256 if q else 1024, 64, reps)
    _row(rows, "hot get, 64 KiB blocks, batches of 64 (x memcpy)",
         f"{small['get_overhead_us_per_block']:.1f} us/block overhead", f"{small['memcpy_gbps']:.2f} GB/s",
         small["get_ratio"], ">= 0.8, <= 5 us/block")
    per = block_overhead.small_round(reps)
    for who, what in (("hot", "HotTier get_many / put_many"),
                      ("cache", "hot-only TieredCache get_blocks / put_blocks")):
        get, put = per[who]["get"], per[who]["put"]
        _row(rows, f"{what}, 64 KiB blocks, batches of 64: overhead per block over memcpy (get / put, us)",
             f"{get['us_per_block']:.1f} / {put['us_per_block']:.1f} us", f"{get['memcpy_us_per_block']:.1f} us/block",
             get["ratio"], "<= 5 / <= 10 us/block")
    flat = block_overhead.big_round(3 if q else reps)
    _row(rows, "hot get of 64 x 1.75 MiB in one call (x ONE flat 112 MiB memcpy)", f"{flat['gbps']['get']:.2f} GB/s",
         f"{flat['gbps']['flat_get']:.2f} GB/s", flat["get_vs_flat"], ">= 0.95")
    _row(rows, "hot put of 64 x 1.75 MiB in one call (x ONE flat 112 MiB memcpy)", f"{flat['gbps']['put']:.2f} GB/s",
         f"{flat['gbps']['flat_put']:.2f} GB/s", flat["put_vs_flat"], ">= 0.90")

    tr = tiered.run(1024 if q else 4096, 3 if q else reps)
    cases = {c["case"]: c for c in tr["cases"]}
    hot = cases["hot only"]
    _row(rows, f"restore a {tr['prefix_tokens']}-token prefix into model layout (x memcpy)",
         f"{hot['lookup_load_ms']:.1f} ms", f"{hot['memcpy_ms']:.1f} ms", hot["speed_vs_memcpy"], "keep (~1)")
    warm = cases["warm only"]
    _row(rows, f"restore a {tr['prefix_tokens']}-token prefix from the warm tier only (x page-cache read)",
         f"{warm['lookup_load_ms']:.1f} ms", f"{warm['pagecache_ms']:.1f} ms", warm["speed_vs_pagecache"], ">= 0.8")

    workdir = tempfile.mkdtemp(prefix="tieredkv-bench-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        bw = warm_tier.bandwidth(workdir, 32 if q else 64, 16, reps, False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for r in bw:
        if r["op"] == "get_many":  # verify="always" is the figure; "never" shows what hashing costs
            _row(rows, f"warm get, page cache {r['cache']}, {r['mode']} (x raw pread)",
                 f"{r['gb_per_s']:.2f} GB/s", f"{r['baseline_gb_per_s']:.2f} GB/s", r["ratio"],
                 "" if r["mode"] != "verify=always" else ">= 0.9" if r["cache"] == "warm" else ">= 0.95")

    rp = restore_processes.run(16 if q else 64, 2 if q else 8, 3 if q else 5, 3 if q else 5, None, True)
    for s in rp["shared"]:
        _row(rows, f"{s['processes']} processes restoring one shared prefix, segment in {s['shm_dir']} "
             "(x private copies, aggregate GB/s)", f"{s['tier_gbps']:.2f} GB/s", f"{s['private_gbps']:.2f} GB/s",
             s["ratio"], ">= 0.95")
    for f in rp["fresh"]:
        _row(rows, f"first restore in a fresh process, segment in {f['shm_dir']} (second / first)",
             f"{f['first_ms']:.1f} ms, {f['first_faults']} faults, {f['huge_mapped_mib']:.0f} MiB huge",
             f"{f['second_ms']:.1f} ms", f["ratio"], ">= 0.95 (first <= 1.05x second)")

    if not args.skip_model:
        import serving

        [r] = serving.restore_part([1024 if q else 4096], 3, "embedded", False)
        restore_ms = r["restore_reused_ms"] if r["default_reuses_buffer"] else r["restore_ms"]
        _row(rows, f"SmolLM2 restore of {r['cached_tokens']} tokens into the model's cache, default path "
             "(memcpy into touched memory / restore)", f"{restore_ms:.1f} ms", f"{r['memcpy_ms']:.1f} ms",
             r["memcpy_ms"] / restore_ms, ">= 0.67 (restore <= 1.5x memcpy)")

    sc = hot_tier.scaling((1024, 65536) if q else (1024, 65536, 1 << 20), reps)
    first, last = sc[0]["get_us_per_block"], sc[-1]["get_us_per_block"]
    _row(rows, "per-block get cost, " + " -> ".join(f"{r['slots']:,}" for r in sc) + " slots (first / last)",
         " -> ".join(f"{r['get_us_per_block']:.1f}" for r in sc) + " us", f"{first:.1f} us", first / last, "flat (~1)")

    if not args.skip_sim:
        from tieredkv.sim import read_trace, run_simulation

        trace_path = Path(args.trace)
        if trace_path.exists():
            trace = read_trace(str(trace_path))
            pols = ["lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc", "prefix_aware", "cost_aware"]
            t0 = time.perf_counter()
            run_simulation(trace, pols[:3] if q else pols, ["5%", "10%", "20%", "40%"], jobs=1)
            wall = time.perf_counter() - t0
            _row(rows, f"simulator: {trace.n_requests} requests x {3 if q else 9} policies x 4 capacities, "
                 "one core (20 s / wall)", f"{wall:.1f} s", "20 s", 20 / wall, ">= 1")
        else:
            print(f"(simulator row skipped: no trace at {trace_path}; give --trace)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "quick": q, "tieredkv": str(Path(tieredkv.__file__).parent)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
