"""Per-block overhead of small blocks, and big blocks against one flat memcpy (issue 23, items 4 and 5).

    python benchmarks/block_overhead.py [--rounds 3] [--repeats 15] [--only small|big] [--huge] [--json OUT]

**small**: 64 KiB blocks in batches of 64 through ``HotTier.get_many`` / ``put_many`` and through a
hot-only ``TieredCache.get_blocks`` / ``put_blocks``. The baseline is ``np.copyto`` of the same 4 MiB
between private buffers over a working set as large as the segment's, timed back to back with each
call (so both see the same load). The figure is the overhead per block, ``(t_call - t_copy) / 64``,
in wall time and in CPU time of the calling thread (CPU time moves much less than wall time on a
loaded machine).

**big**: 64 blocks of 1.75 MiB (112 MiB) in one ``get_many`` / ``put_many`` against ONE flat
``np.copyto`` of 112 MiB between private buffers (glibc streams stores above its non-temporal
threshold, so this is the fastest copy of those bytes on the machine), and against the same bytes
copied block by block (what a copy per run of ordinary stores gets). Ratios > 1 are faster than the
baseline.

Both parts also time the baseline copy into or out of private memory mapped with 4 KiB pages (numpy's
large buffers get 2 MiB pages; a segment in /dev/shm has 4 KiB pages unless its tmpfs is mounted
``huge=always``, docs/tuning.md): the "4 KiB pages" columns say how much of a gap is the page size, not
tieredkv. The big part also times the same flat copy out of and into a plain file mapping in the
segment's directory (the pages a segment there gets: 4 KiB in /dev/shm), and divides get and put by
those ("x same pages": what tieredkv adds over a memcpy between the same kinds of pages); it prints
how much of the baseline's buffers the kernel mapped with 2 MiB pages, and what a get spends around
its copy (``get_phases``: its bookkeeping before and after the copy, with the caches as the flat copy
left them, against the same bookkeeping back to back). ``--huge`` (root) also runs every round with
the segments on a ``huge=always`` tmpfs.

Each round prints the load average beside its figures; medians over ``--repeats`` per round. Not a
test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tieredkv of this checkout

from tieredkv import HotTier, KVSpec, TieredCache, chunk_keys  # noqa: E402
from tieredkv.layout import copy_rows, misaligned  # noqa: E402

SMALL = KVSpec(model_id="bench/64k", num_layers=8, num_kv_heads=1, head_dim=32, dtype="float16")
#: 1 KiB blocks: the copy is a few nanoseconds per block, so a call's time is its bookkeeping.
TINY = KVSpec(model_id="bench/1k", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
BIG = KVSpec(model_id="bench/seed-7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16")


def small_pages(shape: tuple[int, int]) -> np.ndarray:
    """A private, touched uint8 buffer that the kernel maps with 4 KiB pages (``MADV_NOHUGEPAGE``)."""
    mm = mmap.mmap(-1, shape[0] * shape[1])
    with contextlib.suppress(AttributeError, OSError):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    buf = np.frombuffer(mm, np.uint8).reshape(shape)
    buf[:] = 1
    return buf


@contextlib.contextmanager
def segments_in(path: str | None):
    """Make segments in ``path`` meanwhile (``TIEREDKV_SHM_DIR``)."""
    old = os.environ.get("TIEREDKV_SHM_DIR")
    if path is not None:
        os.environ["TIEREDKV_SHM_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TIEREDKV_SHM_DIR", None)
        else:
            os.environ["TIEREDKV_SHM_DIR"] = old


def _name() -> str:
    return f"/tieredkv-bench-{os.getpid()}-{secrets.token_hex(3)}"


def _load() -> float:
    return os.getloadavg()[0]


def _keys(spec: KVSpec, n_prompts: int, blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    return [chunk_keys(spec, rng.integers(0, 50_000, blocks * spec.chunk_tokens)) for _ in range(n_prompts)]


def _timed(fn) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one call of ``fn``."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def _pairs(subjects: dict, repeats: int, before=None) -> dict:
    """Time every ``name: fn`` of ``subjects`` ``repeats`` times, interleaved; medians of wall and CPU."""
    samples: dict = {k: ([], []) for k in subjects}
    for fn in subjects.values():
        if before is not None:
            before()
        fn()  # warm: page faults, caches
    for _ in range(repeats):
        for key, fn in subjects.items():
            if before is not None:
                before()
            w, c = _timed(fn)
            samples[key][0].append(w)
            samples[key][1].append(c)
    return {k: (statistics.median(w), statistics.median(c)) for k, (w, c) in samples.items()}


def small_round(repeats: int, n_prompts: int = 16, batch: int = 64) -> dict:
    """One round of the small-block figures (see the module docstring)."""
    spec = SMALL
    prompts = _keys(spec, n_prompts, batch, seed=0)
    fresh = _keys(spec, 1, batch, seed=1)[0]
    payload = np.ones((batch, spec.block_bytes), np.uint8)
    out = np.empty_like(payload)
    src = np.ones((n_prompts * batch, spec.block_bytes), np.uint8)  # private, as large as the segment's data
    src4k = small_pages(src.shape)
    turn = iter(range(1 << 62))

    def copy_get():
        k = next(turn) % n_prompts
        np.copyto(out, src[k * batch:(k + 1) * batch])

    def copy_get_4k():
        k = next(turn) % n_prompts
        np.copyto(out, src4k[k * batch:(k + 1) * batch])

    def copy_put():
        k = next(turn) % n_prompts
        np.copyto(src[k * batch:(k + 1) * batch], payload)

    load0 = _load()
    result: dict = {"load_before": load0}
    tier = HotTier(spec, n_slots=(n_prompts + 1) * batch, name=_name())
    try:
        for ck in prompts:
            tier.put_many(ck, payload)

        def hot_get():
            assert tier.get_many(prompts[next(turn) % n_prompts], out) == batch

        t = _pairs({"copy_get": copy_get, "get": hot_get, "copy_put": copy_put, "copy_get_4k": copy_get_4k,
                    "put": lambda: tier.put_many(fresh, payload)}, repeats, before=lambda: tier.remove(fresh))
        result["hot"] = _overheads(t, batch)
        result["pages_4k_us_per_block"] = (t["copy_get_4k"][0] - t["copy_get"][0]) / batch * 1e6
    finally:
        tier.unlink()
    cache = TieredCache(spec, hot_blocks=(n_prompts + 1) * batch, hot_name=_name())
    try:
        for ck in prompts:
            cache.put_blocks(ck, payload)
        hot = cache.level("hot").tier

        def cache_get():
            assert cache.get_blocks(prompts[next(turn) % n_prompts], out).all()

        t = _pairs({"copy_get": copy_get, "get": cache_get, "copy_put": copy_put,
                    "put": lambda: cache.put_blocks(fresh, payload)}, repeats, before=lambda: hot.remove(fresh))
        result["cache"] = _overheads(t, batch)
    finally:
        cache.unlink_hot()
        cache.close()
    result["bookkeeping"] = bookkeeping(repeats, batch)
    result["load_after"] = _load()
    return result


def bookkeeping(repeats: int, batch: int = 64) -> dict:
    """CPU time per block of HotTier get_many / put_many of 1 KiB blocks: the work besides the copy."""
    spec = TINY
    keys = _keys(spec, 1, batch, seed=0)[0]
    fresh = _keys(spec, 1, batch, seed=1)[0]
    payload = np.ones((batch, spec.block_bytes), np.uint8)
    out = np.empty_like(payload)
    tier = HotTier(spec, n_slots=1024, name=_name())
    try:
        tier.put_many(keys, payload)
        t = _pairs({"get": lambda: tier.get_many(keys, out), "put": lambda: tier.put_many(fresh, payload)},
                   repeats, before=lambda: tier.remove(fresh))
    finally:
        tier.unlink()
    return {op: cpu / batch * 1e6 for op, (_, cpu) in t.items()}


def _overheads(t: dict, batch: int) -> dict:
    per = {}
    for op in ("get", "put"):
        (w, c), (bw, bc) = t[op], t["copy_" + op]
        per[op] = {"us_per_block": (w - bw) / batch * 1e6, "cpu_us_per_block": (c - bc) / batch * 1e6,
                   "ratio": bw / w, "memcpy_us_per_block": bw / batch * 1e6}
    return per


def segment_dir_pages(shape: tuple[int, int]) -> np.ndarray:
    """A touched uint8 buffer mapped from a file in the segments' directory (``TIEREDKV_SHM_DIR``,
    else /dev/shm), shared like a segment: the page size a segment there gets. The file is unlinked at
    once; the mapping goes with the array."""
    directory = os.environ.get("TIEREDKV_SHM_DIR") or "/dev/shm"
    path = os.path.join(directory, f"tieredkv-bench-pages-{os.getpid()}-{secrets.token_hex(3)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, shape[0] * shape[1])
        mm = mmap.mmap(fd, shape[0] * shape[1])
    finally:
        os.close(fd)
    buf = np.frombuffer(mm, np.uint8).reshape(shape)
    buf[:] = 1
    return buf


def huge_pages(shape: tuple[int, int]) -> np.ndarray:
    """A private, touched uint8 buffer, 2 MiB-aligned and advised ``MADV_HUGEPAGE`` before it is
    touched, so the kernel backs it with 2 MiB pages when it has them (``huge_kib`` says)."""
    nbytes = shape[0] * shape[1]
    mm = mmap.mmap(-1, nbytes + (2 << 20))
    raw = np.frombuffer(mm, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % (2 << 20)
    with contextlib.suppress(AttributeError, OSError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    buf = raw[start:start + nbytes].reshape(shape)
    buf[:] = 1
    return buf


def huge_kib(arr: np.ndarray) -> int:
    """KiB of ``arr``'s mapping that the kernel backs with 2 MiB pages (/proc/self/smaps)."""
    addr, inside, total = arr.__array_interface__["data"][0], False, 0
    with contextlib.suppress(OSError), open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                lo, _, hi = head[0].partition("-")
                inside = int(lo, 16) <= addr < int(hi, 16)
            elif inside and head[0] in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(head[1])
    return total


def get_phases(tier: HotTier, keys, out: np.ndarray, evict, repeats: int) -> dict:
    """Where a big get's time goes besides the copy: ``HotTier.read_runs`` with a sink that makes the
    same copy as ``get_many``, right after ``evict`` (the flat copy, which leaves the caches as a real
    get finds them), timed before, during and after the sink's copy; and the same call with a sink
    that copies nothing, back to back (the bookkeeping with warm caches). Medians in ms."""
    cold: dict[str, list[float]] = {"before": [], "copy": [], "after": []}
    at: dict[str, float] = {}

    def sink(i: int, rows: np.ndarray) -> None:
        at["a"] = time.perf_counter()
        copy_rows(out[i:i + len(rows)], rows, misaligned(out[i:i + len(rows)], rows))
        at["b"] = time.perf_counter()

    for _ in range(repeats):
        evict()
        t0 = time.perf_counter()
        tier.read_runs(keys, sink)
        t1 = time.perf_counter()
        cold["before"].append(at["a"] - t0)
        cold["copy"].append(at["b"] - at["a"])
        cold["after"].append(t1 - at["b"])
    warm = []
    tier.read_runs(keys, lambda i, rows: None)
    for _ in range(repeats):
        t0 = time.perf_counter()
        tier.read_runs(keys, lambda i, rows: None)
        warm.append(time.perf_counter() - t0)
    out_ms = {k: statistics.median(v) * 1e3 for k, v in cold.items()}
    out_ms["warm_bookkeeping"] = statistics.median(warm) * 1e3
    return out_ms


def big_round(repeats: int, blocks: int = 64) -> dict:
    """One round of the big-block figures (see the module docstring)."""
    spec = BIG
    nbytes = blocks * spec.block_bytes
    keys = _keys(spec, 1, blocks, seed=0)[0]
    fresh = _keys(spec, 1, blocks, seed=1)[0]
    payload = np.ones((blocks, spec.block_bytes), np.uint8)
    out = np.empty_like(payload)
    src = np.ones_like(payload)
    src4k = small_pages(src.shape)
    seg_pages = segment_dir_pages(src.shape)
    huge_src, huge_out = huge_pages(src.shape), huge_pages(src.shape)

    def flat_get():
        np.copyto(out, src)

    def flat_put():
        np.copyto(src, payload)

    def flat_put_4k():
        np.copyto(src4k, payload)

    def pieces():
        for i in range(blocks):
            np.copyto(out[i], src[i])

    def flat_from_seg():
        np.copyto(out, seg_pages)

    def flat_into_seg():
        np.copyto(seg_pages, payload)

    def flat_huge():
        np.copyto(huge_out, huge_src)

    load0 = _load()
    tier = HotTier(spec, n_slots=2 * blocks, name=_name())
    try:
        tier.put_many(keys, payload)

        def get():
            assert tier.get_many(keys, out) == blocks

        t = _pairs({"flat_get": flat_get, "get": get, "pieces": pieces, "flat_put": flat_put,
                    "flat_put_4k": flat_put_4k, "put": lambda: tier.put_many(fresh, payload),
                    "flat_from_seg": flat_from_seg, "flat_into_seg": flat_into_seg, "flat_huge": flat_huge},
                   repeats, before=lambda: tier.remove(fresh))
        huge = {"out": huge_kib(out), "src": huge_kib(src), "segment_dir_file": huge_kib(seg_pages),
                "huge_src": huge_kib(huge_src), "huge_out": huge_kib(huge_out)}
        phases = get_phases(tier, keys, out, flat_get, repeats)
    finally:
        tier.unlink()
    gbps = {k: nbytes / w / 1e9 for k, (w, _) in t.items()}
    return {"load_before": load0, "load_after": _load(), "gbps": gbps, "huge_kib": huge, "bytes": nbytes,
            "get_phases_ms": phases,
            "huge_vs_flat": t["flat_get"][0] / t["flat_huge"][0],
            "seg_from_vs_flat": t["flat_get"][0] / t["flat_from_seg"][0],
            "seg_into_vs_flat": t["flat_put"][0] / t["flat_into_seg"][0],
            "get_vs_seg": t["flat_from_seg"][0] / t["get"][0], "put_vs_seg": t["flat_into_seg"][0] / t["put"][0],
            "get_vs_seg_cpu": t["flat_from_seg"][1] / t["get"][1],
            "put_vs_seg_cpu": t["flat_into_seg"][1] / t["put"][1],
            "get_vs_flat": t["flat_get"][0] / t["get"][0], "put_vs_flat": t["flat_put"][0] / t["put"][0],
            "pieces_vs_flat": t["flat_get"][0] / t["pieces"][0],
            "put_4k_vs_flat": t["flat_put"][0] / t["flat_put_4k"][0],
            "get_vs_flat_cpu": t["flat_get"][1] / t["get"][1], "put_vs_flat_cpu": t["flat_put"][1] / t["put"][1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="independent rounds (each prints its load average)")
    ap.add_argument("--repeats", type=int, default=15, help="timed repeats per figure in a round (median)")
    ap.add_argument("--only", choices=("small", "big"), help="run one part only")
    ap.add_argument("--huge", action="store_true", help="also run with the segments on a huge=always tmpfs (root)")
    ap.add_argument("--json", metavar="OUT", help="write every round as JSON")
    args = ap.parse_args(argv)
    import tieredkv

    print(f"tieredkv from {Path(tieredkv.__file__).parent}; {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    places: list[str | None] = [None]
    huge = None
    if args.huge:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import restore_processes

        huge = restore_processes._mount_huge(1 << 30)
        if huge:
            places.append(huge)
    report: dict = {"small": [], "big": []}
    try:
        for place in places:
            with segments_in(place):
                _run(args, place or os.environ.get("TIEREDKV_SHM_DIR") or "/dev/shm", report)
    finally:
        if huge:
            restore_processes._unmount(huge)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _run(args, place: str, report: dict) -> None:
    if args.only != "big":
        print(f"\nsmall: 64 KiB blocks, batches of 64, segment in {place}; overhead per block over np.copyto of the "
              "same bytes between private buffers (us, wall / CPU); goal get <= 5, put <= 10. Then: what the "
              "same memcpy costs more from 4 KiB pages, and the CPU time per block of HotTier calls on 1 KiB blocks "
              "(bookkeeping: the copy is negligible)")
        print("| round | load | hot get | hot put | cache get | cache put | memcpy us/block | 4 KiB pages +us/block "
              "| 1 KiB get / put CPU us/block |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in range(args.rounds):
            s = small_round(args.repeats)
            s["segment_dir"] = place
            report["small"].append(s)
            h, c = s["hot"], s["cache"]
            cell = lambda d: f"{d['us_per_block']:.2f} / {d['cpu_us_per_block']:.2f}"  # noqa: E731
            print(f"| {r + 1} | {s['load_before']:.1f}-{s['load_after']:.1f} | {cell(h['get'])} | {cell(h['put'])} "
                  f"| {cell(c['get'])} | {cell(c['put'])} | {h['get']['memcpy_us_per_block']:.2f} "
                  f"| {s['pages_4k_us_per_block']:.2f} "
                  f"| {s['bookkeeping']['get']:.2f} / {s['bookkeeping']['put']:.2f} |", flush=True)
    if args.only != "small":
        print(f"\nbig: 64 x 1.75 MiB (112 MiB) in one call, segment in {place}, vs ONE flat 112 MiB np.copyto "
              "between private buffers (x; > 1 is faster); goal get >= 0.95, put >= 0.90")
        print("| round | load | get / put (x flat) | get / put CPU (x flat) | get / put (x the flat copy out of / "
              "into the segment dir's pages) | that copy out of / into (x flat) | flat between 2 MiB pages (x flat) "
              "| block-by-block (x flat) | flat into private 4 KiB pages (x flat) | flat GB/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        for r in range(args.rounds):
            b = big_round(args.repeats)
            b["segment_dir"] = place
            report["big"].append(b)
            rows.append(b)
            print(f"| {r + 1} | {b['load_before']:.1f}-{b['load_after']:.1f} "
                  f"| {b['get_vs_flat']:.2f} / {b['put_vs_flat']:.2f} "
                  f"| {b['get_vs_flat_cpu']:.2f} / {b['put_vs_flat_cpu']:.2f} "
                  f"| {b['get_vs_seg']:.2f} / {b['put_vs_seg']:.2f} "
                  f"| {b['seg_from_vs_flat']:.2f} / {b['seg_into_vs_flat']:.2f} | {b['huge_vs_flat']:.2f} "
                  f"| {b['pieces_vs_flat']:.2f} | {b['put_4k_vs_flat']:.2f} | {b['gbps']['flat_get']:.2f} |",
                  flush=True)
        med = {k: statistics.median(b[k] for b in rows) for k in
               ("get_vs_flat", "put_vs_flat", "seg_from_vs_flat", "seg_into_vs_flat", "get_vs_seg", "put_vs_seg",
                "huge_vs_flat")}
        huge = rows[-1]["huge_kib"]
        print(f"median of {len(rows)} rounds: get / put {med['get_vs_flat']:.2f} / {med['put_vs_flat']:.2f} x flat "
              f"(goal 0.95 / 0.90); {med['get_vs_seg']:.2f} / {med['put_vs_seg']:.2f} x the flat copy out of / "
              f"into the segment dir's pages, which is itself {med['seg_from_vs_flat']:.2f} / "
              f"{med['seg_into_vs_flat']:.2f} x flat; flat between 2 MiB pages {med['huge_vs_flat']:.2f} x flat. "
              f"KiB on 2 MiB pages of {rows[-1]['bytes'] >> 10}: flat's src {huge['src']} / out {huge['out']}, "
              f"segment dir file {huge['segment_dir_file']}, 2 MiB buffers {huge['huge_src']} / {huge['huge_out']}; "
              f"load average now {_load():.1f}")
        ph = {k: statistics.median(b["get_phases_ms"][k] for b in rows) for k in rows[0]["get_phases_ms"]}
        print(f"a get's bookkeeping around its copy (read_runs after the flat copy, medians): {ph['before']:.3f} ms "
              f"before the copy, {ph['after']:.3f} ms after, the copy {ph['copy']:.2f} ms; the same bookkeeping "
              f"back to back, caches warm: {ph['warm_bookkeeping']:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
