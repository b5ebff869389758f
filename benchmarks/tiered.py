"""TieredCache benchmark: lookup + load of a 4k-token prefix (seed 7B geometry) from hot, warm, mixed.

    python benchmarks/tiered.py [--quick] [--json OUT]

Each case is a ratio to baselines measured in the same run on the same bytes:
``memcpy``: one ``np.copyto`` of the prefix's KV bytes between two private contiguous buffers;
``scatter``: copying the same blocks from a private block array into the model-layout tensor
``(layers, 2, kv_heads, tokens, head_dim)``, the copy a restore cannot avoid. Medians over repeats;
the warm case is measured with the page cache warm (the file was just written).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from tieredkv import KVSpec, TieredCache, chunk_keys

SPEC = KVSpec(model_id="bench/seed-7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16")


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _aligned_zeros(shape, dtype, align: int = 64) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def run(prefix_tokens: int, repeats: int) -> dict:
    spec = SPEC
    C = spec.chunk_tokens
    n_blocks = prefix_tokens // C
    tokens = np.random.default_rng(0).integers(0, 50_000, prefix_tokens + 1)  # +1: a token to compute
    kv = np.random.default_rng(1).standard_normal((spec.num_layers, 2, spec.num_kv_heads, prefix_tokens + 1,
                                                   spec.head_dim)).astype(np.float16)
    out = _aligned_zeros(kv.shape, kv.dtype)  # 64-byte aligned, like the tensors torch allocates
    nbytes = n_blocks * spec.block_bytes
    # Baselines.
    src = _aligned_zeros((nbytes,), np.uint8) + 1
    dst = _aligned_zeros((nbytes,), np.uint8)
    t_memcpy = _median(lambda: np.copyto(dst, src), repeats)
    blocks = _aligned_zeros((n_blocks, *spec.block_shape), np.float16)
    for i in range(n_blocks):
        blocks[i] = kv[:, :, :, i * C:(i + 1) * C]

    def scatter():
        for i in range(n_blocks):
            np.copyto(out[:, :, :, i * C:(i + 1) * C], blocks[i])

    t_scatter = _median(scatter, repeats)
    # The warm tier's baseline: reading the same bytes from a file in the page cache into touched memory.
    page_dir = tempfile.mkdtemp(prefix="tieredkv-bench-page-")
    page_file = os.path.join(page_dir, "prefix.bin")
    with open(page_file, "wb") as f:
        f.write(src.tobytes())
    fd = os.open(page_file, os.O_RDONLY)
    page_read = lambda: os.preadv(fd, [dst], 0)  # noqa: E731
    t_pagecache = _median(page_read, repeats)
    name = f"/tieredkv-bench-tiered-{os.getpid()}-{secrets.token_hex(3)}"
    warm_dir = tempfile.mkdtemp(prefix="tieredkv-bench-")
    hot_bytes = (n_blocks + 8) * (spec.block_bytes + 8192) + (4 << 20)
    rows = []
    try:
        with TieredCache(spec, hot_bytes=hot_bytes, hot_name=name, warm_dir=warm_dir,
                         warm_bytes=(n_blocks + 8) * spec.block_bytes, promotion="never",
                         demotion="write_through") as cache:
            assert cache.store(tokens, kv) == n_blocks
            keys = chunk_keys(spec, tokens)

            def case(label: str):
                def once():
                    hit = cache.lookup(tokens)
                    assert cache.load(hit, out) == prefix_tokens, label
                    return hit
                hit = once()
                # Interleaved with its baselines, so all three see the same machine load.
                samples: dict = {"case": [], "memcpy": [], "page": []}
                for _ in range(repeats):
                    for key, fn in (("memcpy", lambda: np.copyto(dst, src)), ("page", page_read), ("case", once)):
                        t0 = time.perf_counter()
                        fn()
                        samples[key].append(time.perf_counter() - t0)
                t, t_mem, t_page = (statistics.median(samples[k]) for k in ("case", "memcpy", "page"))
                t_lookup = _median(lambda: cache.lookup(tokens), repeats)
                assert out[:, :, :, :prefix_tokens].tobytes() == kv[:, :, :, :prefix_tokens].tobytes()
                rows.append({"case": label, "hot_blocks": hit.hot_blocks, "warm_blocks": hit.warm_blocks,
                             "lookup_ms": t_lookup * 1e3, "lookup_load_ms": t * 1e3,
                             "gbps": nbytes / t / 1e9, "vs_memcpy": t / t_memcpy, "vs_scatter": t / t_scatter,
                             "memcpy_ms": t_mem * 1e3, "pagecache_ms": t_page * 1e3,
                             "speed_vs_memcpy": t_mem / t, "speed_vs_pagecache": t_page / t})

            case("hot only")
            cache.hot.remove(keys[: n_blocks // 2])
            case("mixed (half warm)")
            cache.hot.remove(keys)
            case("warm only")
    finally:
        os.close(fd)
        shutil.rmtree(page_dir, ignore_errors=True)
        shutil.rmtree(warm_dir, ignore_errors=True)
        try:
            import posix_ipc
            posix_ipc.unlink_shared_memory(name)
        except Exception:
            pass
    return {"prefix_tokens": prefix_tokens, "bytes": nbytes, "memcpy_ms": t_memcpy * 1e3,
            "scatter_ms": t_scatter * 1e3, "pagecache_ms": t_pagecache * 1e3,
            "memcpy_gbps": nbytes / t_memcpy / 1e9, "cases": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k-token prefix, few repeats (< 20 s)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = ap.parse_args(argv)
    report = run(1024 if args.quick else 4096, 3 if args.quick else 11)
    print(f"lookup + load of a {report['prefix_tokens']}-token prefix ({report['bytes'] / 2**20:.0f} MiB, "
          f"seed 7B geometry); memcpy {report['memcpy_ms']:.1f} ms ({report['memcpy_gbps']:.1f} GB/s), "
          f"scatter into model layout {report['scatter_ms']:.1f} ms, page-cache read {report['pagecache_ms']:.1f} ms")
    print("x memcpy, x scatter: time over the baseline's (lower is better); "
          "speed x memcpy, speed x page cache: baseline time over ours (higher is better)")
    print("| case | hot | warm | lookup ms | lookup+load ms | GB/s | x memcpy | x scatter | speed x memcpy "
          "| speed x page cache |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["cases"]:
        print(f"| {r['case']} | {r['hot_blocks']} | {r['warm_blocks']} | {r['lookup_ms']:.2f} | "
              f"{r['lookup_load_ms']:.1f} | {r['gbps']:.2f} | {r['vs_memcpy']:.2f} | {r['vs_scatter']:.2f} | "
              f"{r['speed_vs_memcpy']:.2f} | {r['speed_vs_pagecache']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
