"""The connector's copies into and out of a CUDA paged cache, against a pinned host-to-device memcpy.

``PagedKV.write`` is what ``TieredKVConnector.start_load_kv`` does after the tiers filled the pinned
host buffer: one host-to-device copy per layer, then one index copy on the device into the request's
blocks. ``PagedKV.read`` is the save side (gather on the device, one device-to-host copy per layer).
The baseline is one pinned host-to-device copy of the same bytes, measured in the same run.

The whole restore from the hot tier, two ways: ``staged`` is the connector before layer-wise loads
(``TieredCache.load`` into the pinned host buffer, a CPU copy, then ``PagedKV.write``); ``dma`` is
``LayerLoader`` (``tieredkv.integrations.vllm_loads``, in its ``sync`` mode so the time is the load's
alone): the hot segment's rows DMA'd into device staging by ``tieredkv.cuda.DeviceRestore``, then
device-to-device paged copies.

The KV is Llama-3.1-8B's (32 layers, 8 KV heads, head_dim 128, bfloat16) in FlashAttention's paged
layout (block 16, ``LBNHC``, K and V split in the last axis). Needs torch with CUDA; vLLM is not
needed (``tieredkv.integrations.paged`` does not import it).

    python benchmarks/vllm_gpu_restore.py [--tokens 1024,4096,16384] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import posix_ipc
import torch

from tieredkv import KVSpec, TieredCache
from tieredkv.integrations.paged import PagedKV, paged_view
from tieredkv.integrations.vllm_loads import LayerLoader

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK = 32, 8, 128, 16, 64


class _Plan:
    """What the connector's ``LoadPlan`` carries to the loader."""

    def __init__(self, hit, block_ids):
        self.req_id, self.hit, self.skip_tokens, self.block_ids = "bench", hit, 0, (tuple(block_ids),)


class _LBNHC:
    """vLLM's ``KVCacheLayout.LBNHC`` as ``paged_view`` reads it (name, per-layer axis order)."""

    name = "LBNHC"
    layer_view_order = (0, 2, 1, 3)


def _median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def measure(tokens: int, reps: int) -> dict:
    k = tokens // BLOCK
    n_blocks = k + 64
    page = BLOCK * HEADS * 2 * HEAD_DIM
    raw = torch.zeros(LAYERS * n_blocks * page, dtype=torch.bfloat16, device="cuda")
    # LBNHC: each layer is [B, N, H, C] in memory; vLLM's logical per-layer view is [B, H, N, C].
    views = [raw[layer * n_blocks * page:(layer + 1) * n_blocks * page].view(n_blocks, BLOCK, HEADS, 2 * HEAD_DIM)
             .transpose(1, 2) for layer in range(LAYERS)]
    paged = PagedKV([paged_view(v, _LBNHC(), "last_axis", num_kv_heads=HEADS, block_size=BLOCK, head_size=HEAD_DIM)
                     for v in views], BLOCK)
    host = paged.host_buffer(tokens)
    host.copy_(torch.randn(host.shape).to(torch.bfloat16))
    block_ids = torch.randperm(n_blocks)[:k].tolist()
    flat = host.reshape(-1)
    dev = torch.empty_like(flat, device="cuda")
    h2d = _median_ms(lambda: dev.copy_(flat, non_blocking=True), reps)
    write = _median_ms(lambda: paged.write(block_ids, host), reps)
    read = _median_ms(lambda: paged.read(block_ids, host), reps)
    spec = KVSpec(model_id="bench/vllm-gpu-restore", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                  dtype="bfloat16", chunk_tokens=CHUNK)
    hot_name = f"/tieredkv-bench-gpur-{tokens}"
    ids = np.arange(tokens + 1) % 30000
    try:
        with TieredCache(spec, hot_bytes=tokens * spec.bytes_per_token + (64 << 20), hot_name=hot_name) as cache:
            cache.store(ids[:tokens], host)
            hit = cache.lookup(ids)
            assert hit.tokens == tokens, hit
            staged = _median_ms(lambda: (cache.load(hit, host), paged.write(block_ids, host)), reps)
            loader = LayerLoader(cache, paged, [0] * LAYERS, {}, "sync")

            def dma() -> None:
                loader.start([_Plan(hit, block_ids)])
                assert not loader.finish()

            dma_ms = _median_ms(dma, reps)
            cache.unlink_hot()
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:
            pass
    return {"tokens": tokens, "bytes": host.numel() * 2, "pinned_h2d_ms": h2d, "paged_write_ms": write,
            "paged_read_ms": read, "write_vs_h2d": write / h2d, "read_vs_h2d": read / h2d,
            "restore_staged_ms": staged, "restore_dma_ms": dma_ms, "dma_vs_staged": dma_ms / staged}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows = [measure(int(t), args.reps) for t in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name()}: {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM} bf16, block {BLOCK}")
    print(f"{'tokens':>7}{'MB':>7}{'pinned H2D ms':>15}{'write ms':>10}{'x H2D':>7}{'read ms':>9}{'x H2D':>7}")
    for r in rows:
        print(f"{r['tokens']:>7}{r['bytes'] / 1e6:>7.0f}{r['pinned_h2d_ms']:>15.2f}{r['paged_write_ms']:>10.2f}"
              f"{r['write_vs_h2d']:>7.2f}{r['paged_read_ms']:>9.2f}{r['read_vs_h2d']:>7.2f}")
    print("whole restore from the hot tier (ms): staged through pinned host memory vs DMA into device staging")
    for r in rows:
        print(f"{r['tokens']:>7}  staged {r['restore_staged_ms']:.2f}  dma {r['restore_dma_ms']:.2f}  "
              f"dma/staged {r['dma_vs_staged']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
