"""A whole-trace sweep, ours beside libCacheSim's, in one run: the simulator's speed goal.

Usage::

    python benchmarks/sweep_speed.py                      # both Mooncake traces, 7 policies x 8 capacities
    python benchmarks/sweep_speed.py --quick              # smoke: first 1,000 requests, 3 capacities
    python benchmarks/sweep_speed.py --repeat 3 --out bench-out --trace benchmarks/traces/mooncake_synthetic_trace.jsonl

For each trace, each repeat times two sweeps over the same policies (LRU, FIFO, LFU, CLOCK, SIEVE,
S3-FIFO, ARC: the ones libCacheSim also has) and the same capacities (a share of the trace's unique
blocks, as ``tieredkv simulate`` takes them):

- ours: ``run_simulation(trace, policies, capacities, jobs=1, optimal=False)``, the replay behind
  ``tieredkv simulate`` (one request = one prompt: lookup, hits, then the misses stored as a batch);
- libCacheSim: per policy and capacity, a fresh cache and ``process_trace`` over the same block
  accesses (one access per block, in request order) read from its binary ``oracleGeneral`` format,
  its fastest reader (opening the reader is timed too); twice: with its default hash table
  (``hashpower=24``: allocating 2**24 buckets costs ~0.1-0.2 s per cache, most of a run on these
  traces) and with a table fitted to the trace (the smallest power of two >= its unique blocks),
  which is how to run it fast and the baseline the ratios are given against first.

Both run in this one process on one thread (no parallel jobs on either side). The repeats alternate
which side goes first, and each line carries the load average (``os.getloadavg``): the machine may be
shared, so compare the ratios, which come from the same run. Wall and CPU (``time.process_time``)
seconds are both reported; the CPU ratio is the less load-sensitive one. The numba kernels' compile
(or cache load) is done before the timing and reported on its own line.

Also checked, not timed: fed the accesses one block per request (what libCacheSim sees), our
replay's block hit ratio equals libCacheSim's within 0.5 percentage points for the policies whose
parameters match (``tieredkv.sim.libcachesim.MATCHING``), at 5% of the synthetic trace.
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

from tieredkv.sim import Trace, read_trace, resolve_capacity, run_simulation, simulate
from tieredkv.sim.libcachesim import MATCHING, factories

TRACES = [os.path.join(os.path.dirname(__file__), "traces", f"mooncake_{kind}_trace.jsonl")
          for kind in ("synthetic", "conversation")]
POLICIES = ["lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc"]
CAPACITIES = ["1%", "2%", "5%", "10%", "15%", "20%", "30%", "40%"]   # docs/policies.md's curves


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _prefix(trace: Trace, n: int) -> Trace:
    n = min(n, trace.n_requests)
    return Trace.from_requests((trace.request(i).tolist() for i in range(n)), name=f"{trace.name}[:{n}]")


def _oracle_general(trace: Trace, path: str) -> None:
    """The block accesses in libCacheSim's binary oracleGeneral records (time, id, size, next access)."""
    rec = np.zeros(trace.n_accesses, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"),
                                                      ("next", "<i8")]))
    rec["t"] = np.arange(trace.n_accesses)
    rec["id"] = trace.blocks
    rec["size"] = 1
    rec["next"] = -1
    rec.tofile(path)


def ours(trace: Trace, caps: list[int]) -> dict:
    """One sweep of our replay; wall and CPU seconds, and each replay's own seconds and hit ratio."""
    w0, c0 = _clocks()
    out = run_simulation(trace, POLICIES, caps, jobs=1, optimal=False)
    w1, c1 = _clocks()
    return {"wall_s": w1 - w0, "cpu_s": c1 - c0,
            "runs": {f"{r['policy']}@{r['capacity_blocks']}": (r["seconds"], r["block_hit_ratio"])
                     for r in out["results"]}}


def theirs(makers, lcs, path: str, caps: list[int]) -> dict:
    """One sweep of libCacheSim's ``process_trace`` over the same accesses."""
    runs = {}
    wall = cpu = 0.0
    for name in POLICIES:
        for cap in caps:
            w0, c0 = _clocks()
            reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
            miss_ratio, _ = makers[name](cap).process_trace(reader)
            w1, c1 = _clocks()
            wall += w1 - w0
            cpu += c1 - c0
            runs[f"{name}@{cap}"] = (w1 - w0, 1.0 - miss_ratio)
    return {"wall_s": wall, "cpu_s": cpu, "runs": runs}


def agreement(lcs, makers, trace: Trace, path: str) -> dict:
    """Per-block replay (one block per request) against libCacheSim at 5%: hit ratios and the gap."""
    per_block = Trace(trace.name + " per block", trace.blocks, np.arange(trace.n_accesses + 1, dtype=np.int64))
    cap = resolve_capacity("5%", trace.unique_blocks)
    rows = {}
    for name in POLICIES:
        ours_hit = simulate(per_block, name, cap)["block_hit_ratio"]
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        theirs_hit = 1.0 - makers[name](cap).process_trace(reader)[0]
        rows[name] = {"ours": ours_hit, "libcachesim": theirs_hit, "gap_pp": 100 * abs(ours_hit - theirs_hit)}
    return {"capacity_blocks": cap, "policies": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", nargs="+", default=TRACES, help="trace files (default: both Mooncake traces)")
    ap.add_argument("--capacities", default=",".join(CAPACITIES), help="comma-separated, N%% of unique blocks")
    ap.add_argument("--repeat", type=int, default=2, help="sweeps per side and trace")
    ap.add_argument("--quick", action="store_true", help="smoke: first 1,000 requests, 1%%/5%%/20%%, one repeat")
    ap.add_argument("--out", help="directory for sweep_speed.json")
    args = ap.parse_args(argv)
    try:
        import libcachesim as lcs
    except ImportError:
        print("libcachesim is not installed (pip install libcachesim): nothing to compare with", file=sys.stderr)
        return 2
    makers = factories(lcs)   # the default hash table (2**24 buckets)
    capacities = [c.strip() for c in args.capacities.split(",") if c.strip()]
    repeat = args.repeat
    traces = [read_trace(p) for p in args.trace]
    if args.quick:
        traces, capacities, repeat = [_prefix(t, 1000) for t in traces], ["1%", "5%", "20%"], 1

    w0, _ = _clocks()
    for name in POLICIES:   # compile (or load from numba's cache) every kernel before timing
        simulate(_prefix(traces[0], 30), name, 20)
    print(f"# numba kernels compiled or loaded in {_clocks()[0] - w0:.1f} s (once per process; not in the timings)")

    report: dict = {"policies": POLICIES, "capacities": capacities, "traces": {}}
    total = {f"{side}_{clock}": 0.0 for side in ("ours", "lcs", "lcs_default") for clock in ("wall", "cpu")}
    fd, path = tempfile.mkstemp(suffix=".oracleGeneral")
    os.close(fd)
    try:
        for trace in traces:
            caps = sorted({resolve_capacity(c, trace.unique_blocks) for c in capacities})
            _oracle_general(trace, path)
            fitted = factories(lcs, hashpower=max(int(trace.unique_blocks - 1).bit_length(), 10))
            print(f"\n# {trace.name}: {trace.n_requests} requests, {trace.n_accesses} block accesses, "
                  f"{len(POLICIES)} policies x {len(caps)} capacities ({', '.join(capacities)} = {caps} blocks)")
            print("seconds, wall / CPU; speed = libCacheSim's time / ours (> 1: ours is faster)")
            print(f"{'repeat':<7} {'ours':>12} {'lcs fitted':>12} {'lcs default':>12} {'speed vs fitted':>18} "
                  f"{'speed vs default':>18}  load")
            reps = []
            for i in range(repeat):
                sides = ["ours", "lcs", "lcs_default"]
                got = {}
                for side in sides if i % 2 == 0 else sides[::-1]:
                    got[side] = (ours(trace, caps) if side == "ours" else
                                 theirs(fitted if side == "lcs" else makers, lcs, path, caps))
                load = os.getloadavg()
                rep = {"loadavg": load}
                for side in got:
                    rep.update({f"{side}_wall_s": got[side]["wall_s"], f"{side}_cpu_s": got[side]["cpu_s"],
                                f"{side}_runs": got[side]["runs"]})
                reps.append(rep)
                cells = [f"{rep[f'{side}_wall_s']:.2f}/{rep[f'{side}_cpu_s']:.2f}" for side in sides]
                speeds = [f"{rep[f'{side}_wall_s'] / rep['ours_wall_s']:.2f}x/"
                          f"{rep[f'{side}_cpu_s'] / rep['ours_cpu_s']:.2f}x" for side in sides[1:]]
                print(f"{i + 1:<7} {cells[0]:>12} {cells[1]:>12} {cells[2]:>12} {speeds[0]:>18} {speeds[1]:>18}  "
                      f"{_load()}")
                for key in total:
                    side, clock = key.rsplit("_", 1)
                    total[key] += rep[f"{side}_{clock}_s"]
            print("per policy, wall seconds summed over the capacities (median over the repeats), ours / lcs fitted: "
                  + ", ".join(f"{name} {_median_sum(reps, 'ours', name, caps):.2f}/"
                              f"{_median_sum(reps, 'lcs', name, caps):.2f}" for name in POLICIES))
            report["traces"][trace.name] = {"requests": trace.n_requests, "accesses": trace.n_accesses,
                                            "capacity_blocks": caps, "repeats": reps}
        agree = agreement(lcs, fitted if len(traces) == 1 else factories(lcs, hashpower=20), traces[0],
                          path if len(traces) == 1 else _write(traces[0], path))
    finally:
        os.unlink(path)
    report["agreement"] = agree
    worst = max(agree["policies"][n]["gap_pp"] for n in POLICIES if n in MATCHING)
    print(f"\n# all traces: ours {total['ours_wall']:.2f} s wall / {total['ours_cpu']:.2f} s CPU; libCacheSim, "
          f"fitted table {total['lcs_wall']:.2f} / {total['lcs_cpu']:.2f}, default table "
          f"{total['lcs_default_wall']:.2f} / {total['lcs_default_cpu']:.2f}. Ours runs the sweep at "
          f"{total['lcs_wall'] / total['ours_wall']:.2f}x (wall) / {total['lcs_cpu'] / total['ours_cpu']:.2f}x (CPU) "
          f"the speed of libCacheSim with a fitted table, {total['lcs_default_wall'] / total['ours_wall']:.2f}x / "
          f"{total['lcs_default_cpu'] / total['ours_cpu']:.2f}x with its default one; {_load()}")
    print(f"# one block per request at {agree['capacity_blocks']} blocks of {traces[0].name}: block hit ratio "
          f"gap to libCacheSim at most {worst:.3f} pp over {', '.join(n for n in POLICIES if n in MATCHING)} "
          f"(lfu {agree['policies']['lfu']['gap_pp']:.2f} pp: ties broken differently)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_speed.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


def _median_sum(reps: list[dict], side: str, name: str, caps: list[int]) -> float:
    return statistics.median(sum(r[f"{side}_runs"][f"{name}@{c}"][0] for c in caps) for r in reps)


def _write(trace: Trace, path: str) -> str:
    _oracle_general(trace, path)
    return path


if __name__ == "__main__":
    sys.exit(main())
