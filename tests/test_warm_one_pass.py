"""One-pass warm restores into the caller's memory (``layout.BlockParts``, ``WarmTier.read_through(...,
parts)``, ``Loader.promote_placed``).

A warm block is read straight into the destination array and hashed part by part as it is read; a
block to promote into the hot tier is copied from the destination, after the load. Under test: the
bytes land where ``blocks_to_model`` would put them, the checksum is the one on disk (the same xxh3 of
the whole block), a damaged, truncated or unreadable block is never returned nor promoted, and
destinations whose pieces are not contiguous fall back to the sink.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_warm_read_through import flip_bytes_on_disk

from helpers import kv_for, payload_for, same_bytes
from tieredkv import KVSpec, TieredCache, WarmTierUnavailable, chunk_keys
from tieredkv import layout as kv_layout
from tieredkv.layout import block_parts, blocks_to_model, model_to_blocks
from tieredkv.warm import WarmTier

SPEC = KVSpec(model_id="test/one-pass", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
              chunk_tokens=8)  # 4 KiB blocks: 16 pieces of 256 bytes
N = 12


def prompt(n_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n_tokens)


def model_array(n_tokens: int, seed: int = 1) -> np.ndarray:
    s = SPEC
    return np.random.default_rng(seed).standard_normal(
        (s.num_layers, 2, s.num_kv_heads, n_tokens, s.head_dim)).astype(np.float16)


@pytest.mark.parametrize("part_bytes", [1, 1024, 4096, 1 << 20])
@pytest.mark.parametrize("at_token", [0, 8, 5])
def test_block_parts_are_the_blocks_bytes_in_block_order(part_bytes, at_token):
    C, k = SPEC.chunk_tokens, 3
    target = model_array(at_token + k * C + 2)
    parts = block_parts(SPEC, target, at_token, k, part_bytes)
    assert parts is not None and sum(parts.sizes) == SPEC.block_bytes
    want = np.empty((k, SPEC.block_bytes), np.uint8)
    model_to_blocks(SPEC, target, at_token, want)
    for i in range(k):
        got = parts(i)
        assert [sum(len(p) for p in part) for part in got] == parts.sizes
        assert b"".join(bytes(p) for part in got for p in part) == want[i].tobytes()
    # Writable views of the array itself: writing a block through them is blocks_to_model.
    fresh = np.random.default_rng(9).integers(0, 255, SPEC.block_bytes, dtype=np.uint8)
    at = 0
    for part in parts(1):
        for p in part:
            p[:] = fresh[at:at + len(p)].tobytes()
            at += len(p)
    expect = target.copy()
    blocks_to_model(SPEC, fresh.reshape(1, -1), expect, at_token + C)
    assert same_bytes(target, expect)


def test_block_parts_refuses_what_it_cannot_fill_in_place():
    C = SPEC.chunk_tokens
    s = SPEC
    swapped = np.swapaxes(np.zeros((s.num_layers, 2, s.num_kv_heads, s.head_dim, 4 * C), np.float16), 3, 4)
    assert swapped.shape[3] == 4 * C and block_parts(SPEC, swapped, 0, 4) is None  # pieces not contiguous
    ro = model_array(4 * C)
    ro.flags.writeable = False
    assert block_parts(SPEC, ro, 0, 4) is None
    assert block_parts(SPEC, model_array(4 * C), C, 4) is None  # too short for 4 blocks from C on
    assert block_parts(SPEC, model_array(4 * C), 0, 0) is None


@pytest.fixture
def warm(tmp_path):
    keys = chunk_keys(SPEC, prompt(N * SPEC.chunk_tokens))
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * 4096, verify="always") as t:
        assert (t.put_many(keys, payload_for(SPEC, keys)) == 0).all()
        yield t, keys


def restored(keys, target) -> np.ndarray:
    rows = np.empty((len(keys), SPEC.block_bytes), np.uint8)
    model_to_blocks(SPEC, target, 0, rows)
    return rows


@pytest.mark.parametrize("part_bytes", [256, 1024, 1 << 20])
def test_read_through_into_parts_places_every_block_and_calls_no_sink(warm, monkeypatch, part_bytes):
    t, keys = warm
    monkeypatch.setattr(kv_layout, "PART_BYTES", part_bytes)
    target = np.zeros((SPEC.num_layers, 2, SPEC.num_kv_heads, N * SPEC.chunk_tokens, SPEC.head_dim), np.float16)
    called = []
    before = t.stats()
    assert t.read_through(keys, lambda i, rows: called.append(i), None, block_parts(SPEC, target, 0, N)) == N
    assert not called
    np.testing.assert_array_equal(restored(keys, target), payload_for(SPEC, keys))
    after = t.stats()
    assert (after.hits - before.hits, after.bytes_out - before.bytes_out) == (N, N * SPEC.block_bytes)


@pytest.mark.parametrize("offset", [0, 300, SPEC.block_bytes - 1])  # first part, a middle one, the last byte
def test_a_flipped_byte_on_disk_ends_a_read_into_parts_and_is_dropped(warm, offset):
    t, keys = warm
    bad = 7
    flip_bytes_on_disk(t, payload_for(SPEC, keys)[bad], offset)
    target = np.zeros((SPEC.num_layers, 2, SPEC.num_kv_heads, N * SPEC.chunk_tokens, SPEC.head_dim), np.float16)
    assert t.read_through(keys, lambda i, rows: None, None, block_parts(SPEC, target, 0, N)) == bad
    np.testing.assert_array_equal(restored(keys, target)[:bad], payload_for(SPEC, keys)[:bad])
    assert t.stats().corrupt == 1
    assert t.contains_many(keys).tolist() == [i != bad for i in range(N)]  # removed: never served again
    assert t.read_through(keys, lambda i, rows: None, None, block_parts(SPEC, target, 0, N)) == bad


def test_verify_never_reads_into_parts_unchecked(tmp_path):
    keys = chunk_keys(SPEC, prompt(N * SPEC.chunk_tokens, seed=4))
    target = np.zeros((SPEC.num_layers, 2, SPEC.num_kv_heads, N * SPEC.chunk_tokens, SPEC.head_dim), np.float16)
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * 4096, verify="never") as t:
        assert (t.put_many(keys, payload_for(SPEC, keys)) == 0).all()
        assert t.read_through(keys, lambda i, rows: None, None, block_parts(SPEC, target, 0, N)) == N
    np.testing.assert_array_equal(restored(keys, target), payload_for(SPEC, keys))


@pytest.mark.parametrize("verify", ["always", "never"])  # never: found short by the read itself, not a checksum
def test_a_truncated_slab_ends_a_read_into_parts_before_the_missing_bytes(tmp_path, verify):
    keys = chunk_keys(SPEC, prompt(N * SPEC.chunk_tokens, seed=5))
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * 4096, verify=verify) as t:
        assert (t.put_many(keys, payload_for(SPEC, keys)) == 0).all()
        truncate_and_read(t, keys)


def truncate_and_read(t: WarmTier, keys) -> None:
    slab = sorted(t.path.glob("slab-*"))[0]
    recs = t._index.read(lambda txn: t._lookup(txn, t._raw(keys), keys, N, True))[0]
    slots = recs["slot"].astype(int).tolist()
    cut = sorted(slots)[5]  # cut inside the 6th slot (in slot order): that block and all after it are short
    os.truncate(slab, cut * t._slabs.slot_bytes + 1000)
    short = {i for i, s in enumerate(slots) if s >= cut}
    first_short = min(short)
    target = np.zeros((SPEC.num_layers, 2, SPEC.num_kv_heads, N * SPEC.chunk_tokens, SPEC.head_dim), np.float16)
    assert t.read_through(keys, lambda i, rows: None, None, block_parts(SPEC, target, 0, N)) == first_short
    np.testing.assert_array_equal(restored(keys, target)[:first_short], payload_for(SPEC, keys)[:first_short])


def test_a_failed_read_into_parts_is_the_tiers_error_and_drops_nothing(warm, monkeypatch):
    from tieredkv.warm import reads as warm_reads

    t, keys = warm
    real = os.preadv
    calls = []

    def eio(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    target = np.zeros((SPEC.num_layers, 2, SPEC.num_kv_heads, N * SPEC.chunk_tokens, SPEC.head_dim), np.float16)
    monkeypatch.setattr(warm_reads.os, "preadv", eio)
    with pytest.raises(WarmTierUnavailable, match="Input/output error"):
        t.read_through(keys, lambda i, rows: None, None, block_parts(SPEC, target, 0, N))
    monkeypatch.undo()
    assert t.read_through(keys, lambda i, rows: None, None, block_parts(SPEC, target, 0, N)) == N
    np.testing.assert_array_equal(restored(keys, target), payload_for(SPEC, keys))


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
    """Count ``WarmTier.read_through`` calls that were given parts, and ``get_many`` calls (staging)."""
    seen = {"parts": 0, "get_many": 0}
    through, get_many = WarmTier.read_through, WarmTier.get_many

    def read_through(self, keys, sink, staging=None, parts=None):
        seen["parts"] += parts is not None
        return through(self, keys, sink, staging, parts)

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
        assert seen == {"parts": 1, "get_many": 0}  # straight into ``out``; no staging read
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
        assert seen == {"parts": 2, "get_many": 0}
        assert same_bytes(out[:, :, :, :N * C], kv[:, :, :, :N * C])


def test_a_destination_with_scattered_pieces_goes_through_the_sink(tmp_path, seg_name, monkeypatch):
    C, s = SPEC.chunk_tokens, SPEC
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "always")
    with cache:
        seen = count_reads(monkeypatch)
        out = np.swapaxes(np.zeros((s.num_layers, 2, s.num_kv_heads, s.head_dim, kv.shape[3]), np.float16), 3, 4)
        assert cache.load(cache.lookup(tokens), out) == N * C
        assert seen["parts"] == 0 and seen["get_many"] == 1  # staged, then promoted from the staging rows
        assert same_bytes(np.ascontiguousarray(out[:, :, :, :N * C]), kv[:, :, :, :N * C])
        assert cache.lookup(tokens).hot_blocks == N


def test_a_cpu_tensor_destination_is_filled_in_place(tmp_path, seg_name, monkeypatch):
    torch = pytest.importorskip("torch")
    C = SPEC.chunk_tokens
    cache, tokens, kv = warm_only_cache(tmp_path, seg_name, "always")
    with cache:
        seen = count_reads(monkeypatch)
        out = torch.zeros(kv.shape, dtype=torch.float16)
        assert cache.load(cache.lookup(tokens), out) == N * C
        assert seen["parts"] == 1
        assert same_bytes(out.numpy()[:, :, :, :N * C], kv[:, :, :, :N * C])
