"""One-pass warm restores: ``WarmTier.read_through`` reads every group into one small buffer of the
reading thread, hashes it and hands it to the sink; a restore that promotes nothing takes that path.

The guarantee under test: a block that fails its checksum is never returned as data, although its
bytes already went through the sink (into the caller's destination) before it was verified.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from helpers import kv_for, payload_for, same_bytes
from tieredkv import KVSpec, TieredCache, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm import reads as warm_reads

SPEC = KVSpec(model_id="test/read-through", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
              chunk_tokens=8)  # 4 KiB blocks: 4 layers x (K, V) x 2 heads = 16 pieces of 256 bytes
N_BLOCKS = 24


def prompt(n_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n_tokens)


@pytest.fixture
def warm(tmp_path):
    keys = chunk_keys(SPEC, prompt(N_BLOCKS * SPEC.chunk_tokens))
    with WarmTier(SPEC, tmp_path, capacity_bytes=32 * 4096) as t:
        assert (t.put_many(keys, payload_for(SPEC, keys)) == 0).all()
        yield t, keys


@pytest.mark.parametrize("group_blocks", [1, 5, 1000])
def test_read_through_hands_over_what_get_many_returns_through_one_buffer(warm, monkeypatch, group_blocks):
    t, keys = warm
    monkeypatch.setattr(warm_reads, "READ_GROUP_BYTES", group_blocks * SPEC.block_bytes)
    seen, buffers = [], set()

    def sink(i, rows):
        seen.append((i, rows.copy()))
        buffers.add(rows.__array_interface__["data"][0])

    before = t.stats()
    assert t.read_through(keys, sink) == N_BLOCKS
    per = min(group_blocks, N_BLOCKS)
    assert [i for i, _ in seen] == list(range(0, N_BLOCKS, per))
    np.testing.assert_array_equal(np.concatenate([r for _, r in seen]), payload_for(SPEC, keys))
    assert len(buffers) == 1  # every group went through the same buffer: nothing kept per block
    after = t.stats()
    assert (after.hits - before.hits, after.bytes_out - before.bytes_out) == (N_BLOCKS, N_BLOCKS * SPEC.block_bytes)
    staging = np.zeros((N_BLOCKS, SPEC.block_bytes), np.uint8)
    assert t.read_through(keys, lambda i, rows: None, staging) == N_BLOCKS
    assert not staging.any()  # the warm tier never writes the caller's staging


def test_read_through_in_two_threads_at_once_gets_each_its_own_bytes(warm):
    t, keys = warm
    want = payload_for(SPEC, keys)
    bad = []

    def reader(lo: int, hi: int) -> None:
        for _ in range(30):
            got = np.zeros((hi - lo, SPEC.block_bytes), np.uint8)

            def sink(i, rows, got=got):
                got[i:i + len(rows)] = rows

            if t.read_through(keys[lo:hi], sink) != hi - lo or not np.array_equal(got, want[lo:hi]):
                bad.append((lo, hi))

    threads = [threading.Thread(target=reader, args=span) for span in ((0, 12), (12, 24))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not bad


def flip_block_on_disk(cache: TieredCache, keys, i: int, offset: int) -> None:
    """Invert one byte of block ``i``'s payload in its slab file (found by its bytes: unique here)."""
    block = np.zeros((1, cache.spec.block_bytes), np.uint8)
    assert cache.warm.get_many(keys[i:i + 1], block) == 1
    flip_bytes_on_disk(cache.warm, block[0], offset)


def flip_bytes_on_disk(t: WarmTier, block: np.ndarray, offset: int) -> None:
    """Invert byte ``offset`` of the slot holding ``block`` (found by its bytes) in its real slab file."""
    for slab in sorted(t.path.glob("slab-*")):
        with open(slab, "r+b") as f:
            data = f.read()
            at = data.find(block.tobytes())
            if at >= 0:
                f.seek(at + offset)
                f.write(bytes([data[at + offset] ^ 0xFF]))
                return
    raise AssertionError("block is in no slab")


@pytest.mark.parametrize("group_blocks", [1, 4, 1000])
def test_a_flipped_byte_in_the_middle_of_a_run_ends_a_one_pass_restore_there(tmp_path, seg_name, monkeypatch,
                                                                              group_blocks):
    monkeypatch.setattr(warm_reads, "READ_GROUP_BYTES", group_blocks * SPEC.block_bytes)
    through = []
    real = WarmTier.read_through
    monkeypatch.setattr(WarmTier, "read_through", lambda self, *a, **k: through.append(1) or real(self, *a, **k))
    C, bad = SPEC.chunk_tokens, 13
    tokens = prompt(N_BLOCKS * C + 3)
    kv = kv_for(SPEC, tokens)
    with TieredCache(SPEC, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=64 * 4096,
                     promotion="never", demotion="write_through", warm_verify="always") as cache:
        assert cache.store(tokens, kv) == N_BLOCKS
        hit = cache.lookup(tokens)
        cache.hot.remove(hit.keys)
        hit = cache.lookup(tokens)
        assert hit.warm_blocks == N_BLOCKS
        flip_block_on_disk(cache, hit.keys, bad, SPEC.block_bytes // 2 + 5)  # mid-block, mid-run
        out = np.zeros_like(kv)
        assert cache.load(hit, out) == bad * C  # the damaged block and all after it are not returned
        assert through  # the one-pass path ran
        assert same_bytes(out[:, :, :, :bad * C], kv[:, :, :, :bad * C])
        stats = cache.stats()
        assert stats["corrupt_blocks"] == 1 and stats["loaded_tokens"] == bad * C
        assert stats["warm_bytes_read"] == bad * SPEC.block_bytes and stats["lost_blocks"] == N_BLOCKS - bad
        assert cache.warm.contains_many(hit.keys).tolist() == [i != bad for i in range(N_BLOCKS)]
        # Gone from the index: the next restore stops there again without finding new damage.
        assert cache.lookup(tokens).tokens == bad * C
        assert cache.load(hit, np.zeros_like(kv)) == bad * C
        assert cache.stats()["corrupt_blocks"] == 1


def test_counts_warm_hits_on_the_one_pass_path_so_on_nth_hit_promotes(tmp_path, seg_name):
    C = SPEC.chunk_tokens
    tokens = prompt(8 * C + 1)
    kv = kv_for(SPEC, tokens)
    with TieredCache(SPEC, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=64 * 4096,
                     promotion="on_nth_hit:2", demotion="write_through") as cache:
        assert cache.store(tokens, kv) == 8
        cache.hot.remove(cache.lookup(tokens).keys)
        out = np.zeros_like(kv)
        assert cache.load(cache.lookup(tokens), out) == 8 * C  # first hit: nothing to promote
        assert cache.lookup(tokens).hot_blocks == 0
        assert cache.load(cache.lookup(tokens), out) == 8 * C  # second: promoted from the kept rows
        assert cache.lookup(tokens).hot_blocks == 8
        assert same_bytes(out[:, :, :, :8 * C], kv[:, :, :, :8 * C])


def test_read_through_raises_the_sinks_error_and_a_failed_read(warm, monkeypatch):
    from tieredkv import WarmTierUnavailable
    from tieredkv.warm import slabs as warm_slabs

    t, keys = warm
    monkeypatch.setattr(warm_reads, "READ_GROUP_BYTES", SPEC.block_bytes)
    calls = []

    def boom(i, rows):
        calls.append(i)
        if i == 7:
            raise RuntimeError("sink failed")

    with pytest.raises(RuntimeError, match="sink failed"):
        t.read_through(keys, boom)
    assert calls == list(range(8))  # nothing read past the failing group
    real = warm_slabs.os.preadv
    reads = []

    def eio(fd, bufs, offset):
        reads.append(offset)
        if len(reads) == 5:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(warm_slabs.os, "preadv", eio)
    with pytest.raises(WarmTierUnavailable, match="Input/output error"):
        t.read_through(keys, lambda i, rows: None)
    monkeypatch.undo()
    got = []
    assert t.read_through(keys, lambda i, rows: got.append(rows.copy())) == N_BLOCKS  # nothing was dropped
    np.testing.assert_array_equal(np.concatenate(got), payload_for(SPEC, keys))


@pytest.mark.parametrize("promotion", ["never", "on_nth_hit:2"])
def test_block_reads_below_the_top_go_through_unless_promoted(tmp_path, seg_name, monkeypatch, promotion):
    # tieredkv.blocks.read (SGLang's path) takes the same choice as a load: blocks the rule will not
    # promote come through the warm tier's own buffer; a block due for promotion is kept and promoted.
    from tieredkv import blocks
    from tieredkv.cache import HOT, WARM

    through = []
    real = WarmTier.read_through
    monkeypatch.setattr(WarmTier, "read_through", lambda self, *a, **k: through.append(1) or real(self, *a, **k))
    keys = chunk_keys(SPEC, prompt(6 * SPEC.chunk_tokens, seed=3))
    data = payload_for(SPEC, keys)
    with TieredCache(SPEC, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=64 * 4096,
                     promotion=promotion, demotion="write_through") as cache:
        cache.put_blocks(keys, data)
        assert cache.flush(10.0)
        cache.hot.remove(keys)
        for n_read in (1, 2):
            got = np.zeros_like(data)

            def sink(i, rows, got=got):
                got[i:i + len(rows)] = rows

            assert blocks.read(cache, keys, sink) == {"hot": 0, "warm": 6}
            assert np.array_equal(got, data)
            promoted = promotion != "never" and n_read == 2
            assert len(through) == (n_read if promotion == "never" else 1)  # the 2nd on_nth_hit read keeps its rows
            assert cache.locate(keys).tolist() == [HOT if promoted else WARM] * 6
