"""The per-batch read and write paths of the hot tier and the cache (issue 23, item 4): what they check
once per batch still keeps every invariant of the per-block version."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tieredkv import HotTier, KVSpec, TieredCache, chunk_keys
from tieredkv.hot import batch
from tieredkv.tier import PutResult
from tieredkv.warm.testing import payload_for

SPEC = KVSpec(model_id="test/small-blocks", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
B = SPEC.block_bytes


def keys_of(n: int, seed: int = 0):
    return chunk_keys(SPEC, np.random.default_rng(seed).integers(0, 30_000, n * SPEC.chunk_tokens))


def test_one_level_put_blocks_never_keeps_the_callers_rows(seg_name):
    """A hot-only cache stores the caller's rows without a copy of its own; they must never become the
    buffer a later ``store`` writes its payloads into (the caller's array would change under it)."""
    keys = keys_of(6)
    data = payload_for(keys, B).view(SPEC.numpy_dtype).reshape(6, *SPEC.block_shape).copy()  # an array of its own
    before = data.copy()
    with TieredCache(SPEC, hot_blocks=32, hot_name=seg_name) as cache:
        assert (cache.put_blocks(keys, data) == PutResult.STORED).all()
        other = np.random.default_rng(1).integers(0, 30_000, 6 * SPEC.chunk_tokens)
        kv = np.full((SPEC.num_layers, 2, SPEC.num_kv_heads, len(other), SPEC.head_dim), 7, SPEC.numpy_dtype)
        assert cache.store(other, kv) == 6
        assert data.tobytes() == before.tobytes()
        out = np.zeros((6, B), np.uint8)
        assert cache.get_blocks(keys, out).all() and np.array_equal(out, payload_for(keys, B))


def test_put_blocks_with_some_blocks_present_copies_the_rest_once(seg_name, tmp_path):
    """Blocks a level already holds are skipped; the others reach every level with their own bytes."""
    keys = keys_of(6, seed=2)
    data = payload_for(keys, B)
    with TieredCache(SPEC, hot_blocks=32, hot_name=seg_name, warm_dir=tmp_path, warm_bytes="1M") as cache:
        assert (cache.put_blocks(keys.take([1, 3]), data[[1, 3]]) == PutResult.STORED).all()
        codes = cache.put_blocks(keys, data)
        assert codes.tolist() == [PutResult.STORED, PutResult.EXISTS, PutResult.STORED, PutResult.EXISTS,
                                  PutResult.STORED, PutResult.STORED]
        data[:] = 0  # the caller reuses its rows: the queued warm writes have their own copy
        assert cache.flush(10.0)
        out = np.zeros((6, B), np.uint8)
        assert cache.warm.get_many(keys, out) == 6 and np.array_equal(out, payload_for(keys, B))
        assert cache.hot.get_many(keys, out) == 6 and np.array_equal(out, payload_for(keys, B))


def test_a_slot_recycled_between_the_check_and_the_pin_is_not_pinned(seg_name):
    """The lock-free check remembers each slot's generation and key; the pin re-checks them under the
    lock. A slot freed meanwhile, or given the same block or another one again (a new generation),
    must fail the re-check."""
    keys, others = keys_of(4, seed=3), keys_of(4, seed=4)
    with HotTier(SPEC, n_slots=4, name=seg_name) as tier:
        tier.put_many(keys, payload_for(keys, B))
        slots, seen = batch.read_run(tier._index, tier._words, tier._tokens, keys)
        assert len(slots) == 4 and batch.still_seen(tier._words, slots, seen) == 4
        tier.remove(keys[2:3])
        assert batch.still_seen(tier._words, slots, seen) == 2  # freed: the run ends there
        tier.remove(keys[2:3])
        tier.put_many(keys[2:3], payload_for(keys[2:3], B))  # the same block again, a new generation
        assert tier._find(keys.keys)[2] == slots[2] and batch.still_seen(tier._words, slots, seen) == 2
        tier.remove(keys)
        tier.put_many(others, payload_for(others, B))  # the same four slots, other blocks
        assert sorted(tier._find(others.keys).tolist()) == sorted(slots.tolist())
        assert batch.still_seen(tier._words, slots, seen) == 0
        assert batch.read_run(tier._index, tier._words, tier._tokens, keys)[0].tolist() == []


@pytest.mark.parametrize("order", ["ascending", "descending", "repeated"])
def test_pins_are_counted_per_read_and_all_released(seg_name, order):
    """A batch in one ascending run is pinned with one slice, anything else slot by slot (a key twice
    is pinned twice); either way every pin is held during the sink and released after it."""
    keys = keys_of(8, seed=5)
    with HotTier(SPEC, n_slots=16, name=seg_name) as tier:
        tier.put_many(keys, payload_for(keys, B))
        rows = {"ascending": list(range(8)), "descending": list(range(7, -1, -1)),
                "repeated": [0, 1, 1, 2, 5, 5, 5, 7]}[order]
        ask = keys.take(rows)
        seen_pins = []

        def sink(i, block):
            seen_pins.append(int(tier._slots["pins"].sum()))

        assert tier.read_into(ask, sink) == len(rows)
        assert seen_pins == [len(rows)] * len(rows)
        assert int(tier._slots["pins"].sum()) == 0 and tier.slot_census()["pinned"] == 0
        out = np.zeros((len(rows), B), np.uint8)
        assert tier.get_many(ask, out) == len(rows) and np.array_equal(out, payload_for(ask, B))
        assert tier.remove(keys) == 8  # no pin left behind keeps a block


@pytest.mark.parametrize("call", ["get_many", "read_runs"])
def test_a_batch_recycled_before_its_pin_is_a_miss(seg_name, monkeypatch, call):
    """Regression: when every slot of a batch changed between the lock-free check and the pin, the pin
    took an empty run and counted pins from its first slot (IndexError; in get_many a needless scrub)."""
    keys = keys_of(4, seed=6)
    with HotTier(SPEC, n_slots=4, name=seg_name) as tier:
        tier.put_many(keys, payload_for(keys, B))
        real = batch.read_run

        def racing(*args):
            found = real(*args)
            tier.remove(keys)
            tier.put_many(keys, payload_for(keys, B))  # same blocks, same slots, new generations
            return found

        monkeypatch.setattr(batch, "read_run", racing)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a scrub would warn
            if call == "get_many":
                assert tier.get_many(keys, np.zeros((4, B), np.uint8)) == 0
            else:
                assert tier.read_runs(keys, lambda i, rows: None) == 0
        monkeypatch.setattr(batch, "read_run", real)
        assert tier.slot_census()["pinned"] == 0
        out = np.zeros((4, B), np.uint8)
        assert tier.get_many(keys, out) == 4 and np.array_equal(out, payload_for(keys, B))


def test_the_block_overhead_benchmark_runs(tmp_path):
    """benchmarks/block_overhead.py (the figures of issue 23, items 4 and 5) runs and reports every
    figure it prints; timings are not asserted."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import block_overhead
    finally:
        sys.path.pop(0)
    out = tmp_path / "small.json"
    assert block_overhead.main(["--only", "small", "--rounds", "1", "--repeats", "1", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["small"]
    for who in ("hot", "cache"):
        for op in ("get", "put"):
            assert set(row[who][op]) == {"us_per_block", "cpu_us_per_block", "ratio", "memcpy_us_per_block"}
    assert set(row["bookkeeping"]) == {"get", "put"} and row["segment_dir"]
    assert block_overhead.main(["--only", "big", "--rounds", "1", "--repeats", "1", "--json", str(out)]) == 0
    [big] = json.loads(out.read_text())["big"]
    assert set(big["get_phases_ms"]) == {"before", "copy", "after", "warm_bookkeeping"}
    assert all(v > 0 for v in big["get_phases_ms"].values())
