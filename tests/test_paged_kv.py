"""Copies between vLLM's paged KV cache and tieredkv blocks (tieredkv.integrations.paged), on CPU and,
where there is one, on a CUDA device. No vLLM needed: the paged caches are built here the way vLLM's
``create_kv_cache_views`` builds them (tests/test_vllm_connector.py checks that against vLLM itself).

On a GPU machine: ``pytest -q tests/test_paged_kv.py`` (torch with CUDA; vLLM not required)."""

from __future__ import annotations

import os
import secrets

import numpy as np
import posix_ipc
import pytest
import torch

from tieredkv import InvalidInput, KVSpec, TieredCache
from tieredkv.integrations.paged import KV_SPLIT, PagedKV, paged_view

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 32, 2, 64, 2, 64

#: vLLM 0.32's KVCacheLayout members: the physical order of the logical axes [L, B, H, N, C].
LAYOUT_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                 "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


class Layout:
    """What ``paged_view`` reads of a vLLM ``KVCacheLayout``: its name and the per-layer axis order."""

    def __init__(self, name: str):
        self.name, self.value = name, LAYOUT_ORDERS[name]

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        return tuple(i - 1 for i in self.value if i != 0)


def devices() -> list:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs a CUDA device")])]


def paged_caches(name: str, device: str, dtype=torch.float32) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, 2D] views over one allocation, laid out physically as ``name``."""
    order = LAYOUT_ORDERS[name]
    shape = (LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=dtype, device=device)
    return [torch.as_strided(raw, shape[1:], strides[1:], layer * strides[0]) for layer in range(LAYERS)]


def backend_kv(cache: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, H, N, D]`` as the backends' forwards read them (vLLM 0.32)."""
    B, H, N, C = cache.shape
    if split == "halves":  # cpu_attn.py: view [B, H, 2N, D], then chunk(2, dim=2)
        k, v = cache.view((B, H, N * 2, -1)).chunk(2, dim=2)
        return k, v
    k, v = cache.transpose(1, 2).split(C // 2, dim=-1)  # flash_attn.py: [B, N, H, D] each
    return k.transpose(1, 2), v.transpose(1, 2)


def view_all(caches, name, split):
    return [paged_view(c, Layout(name), split, num_kv_heads=HEADS, block_size=BLOCK, head_size=HEAD_DIM)
            for c in caches]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("split", sorted(set(KV_SPLIT.values())))
def test_restore_lands_where_the_backend_reads_k_and_v(device, name, split):
    caches = paged_caches(name, device)
    if split == "halves" and LAYOUT_ORDERS[name][-2:] != (3, 4):  # a (block, head) page is no single run
        with pytest.raises(InvalidInput, match="not contiguous"):
            view_all(caches, name, split)
        return
    paged = PagedKV(view_all(caches, name, split), BLOCK)
    blocks = [7, 3, 12]
    host = paged.host_buffer(len(blocks) * BLOCK + 10)
    assert host.is_pinned() == (device == "cuda")
    host.copy_(torch.randn(host.shape))
    paged.write(blocks, host, first_token=10)
    for layer, cache in enumerate(caches):
        k, v = (t.cpu() for t in backend_kv(cache, split))
        for i, b in enumerate(blocks):
            want = host[layer, :, :, 10 + i * BLOCK:10 + (i + 1) * BLOCK]
            assert torch.equal(k[b], want[0]) and torch.equal(v[b], want[1])
        untouched = [b for b in range(NUM_BLOCKS) if b not in blocks]
        assert not k[untouched].any() and not v[untouched].any()
    back = torch.zeros(LAYERS, 2, HEADS, len(blocks) * BLOCK, HEAD_DIM)
    paged.read(blocks, back)
    assert torch.equal(back, host[:, :, :, 10:])


def test_mismatched_tensors_are_refused():
    cache = paged_caches("LBHNC", "cpu")[0]
    with pytest.raises(InvalidInput, match="do not match layout LBNHC"):
        paged_view(cache, Layout("LBNHC"), "last_axis", num_kv_heads=HEADS, block_size=BLOCK, head_size=HEAD_DIM)
    with pytest.raises(InvalidInput, match=r"expected \[num_blocks, 4, 32, 128\]"):
        paged_view(cache, Layout("LBHNC"), "halves", num_kv_heads=4, block_size=BLOCK, head_size=HEAD_DIM)
    with pytest.raises(InvalidInput, match="legacy"):
        paged_view(torch.zeros(2, 4, BLOCK, HEADS, HEAD_DIM), Layout("BLHNC"), "last_axis", num_kv_heads=HEADS,
                   block_size=BLOCK, head_size=HEAD_DIM)
    with pytest.raises(InvalidInput, match="unknown K/V split"):
        paged_view(cache, Layout("LBHNC"), "interleaved", num_kv_heads=HEADS, block_size=BLOCK, head_size=HEAD_DIM)


@pytest.mark.parametrize("name,order", [("LBNHC", "BNHD"), ("LBHNC", "BHND")])
def test_legacy_split_caches(name, order):
    dims = {"B": NUM_BLOCKS, "N": BLOCK, "H": HEADS, "D": HEAD_DIM}
    cache = torch.zeros(2, *[dims[a] for a in order])
    view = paged_view(cache, Layout(name), "last_axis", num_kv_heads=HEADS, block_size=BLOCK, head_size=HEAD_DIM)
    host = torch.randn(1, 2, HEADS, BLOCK, HEAD_DIM)
    PagedKV([view], BLOCK).write([5], host)
    k = cache[0, 5] if order == "BHND" else cache[0, 5].transpose(0, 1)
    assert torch.equal(k, host[0, 0])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tier_to_pages_and_back(device, dtype):
    """The connector's path: tiers -> (pinned) host buffer -> device pages -> host buffer -> tiers."""
    spec = KVSpec(model_id="test/paged", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                  dtype=str(dtype).removeprefix("torch."), chunk_tokens=2 * BLOCK)
    name = f"/tieredkv-test-{os.getpid()}-{secrets.token_hex(4)}"
    tokens = np.arange(1, 4 * BLOCK + 2)
    kv = torch.randn(LAYERS, 2, HEADS, 4 * BLOCK, HEAD_DIM).to(dtype)
    try:
        with TieredCache(spec, hot_bytes=8 << 20, hot_name=name) as cache:
            cache.store(tokens, kv[:, :, :, :2 * BLOCK])  # chunk 0 only
            paged = PagedKV(view_all(paged_caches("LBHNC", device, dtype), "LBHNC", "halves"), BLOCK)
            hit = cache.lookup(tokens)
            host = paged.host_buffer(hit.tokens)
            assert cache.load(hit, host) == 2 * BLOCK
            paged.write([9, 4], host)
            check = torch.zeros(LAYERS, 2, HEADS, 2 * BLOCK, HEAD_DIM, dtype=dtype)
            paged.read([9, 4], check)
            assert torch.equal(check.view(torch.int16), kv[:, :, :, :2 * BLOCK].contiguous().view(torch.int16))
            # The model computes chunk 1 into blocks 6 and 2; the save reads them back and stores
            # them after the loaded chunk (from_token), never reading chunk 0 from the pages again.
            paged.write([6, 2], kv[:, :, :, 2 * BLOCK:].contiguous())
            back = paged.host_buffer(4 * BLOCK)
            back[:, :, :, :2 * BLOCK] = 0  # stale positions store must not read
            paged.read([6, 2], back[:, :, :, 2 * BLOCK:])
            assert cache.store(tokens[:4 * BLOCK], back, from_token=2 * BLOCK) == 1
            again = torch.zeros(LAYERS, 2, HEADS, 4 * BLOCK, HEAD_DIM, dtype=dtype)
            full = cache.lookup(tokens)
            assert full.tokens == 4 * BLOCK and cache.load(full, again) == 4 * BLOCK
            assert torch.equal(again.view(torch.int16), kv.view(torch.int16))  # bitwise
            cache.unlink_hot()
    finally:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass


def test_a_write_from_chunks_outside_them_is_refused():
    """``Chunks`` rows must hold every token written, at a block boundary, in blocks of this cache's shape."""
    from tieredkv.integrations.paged import Chunks

    caches = paged_caches("LBHNC", "cpu")
    paged = PagedKV(view_all(caches, "LBHNC", "halves"), BLOCK)
    chunk = 2 * BLOCK
    rows = np.zeros((2, paged.chunk_bytes(chunk)), np.uint8)
    paged.write([1, 2, 3, 4], Chunks(rows, 0, chunk), 0)  # all four blocks of the two chunks: fine
    for ids, first in (([1, 2], 3 * BLOCK), ([1], BLOCK // 2), ([1], -BLOCK)):  # past the end, mid-block, before
        with pytest.raises(InvalidInput, match="do not lie in"):
            paged.write(ids, Chunks(rows, 0, chunk), first)
    with pytest.raises(InvalidInput, match="do not lie in"):  # rows of another shape of block
        paged.write([1], Chunks(rows[:, :-4], 0, chunk), 0)
