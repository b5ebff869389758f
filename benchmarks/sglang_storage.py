"""What tieredkv costs SGLang's HiCache per page: ``batch_get_v1`` (hot hits) and ``batch_set_v1`` of
``TieredKVStorage`` against the copies they cannot avoid, measured in the same run.

    python benchmarks/sglang_storage.py [--quick] [--json OUT]

A page_first host pool (SGLang's default layout) of a 7B-like geometry per TP rank (28 layers, 4 KV
heads of 128, bfloat16, 32-token pages: 1.75 MiB a page), 64 pages a batch (half of SGLang's
128-page storage batch), pages chosen at random in the pool:

- ``get`` baseline: one copy of the same bytes from a buffer into the pool's pages (numpy fancy
  assignment, the copy a zero-copy read must make); ``batch_get_v1``: all pages in the hot tier;
- ``set`` baseline: one gather of the pool's pages into a buffer plus one copy into another buffer (the
  two copies a store into shared memory makes); ``batch_set_v1``: new pages into a full hot tier (3
  batches of slots, filled before the timing: each store evicts, as on a busy server).

The ratio is the median time over the baseline's median. Needs sglang (``.ci/setup`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import time

import numpy as np
import posix_ipc
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYERS, HEADS, HEAD_DIM, PAGE = 28, 4, 128, 32


class Pool:
    """A page_first host pool: SGLang's buffer shape for it ([2, tokens, layers, heads, head_dim])."""

    layout, page_size, dtype = "page_first", PAGE, torch.bfloat16

    def __init__(self, pages: int):
        self.page_num, self.size = pages, pages * PAGE
        self.kv_buffer = torch.randint(-(2 ** 15), 2 ** 15, (2, self.size, LAYERS, HEADS, HEAD_DIM),
                                       dtype=torch.int16).view(torch.bfloat16)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batch, repeats = (16, 5) if args.quick else (64, 15)
    pool_pages = batch * 4
    name = f"/tieredkv-bench-sglang-{secrets.token_hex(4)}"
    extra = {"backend_name": "tieredkv", "module_path": "tieredkv.integrations.sglang", "class_name": "TieredKVStorage",
             "interface_v1": 1, "hot_name": name, "hot_blocks": batch * 3}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench/7b", extra_config=extra)
    pool = Pool(pool_pages)
    store = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    store.register_mem_pool_host(pool)
    rng = np.random.default_rng(0)
    try:
        page_bytes = 2 * PAGE * LAYERS * HEADS * HEAD_DIM * 2
        comp = [pool.kv_buffer[i].view(torch.uint8).numpy().reshape(pool_pages, -1) for i in (0, 1)]
        half = page_bytes // 2
        src = np.ones((batch, page_bytes), dtype=np.uint8)
        dst = np.empty_like(src)

        def pages() -> np.ndarray:
            return rng.choice(pool_pages, size=batch, replace=False)

        def indices(p) -> torch.Tensor:
            return torch.from_numpy((p[:, None] * PAGE + np.arange(PAGE)).reshape(-1))

        def copy_in() -> None:
            p = pages()
            comp[0][p] = src[:, :half]
            comp[1][p] = src[:, half:]

        def copy_out_twice() -> None:
            p = pages()
            np.take(comp[0], p, axis=0, out=dst[:, :half])
            np.take(comp[1], p, axis=0, out=dst[:, half:])
            np.copyto(src, dst)

        counter = iter(range(10 ** 9))

        def fresh_keys() -> list[str]:
            return [f"{next(counter):064x}" for _ in range(batch)]

        # Fill the segment once: measured stores then reuse slots (evicting), as a server's do, instead
        # of paying the first touch of fresh shared memory.
        for _ in range(3):
            stored = fresh_keys()
            assert store.batch_set_v1(stored, indices(pages())) == [True] * batch

        def get() -> None:
            assert store.batch_get_v1(stored, indices(pages())) == [True] * batch

        def put() -> None:
            assert all(store.batch_set_v1(fresh_keys(), indices(pages())))

        rows = []
        for label, base, case in (("batch_get_v1 (hot)", copy_in, get), ("batch_set_v1 (new)", copy_out_twice, put)):
            base(), case()  # warm up
            b, c = median_s(base, repeats), median_s(case, repeats)
            mib = batch * page_bytes / (1 << 20)
            rows.append({"case": label, "baseline_ms": b * 1e3, "ms": c * 1e3, "ratio": c / b,
                         "GiB_per_s": mib / 1024 / c, "batch_MiB": mib})
        load = os.getloadavg()
        print(f"{batch} pages of {page_bytes / (1 << 20):.2f} MiB, median of {repeats}; load average "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"{'case':22} {'baseline ms':>12} {'ms':>9} {'ratio':>7} {'GiB/s':>7}")
        for r in rows:
            print(f"{r['case']:22} {r['baseline_ms']:12.2f} {r['ms']:9.2f} {r['ratio']:7.2f} {r['GiB_per_s']:7.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "loadavg": load, "batch": batch, "repeats": repeats}, f, indent=1)
    finally:
        store.close()
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass


if __name__ == "__main__":
    main()
