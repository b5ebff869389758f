"""A verified warm-only restore against a page-cache read of the same bytes, wall and CPU time, in one run.

``TieredCache.lookup`` + ``load`` of a prefix held only in the warm tier (``verify="always"``, promotion
off, page cache warm), into a model-layout array, interleaved with ``os.preadv`` of the same number of
bytes from a file in the page cache into memory already touched (what a restore can at best reach). The
ratio is page-cache time over restore time (higher is better; the goal is >= 0.8), in wall time and in
process CPU time (user + system of every thread: CPU time barely moves with the machine's load, wall
time does).

``--promotion always`` (the default configuration of ``TieredCache``) measures a load that also
promotes every block into the hot tier (the blocks are removed from the hot tier again, untimed, before
each load). Such a load must write the bytes twice (the destination and the hot slots), so it is shown
against two baselines in the same run: the page-cache read alone, and the page-cache read followed by
one flat copy of the same bytes into a second kept buffer (``page+copy``: the least any restore that
also fills a second copy can do; glibc streams a copy that large).

    python benchmarks/warm_restore.py                                 # this checkout
    python benchmarks/warm_restore.py --baseline /tmp/speed-base      # and an older checkout, alternately

With ``--baseline`` each round runs this file once per checkout (a subprocess importing that checkout's
``tieredkv``), in alternating order, and prints both ratios with the load average beside them.
``--parts`` also times, in the same process and against the same page-cache read, the pieces a
one-pass restore is made of and one alternative (CPU time; see ``PARTS``).
Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``--parts``: what each piece is (all read the same 112 MiB of the page-cache file, block by block).
PARTS = {
    "read": "preadv of each block into one kept block-sized buffer (stays in the CPU cache)",
    "read+hash": "the same, then xxh3_64 of the buffer",
    "read+hash+place": "the same, then the copy into the model layout (what a one-pass restore does)",
    "direct+hash": "preadv of each block straight into the model layout (one 16 KiB piece per layer, K/V "
                   "and head), then xxh3_64 streamed over those pieces",
}


def parts(spec, fd: int, out, n_blocks: int, repeats: int, page) -> dict:
    """CPU time of each of ``PARTS`` over ``n_blocks`` blocks of ``fd``, x the page-cache read ``page``."""
    import numpy as np
    import xxhash

    from tieredkv.layout import blocks_to_model, page_aligned_empty

    bb, C = spec.block_bytes, spec.chunk_tokens
    buf = page_aligned_empty(bb).reshape(1, bb)
    flat = memoryview(out.reshape(-1).view(np.uint8)) if out.flags.c_contiguous else None
    assert flat is not None
    L, two, H, T, D = out.shape
    piece = C * D * out.itemsize
    starts = [((la * two + k) * H + h) * T * D * out.itemsize for la in range(L) for k in range(two) for h in range(H)]

    def read():
        for i in range(n_blocks):
            os.preadv(fd, [buf[0]], i * bb)

    def read_hash():
        for i in range(n_blocks):
            os.preadv(fd, [buf[0]], i * bb)
            xxhash.xxh3_64_intdigest(buf[0])

    def read_hash_place():
        for i in range(n_blocks):
            os.preadv(fd, [buf[0]], i * bb)
            xxhash.xxh3_64_intdigest(buf[0])
            blocks_to_model(spec, buf, out, i * C)

    def direct_hash():
        for i in range(n_blocks):
            at = i * piece
            iov = [flat[s + at:s + at + piece] for s in starts]
            os.preadv(fd, iov, i * bb)
            h = xxhash.xxh3_64()
            for p in iov:
                h.update(p)
            h.intdigest()

    subjects = {"page": page, "read": read, "read+hash": read_hash, "read+hash+place": read_hash_place,
                "direct+hash": direct_hash}
    for fn in subjects.values():
        fn()
    cpu: dict[str, list[float]] = {k: [] for k in subjects}
    for _ in range(repeats):
        for name, fn in subjects.items():
            c0 = time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {k: {"cpu_ms": med[k] * 1e3, "x_page": med["page"] / med[k]} for k in PARTS}


def measure(prefix_tokens: int, repeats: int, with_parts: bool = False, promotion: str = "never") -> dict:
    import numpy as np

    from tieredkv import KVSpec, TieredCache

    spec = KVSpec(model_id=f"bench/warm-restore-{os.getpid()}", num_layers=28, num_kv_heads=2, head_dim=128,
                  dtype="float16", chunk_tokens=64)  # 1.75 MiB blocks (a 7B-class geometry)
    n_blocks = prefix_tokens // spec.chunk_tokens
    tokens = np.random.default_rng(0).integers(0, 50_000, prefix_tokens + 1)
    kv = np.random.default_rng(1).standard_normal(
        (spec.num_layers, 2, spec.num_kv_heads, prefix_tokens + 1, spec.head_dim)).astype(np.float16)
    out = np.zeros_like(kv)
    nbytes = n_blocks * spec.block_bytes
    work = tempfile.mkdtemp(prefix="tieredkv-bench-warm-restore-")
    page_file = os.path.join(work, "prefix.bin")
    with open(page_file, "wb") as f:
        f.write(np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8).tobytes())
    dst = np.ones(nbytes, np.uint8)
    second = np.ones(nbytes, np.uint8) if promotion != "never" else None
    fd = os.open(page_file, os.O_RDONLY)
    samples: dict[str, list[tuple[float, float]]] = {"restore": [], "page": [], "page+copy": []}
    try:
        with TieredCache(spec, hot_bytes=(n_blocks + 8) * (spec.block_bytes + 8192) + (4 << 20),
                         hot_name=f"/tieredkv-bench-wr-{os.getpid()}", warm_dir=os.path.join(work, "warm"),
                         warm_bytes=(n_blocks + 8) * spec.block_bytes, promotion=promotion,
                         demotion="write_through", warm_verify="always") as cache:
            try:
                assert cache.store(tokens, kv) == n_blocks
                keys = cache.lookup(tokens).keys
                cache.hot.remove(keys)

                def restore() -> None:
                    assert cache.load(cache.lookup(tokens), out) == n_blocks * spec.chunk_tokens

                def page() -> None:
                    os.preadv(fd, [dst], 0)

                def page_copy() -> None:
                    os.preadv(fd, [dst], 0)
                    np.copyto(second, dst)

                subjects = [("page", page), ("restore", restore)] + ([("page+copy", page_copy)] if promotion != "never"
                                                                     else [])
                for _, fn in subjects:
                    fn()
                    cache.hot.remove(keys)
                for _ in range(repeats):
                    for name, fn in subjects:
                        if name == "restore" and promotion != "never":
                            cache.hot.remove(keys)  # untimed: every load reads from warm and promotes
                            assert cache.lookup(tokens).hot_blocks == 0
                        w0, c0 = time.perf_counter(), time.process_time()
                        fn()
                        samples[name].append((time.perf_counter() - w0, time.process_time() - c0))
                assert out[:, :, :, :n_blocks * spec.chunk_tokens].tobytes() == \
                    kv[:, :, :, :n_blocks * spec.chunk_tokens].tobytes()
                pieces = parts(spec, fd, out, n_blocks, repeats, page) if with_parts else None
            finally:
                cache.unlink_hot()
    finally:
        os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in samples.items()
           if v}
    res = {"bytes": nbytes, "parts": pieces, "promotion": promotion,
           "restore_ms": med["restore"][0] * 1e3, "restore_cpu_ms": med["restore"][1] * 1e3,
           "page_ms": med["page"][0] * 1e3, "page_cpu_ms": med["page"][1] * 1e3,
           "wall_ratio": med["page"][0] / med["restore"][0], "cpu_ratio": med["page"][1] / med["restore"][1]}
    if "page+copy" in med:
        res.update(copy_ms=med["page+copy"][0] * 1e3, copy_cpu_ms=med["page+copy"][1] * 1e3,
                   copy_wall_ratio=med["page+copy"][0] / med["restore"][0],
                   copy_cpu_ratio=med["page+copy"][1] / med["restore"][1])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=4096, help="default 4096 (112 MiB)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--baseline", type=Path, help="an older checkout to measure alternately")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds (default 3)")
    ap.add_argument("--parts", action="store_true", help="also time the pieces of a one-pass restore (PARTS)")
    ap.add_argument("--promotion", default="never", choices=["never", "always"],
                    help="never (default): the warm read alone; always: each load also promotes into the hot tier")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a subprocess: print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.prefix_tokens, args.repeats, args.parts, args.promotion)))
        return 0
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    got: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds if args.baseline else 1):
        for name, tree in (trees if r % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", "--prefix-tokens",
                                   str(args.prefix_tokens), "--repeats", str(args.repeats),
                                   "--promotion", args.promotion]
                                  + (["--parts"] if args.parts and name == "this" else []),
                                  env=env, cwd=str(tree), capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            got[name].append(res)
            print(f"round {r + 1} {name:<8} load {load:5.1f}: restore {res['restore_ms']:.1f} ms "
                  f"({res['restore_cpu_ms']:.1f} ms CPU), page-cache read {res['page_ms']:.1f} ms "
                  f"({res['page_cpu_ms']:.1f} ms CPU); x page cache: wall {res['wall_ratio']:.2f}, "
                  f"CPU {res['cpu_ratio']:.2f}", flush=True)
            if "copy_ms" in res:
                print(f"    page-cache read + flat copy {res['copy_ms']:.1f} ms ({res['copy_cpu_ms']:.1f} ms CPU); "
                      f"x page+copy: wall {res['copy_wall_ratio']:.2f}, CPU {res['copy_cpu_ratio']:.2f}", flush=True)
            for part, got_part in (res.get("parts") or {}).items():
                print(f"    {part:<16} {got_part['cpu_ms']:6.1f} ms CPU, x page-cache read {got_part['x_page']:.2f}: "
                      f"{PARTS[part]}")
    mib = got["this"][0]["bytes"] / 2**20
    print(f"median, {mib:.0f} MiB warm-only verified restore (promotion {args.promotion}), x page-cache read "
          f"(goal >= 0.8); load average now {os.getloadavg()[0]:.1f}:")
    for name, rows in got.items():
        print(f"  {name:<8} wall {statistics.median(r['wall_ratio'] for r in rows):.2f}  "
              f"CPU {statistics.median(r['cpu_ratio'] for r in rows):.2f}"
              + (f"   x page+copy: wall {statistics.median(r['copy_wall_ratio'] for r in rows):.2f}  "
                 f"CPU {statistics.median(r['copy_cpu_ratio'] for r in rows):.2f}" if "copy_ms" in rows[0] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
