"""Simulator benchmark: replay speed beside libCacheSim's, and miss-ratio curves of a trace.

Usage::

    python benchmarks/simulate.py --out bench-out            # full: Mooncake trace, 9 policies
    python benchmarks/simulate.py --out bench-out --quick    # smoke (< 30 s)

Writes ``simulate.json`` and ``mrc.png`` into ``--out`` and prints two tables:

1. throughput: our replay (requests/s and block accesses/s; the same policy code as the hot tier,
   one request = one prompt, batched) beside libCacheSim's native replay of the same block accesses
   (its C trace reader and loop, ``process_trace``) and its per-access Python API, at the same
   capacity, in this run, with each one's block hit ratio. Medians of ``--repeat`` runs.
2. the miss-ratio curve table: block and prefix hit ratio per policy and capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from tieredkv.sim import Trace, format_table, plot_mrc, read_trace, run_simulation, simulate

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "traces", "mooncake_synthetic_trace.jsonl")
ALL_POLICIES = ["lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc", "prefix_aware", "cost_aware"]
MRC_CAPACITIES = ["1%", "2%", "5%", "10%", "15%", "20%", "30%", "40%"]


def _libcachesim():
    try:
        import libcachesim as lcs
    except ImportError:
        return None, {}
    from tieredkv.sim.libcachesim import factories

    return lcs, factories(lcs)


def _prefix(trace: Trace, n_requests: int) -> Trace:
    n = min(n_requests, trace.n_requests)
    return Trace.from_requests((trace.request(i).tolist() for i in range(n)), name=f"{trace.name}[:{n}]")


def throughput(trace: Trace, policies: list[str], capacity: int, repeat: int) -> list[dict]:
    """Time our replay and libCacheSim's on the same block accesses at ``capacity`` blocks."""
    lcs, makers = _libcachesim()
    rows = []
    csv_path = None
    if lcs is not None:
        fd, csv_path = tempfile.mkstemp(suffix=".csv")
        with os.fdopen(fd, "w") as f:
            f.write("obj_id,obj_size\n")
            f.write("".join(f"{b},1\n" for b in trace.blocks.tolist()))
    try:
        for name in policies:
            ours_s, ours = [], None
            for _ in range(repeat):
                ours = simulate(trace, name, capacity)
                ours_s.append(ours["seconds"])
            row = {"policy": name, "capacity_blocks": capacity, "requests": trace.n_requests,
                   "accesses": trace.n_accesses, "ours_s": statistics.median(ours_s),
                   "ours_block_hit_ratio": ours["block_hit_ratio"]}
            if name in makers:
                native_s, loop_s = [], []
                for _ in range(repeat):
                    params = lcs.ReaderInitParam(has_header=True, delimiter=",")
                    params.obj_id_field, params.obj_size_field = 1, 2
                    reader = lcs.TraceReader(csv_path, lcs.TraceType.CSV_TRACE, params)
                    cache = makers[name](capacity)
                    t0 = time.perf_counter()
                    miss_ratio, _ = cache.process_trace(reader)
                    native_s.append(time.perf_counter() - t0)
                    cache = makers[name](capacity)
                    req = lcs.Request()
                    req.obj_size = 1
                    hits = 0
                    t0 = time.perf_counter()
                    for key in trace.blocks.tolist():
                        req.obj_id = key
                        hits += cache.get(req)
                    loop_s.append(time.perf_counter() - t0)
                row.update(lcs_native_s=statistics.median(native_s), lcs_python_s=statistics.median(loop_s),
                           lcs_block_hit_ratio=1.0 - miss_ratio)
            rows.append(row)
    finally:
        if csv_path:
            os.unlink(csv_path)
    for r in rows:
        r["ours_requests_per_s"] = r["requests"] / r["ours_s"]
        r["ours_accesses_per_s"] = r["accesses"] / r["ours_s"]
        if "lcs_native_s" in r:
            r["lcs_native_requests_per_s"] = r["requests"] / r["lcs_native_s"]
            r["lcs_native_accesses_per_s"] = r["accesses"] / r["lcs_native_s"]
            r["lcs_python_accesses_per_s"] = r["accesses"] / r["lcs_python_s"]
            r["ours_vs_lcs_native"] = r["lcs_native_s"] / r["ours_s"]
    return rows


def _throughput_table(rows: list[dict]) -> str:
    head = ["policy", "ours req/s", "ours acc/s", "lcs C acc/s", "lcs py acc/s", "ours/lcs C",
            "hit ours", "hit lcs"]
    body = []
    for r in rows:
        native = "lcs_native_s" in r
        body.append([r["policy"], f"{r['ours_requests_per_s']:.0f}", f"{r['ours_accesses_per_s']:.0f}",
                     f"{r['lcs_native_accesses_per_s']:.0f}" if native else "-",
                     f"{r['lcs_python_accesses_per_s']:.0f}" if native else "-",
                     f"{r['ours_vs_lcs_native']:.2f}x" if native else "-",
                     f"{r['ours_block_hit_ratio']:.4f}",
                     f"{r['lcs_block_hit_ratio']:.4f}" if native else "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
                     for row in [head, *body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="trace file (default: the Mooncake trace)")
    ap.add_argument("--out", required=True, help="directory for simulate.json and mrc.png")
    ap.add_argument("--quick", action="store_true", help="smoke run: first 500 requests, fewer points")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats for throughput (median)")
    ap.add_argument("--jobs", type=int, default=0, help="processes for the miss-ratio curves (0: per CPU)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    trace = read_trace(args.trace)
    policies, capacities, repeat = ALL_POLICIES, MRC_CAPACITIES, args.repeat
    if args.quick:
        trace = _prefix(trace, 500)
        capacities, repeat = ["5%", "20%"], 1
    capacity = max(1, round(0.05 * trace.unique_blocks))
    print(f"# throughput at {capacity} blocks (5% of unique) on {trace.name}")
    speed = throughput(trace, policies, capacity, repeat)
    print(_throughput_table(speed))

    t0 = time.perf_counter()
    mrc = run_simulation(trace, policies, capacities, jobs=args.jobs)
    mrc_s = time.perf_counter() - t0
    print(f"\n# miss-ratio curves ({len(mrc['results'])} replays in {mrc_s:.1f} s)")
    print(format_table(mrc))

    out = {"trace": trace.name, "quick": args.quick, "throughput": speed, "mrc": mrc,
           "mrc_wall_s": round(mrc_s, 2), "python": sys.version.split()[0], "numpy": np.__version__}
    with open(os.path.join(args.out, "simulate.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    try:
        png = plot_mrc(mrc, os.path.join(args.out, "mrc.png"))
        print(f"\nwrote {os.path.join(args.out, 'simulate.json')} and {png}")
    except ImportError as e:
        print(f"\nwrote {os.path.join(args.out, 'simulate.json')}; no plot: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
