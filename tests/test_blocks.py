"""The block-level API (``put_blocks`` / ``locate`` / ``get_blocks``): the path of callers that hold block
rows (vLLM's offloading tier) goes through the same levels, writers and counters as ``store``/``load``."""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv import InvalidPayload, KVSpec, TieredCache, chunk_keys
from tieredkv.cache import HOT, REMOTE, WARM
from tieredkv.remote import RemoteTier
from tieredkv.remote import testing as servers
from tieredkv.tier import PutResult
from tieredkv.warm.testing import payload_for

SPEC = KVSpec(model_id="test/blocks", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
B = SPEC.block_bytes


def keys_of(n: int, seed: int = 0):
    return chunk_keys(SPEC, np.random.default_rng(seed).integers(0, 30_000, n * SPEC.chunk_tokens))


@pytest.fixture(scope="module")
def valkey_url():
    with servers.ValkeyServer() as server:
        yield server.url


def test_put_blocks_writes_behind_to_warm_and_counts_like_store(seg_name, tmp_path):
    keys = keys_of(6)
    data = payload_for(keys, B)
    with TieredCache(SPEC, hot_blocks=16, hot_name=seg_name, warm_dir=tmp_path, warm_bytes="1M") as cache:
        codes = cache.put_blocks(keys, data)
        assert codes.tolist() == [PutResult.STORED] * 6
        data[:] = 0  # the caller reuses its rows at once: the queued warm write has its own copy
        assert cache.flush(10.0)
        assert cache.put_blocks(keys, payload_for(keys, B)).tolist() == [PutResult.EXISTS] * 6
        stats = cache.stats()
        assert (stats["stored_blocks"], stats["hot_bytes_written"]) == (6, 6 * B)
        assert (stats["warm_queued_blocks"], stats["warm_bytes_written"]) == (6, 6 * B)
        out = np.zeros((6, B), np.uint8)
        assert cache.warm.get_many(keys, out) == 6 and np.array_equal(out, payload_for(keys, B))


def test_get_blocks_reads_each_block_wherever_it_is_and_promotes(seg_name, tmp_path):
    keys = keys_of(6, seed=1)
    data = payload_for(keys, B)
    with TieredCache(SPEC, hot_blocks=16, hot_name=seg_name, warm_dir=tmp_path, warm_bytes="1M",
                     demotion="write_through") as cache:
        cache.put_blocks(keys.take([0, 1, 2, 4]), data[[0, 1, 2, 4]])
        cache.hot.remove(keys.take([1, 2]))       # 1, 2: warm only; 3, 5: nowhere
        assert cache.locate(keys).tolist() == [HOT, WARM, WARM, -1, HOT, -1]
        out = np.zeros((6, B), np.uint8)
        got = cache.get_blocks(keys, out)
        assert got.tolist() == [True, True, True, False, True, False]
        assert np.array_equal(out[got], data[got]) and not out[~got].any()
        assert cache.locate(keys).tolist() == [HOT, HOT, HOT, -1, HOT, -1]  # promoted
        stats = cache.stats()
        assert stats["promotions"] == 2 and stats["warm_bytes_read"] == 2 * B and stats["lost_blocks"] == 2
        assert stats["loaded_tokens"] == 4 * SPEC.chunk_tokens
        assert stats["hit_tokens"] == (4 + 4) * SPEC.chunk_tokens  # two locates of 4 found blocks each
        with pytest.raises(InvalidPayload):
            cache.get_blocks(keys, np.zeros((5, B), np.uint8))


def test_put_and_get_blocks_reach_the_remote_tier(seg_name, valkey_url):
    """Blocks stored by rows reach the fleet's store (queued), and a host that never saw them reads
    them from there."""
    keys = keys_of(5, seed=2)
    data = payload_for(keys, B)
    with TieredCache(SPEC, hot_blocks=16, hot_name=seg_name, remote=valkey_url) as cache:
        assert (cache.put_blocks(keys, data) == PutResult.STORED).all()
        assert cache.flush_remote(10.0)
        assert cache.stats()["remote_bytes_written"] == 5 * B
        cache.hot.remove(keys)
        assert cache.locate(keys).tolist() == [REMOTE] * 5
        out = np.zeros((5, B), np.uint8)
        assert cache.get_blocks(keys, out).all() and np.array_equal(out, data)
        assert cache.stats()["remote_bytes_read"] == 5 * B
    with RemoteTier(SPEC, valkey_url) as remote:
        assert remote.contains_many(keys).all()


def test_a_read_promotes_after_the_whole_run_not_in_its_middle(seg_name, tmp_path):
    """A full hot tier, block 0 in warm and blocks 1-8 in hot: the read takes 1 block from warm and 8
    from hot. Promoting block 0 in the middle of the read evicted block 1 to warm, which was then read
    from warm and promoted, evicting block 2, and so on: all 9 from warm, on every read."""
    from tieredkv import blocks
    from tieredkv.keys import opaque_keys

    with TieredCache(SPEC, hot_blocks=8, hot_name=seg_name, warm_dir=str(tmp_path), warm_bytes="4M",
                     demotion="on_evict", promotion="always", eviction="lru") as cache:
        keys = opaque_keys(SPEC, [b"page%d" % i for i in range(9)])
        rows = np.arange(9, dtype=np.uint8)[:, None].repeat(B, 1)
        cache.put_blocks(keys[0:1], rows[0:1])
        cache.put_blocks(keys[1:9], rows[1:9])  # the hot tier's 8 slots: block 0 goes down to warm
        assert cache.resident_run(keys).tolist() == [WARM] + [HOT] * 8
        got = {}

        def sink(i, part):
            for j in range(len(part)):
                got[i + j] = bytes(part[j])

        for _ in range(2):
            by_level = blocks.read(cache, keys, sink)
            assert by_level == {"hot": 8, "warm": 1}
            assert [got[i] for i in range(9)] == [bytes(r) for r in rows]
        cache.unlink_hot()
