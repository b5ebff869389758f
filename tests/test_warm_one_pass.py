"""Warm restores into host memory whatever the promotion rule: the warm tier reads each group into one
small buffer of its thread, hashes it and places it (``WarmTier.read_through``), and the blocks the
rule promotes are copied from the destination into the hot tier's slots after the load
(``Loader.promote_placed``), not read into a staging buffer first.

Under test: the destination and the hot tier get the stored bytes (a contiguous, a strided and a CPU
tensor destination); a block damaged on disk (a real slab file) is neither returned nor promoted;
``on_nth_hit`` still counts the hits and promotes on the N-th.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_warm_read_through import flip_bytes_on_disk

from helpers import kv_for, same_bytes
from tieredkv import KVSpec, TieredCache
from tieredkv.layout import model_to_blocks
from tieredkv.warm import WarmTier

SPEC = KVSpec(model_id="test/one-pass", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
              chunk_tokens=8)  # 4 KiB blocks: 16 pieces of 256 bytes
N = 12


def prompt(n_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n_tokens)


def warm_only_cache(tmp_path, seg_name, promotion: str) -> tuple[TieredCache, np.ndarray, np.ndarray]:
    C = SPEC.chunk_tokens
    tokens = prompt(N * C + 3, seed=2)
    kv = kv_for(SPEC, tokens)
    cache = TieredCache(SPEC, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=32 * 4096,
                        promotion=promotion, demotion="write_through", warm_verify="always")
    assert cache.store(tokens, kv) == N
    cache.hot.remove(cache.lookup(tokens).keys)
    assert cache.lookup(tokens).warm_blocks == N
    return cache, tokens, kv


def count_reads(monkeypatch) -> dict:
    """Count ``WarmTier.read_through`` calls (one buffer) and ``get_many`` calls (into staging rows)."""
    seen = {"through": 0, "get_many": 0}
    through, get_many = WarmTier.read_through, WarmTier.get_many

    def read_through(self, *a, **k):
        seen["through"] += 1
        return through(self, *a, **k)

    def counted_get_many(self, *a, **k):
        seen["get_many"] += 1
        return get_many(self, *a, **k)

    monkeypatch.setattr(WarmTier, "read_through", read_through)
    monkeypatch.setattr(WarmTier, "get_many", counted_get_many)
    return seen


def test_default_promotion_restores_in_one_pass_and_promotes_from_the_destination(tmp_path, seg_name, monkeypatch):
    C = SPEC.chunk_tokens
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "always")
    with cache:
        seen = count_reads(monkeypatch)
        out = np.zeros_like(kv)
        hit = cache.lookup(tokens)
        assert cache.load(hit, out) == N * C
        assert seen == {"through": 1, "get_many": 0}  # no staging read
        assert same_bytes(out[:, :, :, :N * C], kv[:, :, :, :N * C])
        assert cache.lookup(tokens).hot_blocks == N  # promoted
        rows = np.zeros((N, SPEC.block_bytes), np.uint8)
        assert cache.hot.get_many(hit.keys, rows) == N
        want = np.empty_like(rows)
        model_to_blocks(SPEC, kv, 0, want)
        np.testing.assert_array_equal(rows, want)  # the hot tier got the same bytes as the store wrote
        assert cache.stats()["promotions"] == N


def test_a_damaged_block_is_neither_returned_nor_promoted(tmp_path, seg_name):
    C, bad = SPEC.chunk_tokens, 5
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "always")
    with cache:
        hit = cache.lookup(tokens)
        block = np.zeros((1, SPEC.block_bytes), np.uint8)
        assert cache.warm.get_many(hit.keys[bad:bad + 1], block) == 1
        flip_bytes_on_disk(cache.warm, block[0], 777)
        out = np.zeros_like(kv)
        assert cache.load(hit, out) == bad * C
        assert same_bytes(out[:, :, :, :bad * C], kv[:, :, :, :bad * C])
        assert cache.hot.contains_many(hit.keys).tolist() == [i < bad for i in range(N)]
        assert cache.stats()["corrupt_blocks"] == 1


def test_on_nth_hit_promotes_on_the_nth_one_pass_restore(tmp_path, seg_name, monkeypatch):
    C = SPEC.chunk_tokens
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "on_nth_hit:2")
    with cache:
        seen = count_reads(monkeypatch)
        out = np.zeros_like(kv)
        assert cache.load(cache.lookup(tokens), out) == N * C
        assert cache.lookup(tokens).hot_blocks == 0
        assert cache.load(cache.lookup(tokens), out) == N * C
        assert cache.lookup(tokens).hot_blocks == N
        assert seen == {"through": 2, "get_many": 0}
        assert same_bytes(out[:, :, :, :N * C], kv[:, :, :, :N * C])


def test_a_strided_destination_is_placed_and_promoted_from_just_the_same(tmp_path, seg_name, monkeypatch):
    C, s = SPEC.chunk_tokens, SPEC
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "always")
    with cache:
        seen = count_reads(monkeypatch)
        # (tokens, head_dim) planes not contiguous: the promotion gathers from a strided source.
        out = np.swapaxes(np.zeros((s.num_layers, 2, s.num_kv_heads, s.head_dim, kv.shape[3]), np.float16), 3, 4)
        hit = cache.lookup(tokens)
        assert cache.load(hit, out) == N * C
        assert seen == {"through": 1, "get_many": 0}
        assert same_bytes(np.ascontiguousarray(out[:, :, :, :N * C]), kv[:, :, :, :N * C])
        rows = np.zeros((N, SPEC.block_bytes), np.uint8)
        assert cache.hot.get_many(hit.keys, rows) == N
        want = np.empty_like(rows)
        model_to_blocks(SPEC, kv, 0, want)
        np.testing.assert_array_equal(rows, want)


def test_a_cpu_tensor_destination_is_filled_in_place(tmp_path, seg_name, monkeypatch):
    torch = pytest.importorskip("torch")
    C = SPEC.chunk_tokens
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "always")
    with cache:
        seen = count_reads(monkeypatch)
        out = torch.zeros(kv.shape, dtype=torch.float16)
        assert cache.load(cache.lookup(tokens), out) == N * C
        assert seen == {"through": 1, "get_many": 0}
        assert same_bytes(out.numpy()[:, :, :, :N * C], kv[:, :, :, :N * C])
