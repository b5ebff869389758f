"""Simulator benchmark: replay speed beside libCacheSim's, policy operation costs, miss-ratio curves.

Usage::

    python benchmarks/simulate.py --out bench-out            # full: both Mooncake traces, all policies
    python benchmarks/simulate.py --out bench-out --quick    # smoke (< 1 min)
    python benchmarks/simulate.py --out bench-out --trace benchmarks/traces/mooncake_synthetic_trace.jsonl

Writes ``simulate.json`` and ``mrc_<trace>.png`` into ``--out`` and prints, with the load average
(``os.getloadavg``) beside every section (the machine may be shared; compare ratios from one run):

1. throughput (first trace): our replay (requests/s and block accesses/s; the same policy code as
   the hot tier, one request = one prompt, batched; also without the numba kernels, "numpy-only")
   beside libCacheSim's native replay of the same block accesses (its C trace reader and loop,
   ``process_trace``) and its per-access Python API, at the same capacity, in this run, with each
   one's block hit ratio. Medians of ``--repeat`` runs;
   the last row sums the policies both have: a whole sweep, ours against libCacheSim's;
2. policy operation costs: median microseconds per ``insert`` / ``hit`` / ``evict`` call of 16
   blocks on a full state of 8,192 slots in shared memory (what the hot tier pays under its lock);
3. per trace, the miss-ratio curve table: block and prefix hit ratio per policy and capacity,
   Belady's MIN beside them and the fraction of the LRU-to-optimum gap each policy closes.
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

from tieredkv.policies import _jit
from tieredkv.sim import Trace, format_table, plot_mrc, read_trace, run_simulation, simulate

TRACES = [os.path.join(os.path.dirname(__file__), "traces", f"mooncake_{kind}_trace.jsonl")
          for kind in ("synthetic", "conversation")]
ALL_POLICIES = ["lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc", "prefix_aware", "cost_aware",
                "kv_aware"]
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
        warm_up = _prefix(trace, 50)
        for name in policies:
            simulate(warm_up, name, capacity)   # loads (or compiles) the numba kernels outside the timing
            ours_s, numpy_s, ours = [], [], None
            for _ in range(repeat):
                ours = simulate(trace, name, capacity)
                ours_s.append(ours["seconds"])
                if _jit.ENABLED:            # the same replay without the compiled kernels
                    _jit.ENABLED = False
                    try:
                        numpy_s.append(simulate(trace, name, capacity)["seconds"])
                    finally:
                        _jit.ENABLED = True
            row = {"policy": name, "capacity_blocks": capacity, "requests": trace.n_requests,
                   "accesses": trace.n_accesses, "ours_s": statistics.median(ours_s),
                   "ours_block_hit_ratio": ours["block_hit_ratio"],
                   "ours_numpy_s": statistics.median(numpy_s) if numpy_s else None}
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
    both = [r for r in rows if "lcs_native_s" in r]
    if both:
        rows.append({"policy": "sweep", "capacity_blocks": capacity, "requests": trace.n_requests * len(both),
                     "accesses": trace.n_accesses * len(both), "ours_s": sum(r["ours_s"] for r in both),
                     "lcs_native_s": sum(r["lcs_native_s"] for r in both),
                     "lcs_python_s": sum(r["lcs_python_s"] for r in both),
                     "ours_numpy_s": (sum(r["ours_numpy_s"] for r in both)
                                      if all(r["ours_numpy_s"] for r in both) else None),
                     "ours_block_hit_ratio": float("nan"), "lcs_block_hit_ratio": float("nan")})
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
    head = ["policy", "ours req/s", "ours acc/s", "numpy-only acc/s", "lcs C acc/s", "lcs py acc/s",
            "ours/lcs C", "hit ours", "hit lcs"]
    body = []
    for r in rows:
        native = "lcs_native_s" in r
        numpy_only = f"{r['accesses'] / r['ours_numpy_s']:.0f}" if r.get("ours_numpy_s") else "-"
        body.append([r["policy"], f"{r['ours_requests_per_s']:.0f}", f"{r['ours_accesses_per_s']:.0f}", numpy_only,
                     f"{r['lcs_native_accesses_per_s']:.0f}" if native else "-",
                     f"{r['lcs_python_accesses_per_s']:.0f}" if native else "-",
                     f"{r['ours_vs_lcs_native']:.2f}x" if native else "-",
                     f"{r['ours_block_hit_ratio']:.4f}" if r["policy"] != "sweep" else "-",
                     f"{r['lcs_block_hit_ratio']:.4f}" if native and r["policy"] != "sweep" else "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
                     for row in [head, *body])


def op_costs(names: list[str], n_slots: int = 8192, batch: int = 16, rounds: int = 300) -> list[dict]:
    """Microseconds per insert / hit / evict call of ``batch`` blocks, on a full shared-memory state."""
    from multiprocessing import shared_memory

    from tieredkv import policies as pol

    rows = []
    for name in names:
        policy = pol.make(name)
        layout = pol.StateLayout.for_policy(policy, n_slots)
        shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
        try:
            st = pol.SlotState.over(policy, n_slots, shm.buf, 0)
            st.reset()
            rng = np.random.default_rng(0)
            key = 1
            for start in range(0, n_slots, batch):                 # fill, in prompt-like chains
                slots = np.arange(start, min(start + batch, n_slots))
                parents = np.concatenate([[-1], slots[:-1]])
                pol.insert(policy, st, slots, np.arange(key, key + len(slots)), parents, np.arange(len(slots)))
                key += len(slots)
            t_hit, t_evict, t_insert = [], [], []
            for _ in range(rounds):
                hits = rng.choice(n_slots, size=batch, replace=False)
                hits = hits[st.resident[hits] == 1]
                t0 = time.perf_counter()
                pol.hit(policy, st, hits)
                t1 = time.perf_counter()
                keys = np.arange(key, key + batch)
                key += batch
                victims = pol.evict(policy, st, batch, incoming=keys)
                t2 = time.perf_counter()
                parents = np.concatenate([[-1], victims[:-1]])
                pol.insert(policy, st, victims, keys[:len(victims)], parents, np.arange(len(victims)))
                t3 = time.perf_counter()
                t_hit.append(t1 - t0)
                t_evict.append(t2 - t1)
                t_insert.append(t3 - t2)
            del st
        finally:
            shm.close()
            shm.unlink()
        # Medians: on a shared machine a mean is one descheduling away from meaningless.
        rows.append({"policy": name, "n_slots": n_slots, "batch": batch,
                     "hit_us": 1e6 * statistics.median(t_hit), "evict_us": 1e6 * statistics.median(t_evict),
                     "insert_us": 1e6 * statistics.median(t_insert)})
    return rows


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", nargs="+", default=TRACES, help="trace files (default: both Mooncake traces)")
    ap.add_argument("--out", required=True, help="directory for simulate.json and the plots")
    ap.add_argument("--quick", action="store_true", help="smoke run: first 500 requests, fewer points")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats for throughput (median)")
    ap.add_argument("--jobs", type=int, default=0, help="processes for the miss-ratio curves (0: per CPU)")
    ap.add_argument("--no-mrc", action="store_true", help="only the throughput and operation-cost tables")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    traces = [read_trace(path) for path in args.trace]
    policies, capacities, repeat = ALL_POLICIES, MRC_CAPACITIES, args.repeat
    if args.quick:
        traces = [_prefix(t, 500) for t in traces]
        capacities, repeat = ["5%", "20%"], 1
    trace = traces[0]
    capacity = max(1, round(0.05 * trace.unique_blocks))
    print(f"# throughput at {capacity} blocks (5% of unique) on {trace.name}; {_load()}")
    speed = throughput(trace, policies, capacity, repeat)
    print(_throughput_table(speed))
    print(f"# after: {_load()}")

    print(f"\n# policy operation costs (8,192 slots in shared memory, 16 blocks a call); {_load()}")
    costs = op_costs(policies, rounds=50 if args.quick else 300)
    print("\n".join(f"{r['policy']:<14} hit {r['hit_us']:7.1f} us   evict {r['evict_us']:7.1f} us   "
                    f"insert {r['insert_us']:7.1f} us" for r in costs))

    out: dict = {"quick": args.quick, "throughput": speed, "op_costs": costs, "mrc": {},
                 "python": sys.version.split()[0], "numpy": np.__version__, "load_before": os.getloadavg()}
    for t in [] if args.no_mrc else traces:
        t0 = time.perf_counter()
        mrc = run_simulation(t, policies, capacities, jobs=args.jobs)
        mrc_s = time.perf_counter() - t0
        print(f"\n# miss-ratio curves of {t.name} ({len(mrc['results'])} replays and "
              f"{len(mrc['optimal'])} optimum runs in {mrc_s:.1f} s); {_load()}")
        print(format_table(mrc))
        out["mrc"][t.name] = dict(mrc, wall_s=round(mrc_s, 2))
        try:
            stem = os.path.splitext(t.name)[0].replace("[:", "_").replace("]", "")
            png = plot_mrc(mrc, os.path.join(args.out, f"mrc_{stem}.png"))
            print(f"wrote {png}")
        except ImportError as e:
            print(f"no plot: {e}")
    out["load_after"] = os.getloadavg()
    with open(os.path.join(args.out, "simulate.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {os.path.join(args.out, 'simulate.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
