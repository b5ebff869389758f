"""Restores into CUDA tensors (DMA out of the registered hot segment, re-layout on the GPU).

These need a CUDA device: on a machine without one they are skipped with that reason (CI has none; run
them on a GPU server: ``pytest -q tests/test_cuda.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tieredkv import KVSpec, TieredCache  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _spec(dtype: str) -> KVSpec:
    return KVSpec(model_id="test/cuda", num_layers=3, num_kv_heads=2, head_dim=64, dtype=dtype, chunk_tokens=32)


def _kv(spec: KVSpec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((spec.num_layers, 2, spec.num_kv_heads, n, spec.head_dim), generator=g).to(
        getattr(torch, spec.dtype))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_hot_restore_into_cuda_is_exact_and_registers_the_segment(seg_name, dtype):
    spec = _spec(dtype)
    kv = _kv(spec, 8 * 32 + 5, seed=1)
    tokens = np.arange(kv.shape[3] + 1)
    with TieredCache(spec, hot_blocks=16, hot_name=seg_name) as cache:
        cache.store(tokens, kv)
        hit = cache.lookup(tokens)
        assert hit.tokens == 8 * 32
        # A strided destination: the cache's token axis is a slice of a longer tensor.
        big = torch.zeros((*kv.shape[:3], 400, kv.shape[4]), dtype=kv.dtype, device="cuda")
        assert cache.load(hit, big) == hit.tokens
        assert torch.equal(big[:, :, :, :hit.tokens].cpu(), kv[:, :, :, :hit.tokens])
        assert not big[:, :, :, hit.tokens:].any()
        assert cache._placement.host_registry is not None and cache._placement.host_registry._ptrs  # DMA path taken
        cache.unlink_hot()
    assert not cache._placement.host_registry._ptrs  # unregistered before the segment was unmapped


def test_mixed_hot_and_warm_restore_into_cuda(seg_name, tmp_path):
    spec = _spec("float16")
    kv = _kv(spec, 12 * 32, seed=2)
    tokens = np.arange(kv.shape[3] + 1)
    with TieredCache(spec, hot_blocks=6, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=64 * spec.block_bytes,
                     promotion="never") as cache:
        cache.store(tokens, kv)
        cache.close()  # flush what is written behind to warm
    with TieredCache(spec, hot_blocks=6, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=64 * spec.block_bytes,
                     promotion="never") as cache:
        hit = cache.lookup(tokens)
        assert hit.tokens == 12 * 32 and hit.warm_blocks > 0 and hit.hot_blocks > 0, hit
        out = torch.empty_like(kv, device="cuda")
        assert cache.load(hit, out) == hit.tokens
        assert torch.equal(out[:, :, :, :hit.tokens].cpu(), kv[:, :, :, :hit.tokens])
        cache.unlink_hot()
