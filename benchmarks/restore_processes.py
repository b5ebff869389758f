"""Restores from the hot tier by several processes, and the first restore of a fresh process.

    python benchmarks/restore_processes.py [--quick] [--shm-dir DIR] [--json OUT]

Two figures, each a ratio measured in the same run on the same bytes (medians over repeats):

1. ``shared``: N processes restore the same 4k-token prefix (seed 7B geometry, 64 blocks, 112 MiB)
   out of one hot segment into their own model-layout arrays, all at once; the baseline is the same N
   processes each copying the prefix from a private numpy array (the copy a per-worker cache makes).
   Ratio = aggregate GB/s of the tier / aggregate GB/s of the private copies. Large private numpy
   arrays get transparent huge pages (numpy advises them), a /dev/shm segment does not: the run is
   repeated with the segment on a ``huge=always`` tmpfs when one is available (see ``fresh``).
2. ``fresh``: a new process attaches the segment and restores the prefix twice; ratio = the second
   restore's time / the first's (1.0: the first pays nothing extra). The first pays a page fault per
   page of the segment it maps for the first time: 4 KiB pages on /dev/shm, 2 MiB pages on a tmpfs
   mounted ``huge=always`` (``--shm-dir``, or one this benchmark mounts when run as root). Page
   faults are counted with ``getrusage``.

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from hot_tier import segment_dir  # benchmarks/ is on sys.path when run as a script

from tieredkv import HotTier, KVSpec, chunk_keys

SPEC = KVSpec(model_id="bench/seed-7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16")
FORK = mp.get_context("fork")


def _model_layout(n_tokens: int) -> np.ndarray:
    s = SPEC
    return np.ones((s.num_layers, 2, s.num_kv_heads, n_tokens, s.head_dim), s.numpy_dtype)  # touched


def _restore_from(tier: HotTier, keys, dst: np.ndarray) -> int:
    """Restore ``keys`` into the model layout ``dst`` straight out of shared memory."""
    C = SPEC.chunk_tokens
    shape = SPEC.block_shape

    def sink(i: int, block: np.ndarray) -> None:  # the per-block call every tieredkv version has
        np.copyto(dst[:, :, :, i * C:(i + 1) * C, :], block.view(SPEC.numpy_dtype).reshape(shape))

    runs = getattr(tier, "read_runs", None)
    if runs is not None:  # one copy per run of adjacent slots where the version offers it
        from tieredkv.layout import blocks_to_model

        return runs(keys, lambda i, rows: blocks_to_model(SPEC, rows, dst, i * C))
    return tier.read_into(keys, sink)


def _private_restore(blocks: np.ndarray, dst: np.ndarray) -> None:
    C = SPEC.chunk_tokens
    L, two, H, _, D = dst.shape
    k = len(blocks)
    view = np.lib.stride_tricks.as_strided(dst, (L, two, H, k, C, D), (*dst.strides[:3], C * dst.strides[3],
                                                                      dst.strides[3], dst.strides[4]))
    np.copyto(view, blocks.transpose(1, 2, 3, 0, 4, 5))


def _store_prefix(name: str, n_blocks: int, shm_dir: str | None):
    tokens = np.random.default_rng(0).integers(0, 50_000, n_blocks * SPEC.chunk_tokens)
    keys = chunk_keys(SPEC, tokens)
    tier = HotTier(SPEC, n_slots=2 * n_blocks, name=name)
    # Churn first, as a segment in use has: fill it, free it all, then store the prefix in one call.
    filler = chunk_keys(SPEC, np.random.default_rng(1).integers(0, 50_000, 2 * n_blocks * SPEC.chunk_tokens))
    tier.put_many(filler, np.zeros((len(filler), SPEC.block_bytes), np.uint8))
    tier.remove(filler)
    blocks = np.random.default_rng(2).integers(0, 255, (n_blocks, SPEC.block_bytes), dtype=np.uint8)
    tier.put_many(keys, blocks)
    return tier, keys, blocks


# ---- shared: N processes at once ------------------------------------------------------------------
def _shared_worker(name, shm_dir, keys, blocks, use_tier, repeats, barrier, results):
    dst = _model_layout(len(keys) * SPEC.chunk_tokens)
    tier = HotTier(SPEC, name=name, policy=None, create=False) if use_tier else None
    private = None if use_tier else blocks.view(SPEC.numpy_dtype).reshape(len(blocks), *SPEC.block_shape).copy()

    def once():
        if use_tier:
            assert _restore_from(tier, keys, dst) == len(keys)
        else:
            _private_restore(private, dst)

    once()  # first touch of the mapping or of the private copy, untimed
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    results.put(time.perf_counter() - t0)
    if tier is not None:
        tier.close()


def shared(name: str, shm_dir, keys, blocks, n_procs: int, repeats: int, rounds: int) -> dict:
    nbytes = len(keys) * SPEC.block_bytes

    def aggregate(use_tier: bool) -> float:
        q, barrier = FORK.Queue(), FORK.Barrier(n_procs)
        procs = [FORK.Process(target=_shared_worker, args=(name, shm_dir, keys, blocks, use_tier, repeats,
                                                            barrier, q)) for _ in range(n_procs)]
        for p in procs:
            p.start()
        spans = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        return n_procs * repeats * nbytes / max(spans) / 1e9  # all moved while the slowest ran

    tier_gbps, base_gbps = [], []
    for _ in range(rounds):  # interleaved: both see the same machine load
        base_gbps.append(aggregate(False))
        tier_gbps.append(aggregate(True))
    t, b = statistics.median(tier_gbps), statistics.median(base_gbps)
    return {"processes": n_procs, "tier_gbps": t, "private_gbps": b, "ratio": t / b}


# ---- fresh: the first restore of a new process ------------------------------------------------------
def _fresh_worker(name, shm_dir, keys, results):
    dst = _model_layout(len(keys) * SPEC.chunk_tokens)
    tier = HotTier(SPEC, name=name, policy=None, create=False)
    times, faults = [], []
    for _ in range(2):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        assert _restore_from(tier, keys, dst) == len(keys)
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    huge = tier.stats().extra.get("huge_mapped_bytes", 0)
    tier.close()
    results.put((times, faults, huge))


def fresh(name: str, shm_dir, keys, processes: int) -> dict:
    firsts, seconds, faults, huge = [], [], [], 0
    for _ in range(processes):
        q = FORK.Queue()
        p = FORK.Process(target=_fresh_worker, args=(name, shm_dir, keys, q))
        p.start()
        (t1, t2), (f1, _), huge = q.get(timeout=600)
        p.join()
        firsts.append(t1)
        seconds.append(t2)
        faults.append(f1)
    first, second = statistics.median(firsts), statistics.median(seconds)
    return {"shm_dir": shm_dir or "/dev/shm", "first_ms": first * 1e3, "second_ms": second * 1e3,
            "ratio": second / first, "first_over_second": first / second,
            "first_faults": int(statistics.median(faults)), "huge_mapped_mib": huge / 2**20}


def _mount_huge(size_bytes: int) -> str | None:
    """Mount a tmpfs with huge=always (root only); None (and why, on stderr) if the host refuses."""
    if os.geteuid() != 0:
        print("no huge-page tmpfs: mounting one needs root (give --shm-dir)", file=sys.stderr)
        return None
    point = tempfile.mkdtemp(prefix="tieredkv-huge-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=always,size={size_bytes},mode=0700", "none",
                           point], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"no huge-page tmpfs: {done.stderr.strip()}", file=sys.stderr)
        os.rmdir(point)
        return None
    return point


def _unmount(point: str) -> None:
    subprocess.run(["umount", point], check=False)
    shutil.rmtree(point, ignore_errors=True)


def run(n_blocks: int, n_procs: int, repeats: int, rounds: int, shm_dir: str | None, try_huge: bool) -> dict:
    report: dict = {"blocks": n_blocks, "bytes": n_blocks * SPEC.block_bytes, "fresh": [], "shared": []}
    dirs = [shm_dir]
    mounted = None
    if try_huge and shm_dir is None and _tiers_take_a_directory():
        mounted = _mount_huge(4 * n_blocks * SPEC.block_bytes + (256 << 20))
        if mounted:
            dirs.append(mounted)
    try:
        for where in dirs:
            with segment_dir(where):  # workers are forked: they inherit the directory
                name = f"/tieredkv-bench-rp-{os.getpid()}-{secrets.token_hex(3)}"
                tier, keys, blocks = _store_prefix(name, n_blocks, where)
                try:
                    report["shared"].append({"shm_dir": where or "/dev/shm",
                                             **shared(name, where, keys, blocks, n_procs, repeats, rounds)})
                    report["fresh"].append(fresh(name, where, keys, rounds))
                finally:
                    tier.unlink()
    finally:
        if mounted:
            _unmount(mounted)
    return report


def _tiers_take_a_directory() -> bool:
    """Whether this tieredkv puts segments where ``TIEREDKV_SHM_DIR`` says (older ones: /dev/shm only)."""
    from tieredkv.hot import segment

    return hasattr(segment, "SHM_DIR_ENV")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 1k-token prefix, 2 processes (< 30 s)")
    ap.add_argument("--processes", type=int, default=None, help="restoring processes (default 8)")
    ap.add_argument("--shm-dir", default=None, help="put the segment here (e.g. a huge=always tmpfs)")
    ap.add_argument("--no-huge", action="store_true", help="do not mount a huge=always tmpfs for comparison")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = ap.parse_args(argv)
    n_blocks = 16 if args.quick else 64
    n_procs = args.processes or (2 if args.quick else 8)
    report = run(n_blocks, n_procs, 3 if args.quick else 5, 3 if args.quick else 5, args.shm_dir, not args.no_huge)
    for s in report["shared"]:
        print(f"{s['processes']} processes restoring one {report['bytes'] / 2**20:.0f} MiB prefix at once, segment "
              f"in {s['shm_dir']}: tier {s['tier_gbps']:.2f} GB/s, private copies {s['private_gbps']:.2f} GB/s, "
              f"ratio {s['ratio']:.2f}")
    for f in report["fresh"]:
        print(f"fresh process, segment in {f['shm_dir']}: first restore {f['first_ms']:.1f} ms "
              f"({f['first_faults']} page faults), second {f['second_ms']:.1f} ms; first/second "
              f"{f['first_over_second']:.2f}; {f['huge_mapped_mib']:.0f} MiB mapped with huge pages")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
