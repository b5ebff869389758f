"""Warm tier benchmark: bandwidth vs plain pread/pwrite, cost of each sync mode, cold-start time.

    python benchmarks/warm_tier.py [--quick] [--dir DIR] [--json OUT]

Every bandwidth is reported next to a baseline measured in the same run on the same bytes: plain
``os.pwritev`` / ``os.preadv`` of the same blocks to a preallocated file in the same directory.
"warm" = page cache warm; "cold" = page cache dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` on
every file involved (after fdatasync, so the pages are clean and really dropped) before each read.
Cold start: a fresh process opens a tier holding N small blocks and serves the first hit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import payload_for

BIG = KVSpec(model_id="bench/big", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16",
             chunk_tokens=64)  # 1.75 MiB blocks
SMALL = KVSpec(model_id="bench/small", num_layers=1, num_kv_heads=1, head_dim=32, dtype="float16",
               chunk_tokens=16)  # 2 KiB blocks in 4 KiB slots


def progress(it, desc, enabled):
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(it, desc=desc, leave=False, file=sys.stderr)
        except ImportError:
            pass
    return it


def med(xs):
    return statistics.median(xs)


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tier_files(tier):
    d = str(tier.path)
    return [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.startswith("slab-")]


# ---- bandwidth ------------------------------------------------------------------------------------
def _put_all(tier, keys, pay, batch):
    for b in range(0, len(keys), batch):
        tier.put_many(keys[b:b + batch], pay[b:b + batch])


def _base_put(fd, pay, slot, batch, sync):
    """The same durability as the tier's mode: sync="data"/"full" fdatasync per batch."""
    for b in range(0, len(pay), batch):
        for i in range(b, min(len(pay), b + batch)):
            os.pwritev(fd, [pay[i]], i * slot)
        if sync:
            os.fdatasync(fd)


def _get_all(tier, keys, out, batch):
    for b in range(0, len(keys), batch):
        assert tier.get_many(keys[b:b + batch], out[b:b + batch]) == min(batch, len(keys) - b)


def bandwidth(workdir, n_blocks, batch, repeats, show):
    spec = BIG
    bb = spec.block_bytes
    keys = chunk_keys(spec, np.arange(n_blocks * spec.chunk_tokens))
    pay = payload_for(keys, bb)
    out = np.empty_like(pay)
    base_path = os.path.join(workdir, "baseline.bin")
    slot = -(-bb // 4096) * 4096
    fd = os.open(base_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, n_blocks * slot)
    rows = []

    def base_write():
        for b in range(0, n_blocks, batch):
            for i in range(b, min(n_blocks, b + batch)):
                os.pwritev(fd, [pay[i]], i * slot)

    def base_read():
        for b in range(0, n_blocks, batch):
            for i in range(b, min(n_blocks, b + batch)):
                os.preadv(fd, [out[i]], i * slot)

    def timed(fn, before=None):
        ts = []
        for _ in range(repeats):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return ts

    total = n_blocks * bb
    gbps = lambda s: total / s / 1e9  # noqa: E731

    def paired(base_fn, tier_fn, before_base=None, before_tier=None):
        """Alternate baseline and tier runs so both see the same machine state; medians of each."""
        bs, ts = [], []
        for _ in range(repeats):
            for fn, before, acc in ((base_fn, before_base, bs), (tier_fn, before_tier, ts)):
                if before:
                    before()
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        return med(bs), med(ts)

    def row(op, mode, cache, base_s, tier_s):
        rows.append(dict(op=op, mode=mode, cache=cache, seconds_median=tier_s, gb_per_s=gbps(tier_s),
                         baseline_gb_per_s=gbps(base_s), ratio=base_s / tier_s))

    base_write()  # first touch of the preallocated extents, outside the timings
    for sync in progress(["none", "data", "full"], "put_many by sync mode", show):
        root = os.path.join(workdir, f"bw-{sync}")
        tier = WarmTier(spec, root, capacity_bytes=n_blocks * slot, sync=sync, verify="always")
        put = functools.partial(_put_all, tier, keys, pay, batch)
        put()  # first touch of the slab extents
        base_put = functools.partial(_base_put, fd, pay, slot, batch, sync != "none")
        base_s, tier_s = paired(base_put, put, None, functools.partial(tier.remove, keys))
        row("put_many", f"sync={sync}", "warm", base_s, tier_s)
        tier.close()
        if sync == "none":
            for verify in ["always", "sampled", "never"]:
                tier = WarmTier(spec, root, verify=verify)
                get = functools.partial(_get_all, tier, keys, out, batch)
                for cache in ["warm", "cold"]:
                    cold = cache == "cold"
                    base_s, tier_s = paired(base_read, get,
                                            functools.partial(drop_cache, [base_path]) if cold else None,
                                            functools.partial(drop_cache, tier_files(tier)) if cold else None)
                    row("get_many", f"verify={verify}", cache, base_s, tier_s)
                assert np.array_equal(out, pay)
                tier.close()
        shutil.rmtree(root)
    os.close(fd)
    os.unlink(base_path)
    return rows


def sync_latency(workdir, calls, show):
    """Latency of one put_many of one 1.75 MiB block and of one small block, per sync mode."""
    rows = []
    for spec, label in ((BIG, "1 x 1.75 MiB"), (SMALL, "1 x 2 KiB")):
        slot = -(-spec.block_bytes // 4096) * 4096
        for sync in progress(["none", "data", "full"], f"sync cost {label}", show):
            root = os.path.join(workdir, f"lat-{sync}")
            keys = chunk_keys(spec, np.arange(calls * spec.chunk_tokens))
            pay = payload_for(keys, spec.block_bytes)
            with WarmTier(spec, root, capacity_bytes=(calls + 1) * slot, sync=sync) as tier:
                ts = []
                for i in range(calls):
                    t0 = time.perf_counter()
                    tier.put_many(keys[i:i + 1], pay[i:i + 1])
                    ts.append(time.perf_counter() - t0)
            shutil.rmtree(root)
            rows.append(dict(put=label, sync=sync, ms_median=med(ts) * 1e3, ms_p99=p99(ts) * 1e3,
                             puts_per_s=1 / med(ts)))
    return rows


# ---- cold start -----------------------------------------------------------------------------------
_CHILD = r"""
import sys, time, json
import numpy as np
from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier
spec = KVSpec(**json.loads(sys.argv[2]))
prompt = int(sys.argv[3])
keys = chunk_keys(spec, np.arange(prompt * 64 * spec.chunk_tokens, (prompt + 1) * 64 * spec.chunk_tokens))
out = np.empty((len(keys), spec.block_bytes), np.uint8)
t0 = time.perf_counter()
tier = WarmTier(spec, sys.argv[1])
t1 = time.perf_counter()
n = tier.get_many(keys[:1], out[:1])
t2 = time.perf_counter()
assert n == 1, n
print(json.dumps({"open_ms": (t1 - t0) * 1e3, "first_hit_ms": (t2 - t0) * 1e3}))
tier.close()
"""


def cold_start(workdir, sizes, runs, show):
    rows = []
    spec = SMALL
    for n_blocks in progress(sizes, "cold start", show):
        root = os.path.join(workdir, f"cold-{n_blocks}")
        prompts = n_blocks // 64
        with WarmTier(spec, root, capacity_bytes=n_blocks * 4096) as tier:
            for p in progress(range(prompts), f"fill {n_blocks}", show):
                keys = chunk_keys(spec, np.arange(p * 64 * spec.chunk_tokens, (p + 1) * 64 * spec.chunk_tokens))
                tier.put_many(keys, payload_for(keys, spec.block_bytes))
            stored = tier.stats().used_blocks
        res = []
        for r in range(runs):
            proc = subprocess.run([sys.executable, "-c", _CHILD, root, json.dumps(spec.to_dict()),
                                   str((r * 7919) % prompts)], capture_output=True, text=True, check=True)
            res.append(json.loads(proc.stdout))
        shutil.rmtree(root)
        rows.append(dict(blocks=stored, open_ms_median=med([x["open_ms"] for x in res]),
                         first_hit_ms_median=med([x["first_hit_ms"] for x in res]),
                         first_hit_ms_max=max(x["first_hit_ms"] for x in res)))
    return rows


def table(rows, cols):
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, widths)))
    print()


def fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke-sized run (< 20 s)")
    ap.add_argument("--dir", default=None, help="where to put the tiers and baseline file (default: a "
                                                "temporary directory under /var/tmp)")
    ap.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    show = not args.no_progress and sys.stderr.isatty()
    base = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
    workdir = tempfile.mkdtemp(prefix="tieredkv-bench-", dir=base)
    if args.quick:
        n_blocks, batch, repeats, calls, sizes, runs = 32, 16, 3, 20, [1_000, 10_000], 3
    else:
        n_blocks, batch, repeats, calls, sizes, runs = 64, 16, 7, 100, [1_000, 10_000, 100_000], 7
    try:
        t0 = time.perf_counter()
        bw = bandwidth(workdir, n_blocks, batch, repeats, show)
        lat = sync_latency(workdir, calls, show)
        cold = cold_start(workdir, sizes, runs, show)
        elapsed = time.perf_counter() - t0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"warm tier benchmark: {n_blocks} blocks of {BIG.block_bytes} bytes in batches of {batch}, "
          f"median of {repeats}; dir {base or tempfile.gettempdir()}; cold = posix_fadvise DONTNEED\n")
    table(bw, ["op", "mode", "cache", "gb_per_s", "baseline_gb_per_s", "ratio"])
    table(lat, ["put", "sync", "ms_median", "ms_p99", "puts_per_s"])
    table(cold, ["blocks", "open_ms_median", "first_hit_ms_median", "first_hit_ms_max"])
    print(f"total {elapsed:.1f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": dict(quick=args.quick, n_blocks=n_blocks, batch=batch, repeats=repeats,
                                      block_bytes=BIG.block_bytes, cold_method="posix_fadvise DONTNEED",
                                      dir=base), "bandwidth": bw, "sync_latency": lat, "cold_start": cold,
                       "seconds": elapsed}, f, indent=1)


if __name__ == "__main__":
    main()
