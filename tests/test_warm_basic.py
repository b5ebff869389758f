"""WarmTier: the block interface, LRU eviction, on-disk layout and open errors (one process)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from tieredkv import ChunkKeys, FormatError, InvalidInput, KVSpec, PutResult, SpecMismatch, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import check_index, payload_for

SPEC = KVSpec(model_id="test/warm-tiny", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
SLOT = 4096  # SPEC.block_bytes = 256 -> one 4 KiB slot per block


def keys_of(start: int, n_chunks: int, salt: bytes = b"") -> ChunkKeys:
    return chunk_keys(SPEC, np.arange(start, start + n_chunks * SPEC.chunk_tokens), salt)


@pytest.fixture
def tier(tmp_path):
    t = WarmTier(SPEC, tmp_path, capacity_bytes=16 * SLOT)
    yield t
    t.close()


def test_duplicates_in_batch_and_no_space(tier):
    k = keys_of(0, 3)
    dup = ChunkKeys(np.concatenate([k.keys, k.keys[:1]]), np.concatenate([k.parents, k.parents[:1]]),
                    np.concatenate([k.tokens, k.tokens[:1]]))
    codes = tier.put_many(dup, payload_for(dup, SPEC.block_bytes))
    assert codes.tolist() == [PutResult.STORED] * 3 + [PutResult.EXISTS]
    # A batch bigger than the whole tier: once its own blocks... only committed blocks are evictable,
    # so the keys past the free slots and the evictable blocks get NO_SPACE.
    big = keys_of(1000, 20)
    codes = tier.put_many(big, payload_for(big, SPEC.block_bytes))
    assert (codes == PutResult.STORED).sum() == 16
    assert (codes == PutResult.NO_SPACE).sum() == 4
    assert tier.stats().evictions == 3
    check_index(str(tier.path))


def test_eviction_keeps_the_index_invariants_and_can_skip_payloads(tmp_path):
    """The exact LRU victims and what they carry are in test_tier_contract.py; here: the warm-only
    ``with_payloads=False`` and the index invariants after eviction to make room and explicit eviction."""
    with WarmTier(SPEC, tmp_path, capacity_bytes=4 * SLOT) as t:
        k = keys_of(0, 5)
        t.put_many(k[:4], payload_for(k[:4], SPEC.block_bytes))
        assert t.put_many(k[4:], payload_for(k[4:], SPEC.block_bytes)).tolist() == [PutResult.STORED]
        check_index(str(t.path))
        ev = t.evict(10, with_payloads=False)
        assert ev.payloads is None and len(ev.keys) == 4 and len(ev.hits) == 4
        assert t.stats().used_blocks == 0
        check_index(str(t.path))


def test_hits_are_flushed_lazily_and_survive_reopen(tmp_path):
    k = keys_of(0, 3)
    with WarmTier(SPEC, tmp_path, capacity_bytes=8 * SLOT, flush_every=1000) as t:
        t.put_many(k, payload_for(k, SPEC.block_bytes))
        out = np.zeros((3, SPEC.block_bytes), np.uint8)
        for _ in range(5):
            t.get_many(k[:2], out[:2])
        assert t.stats().extra["pending_hits"] == 10
    # Reopened: the hit counts are in the records; the policy view is built from them.
    with WarmTier(SPEC, tmp_path) as t:
        ev = t.evict(1)  # builds the policy view from the records: the block never hit goes first
        assert ev.keys.keys.tolist() == k.keys[2:].tolist()
        st = t._view.state
        assert sorted(st.hits[st.resident_slots].tolist()) == [5, 5]


def test_disk_layout_and_modes(tier):
    d = str(tier.path)
    assert os.path.basename(d) == SPEC.namespace
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    names = sorted(os.listdir(d))
    assert {"meta.json", "index.lmdb", "slab-0000.bin"} <= set(names)
    for name in names:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, name
    for name in os.listdir(os.path.join(d, "index.lmdb")):
        assert stat.S_IMODE(os.stat(os.path.join(d, "index.lmdb", name)).st_mode) == 0o600
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["format_version"] == 1 and meta["fingerprint"] == SPEC.fingerprint
    assert meta["slot_bytes"] % 4096 == 0 and meta["n_slots"] == 16
    assert os.path.getsize(os.path.join(d, "slab-0000.bin")) == 16 * SLOT


def test_spec_mismatch_names_the_field(tmp_path):
    other = KVSpec(model_id="test/warm-tiny", num_layers=3, num_kv_heads=1, head_dim=8, chunk_tokens=4)
    WarmTier(other, tmp_path, capacity_bytes=4 * SLOT).close()
    os.rename(tmp_path / other.namespace, tmp_path / SPEC.namespace)
    with pytest.raises(SpecMismatch, match=r"num_layers: stored 3, given 2"):
        WarmTier(SPEC, tmp_path, capacity_bytes=4 * SLOT)


def test_newer_format_version_is_refused(tmp_path):
    WarmTier(SPEC, tmp_path, capacity_bytes=4 * SLOT).close()
    p = tmp_path / SPEC.namespace / "meta.json"
    meta = json.loads(p.read_text())
    meta["format_version"] = 3  # 2 is a compact tier (tests/test_warm_compact.py)
    p.write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=r"format version 3, newer than this tieredkv reads \(1, 2\)"):
        WarmTier(SPEC, tmp_path)


def test_bad_arguments_and_closed(tmp_path):
    with pytest.raises(InvalidInput, match="sync must be one of"):
        WarmTier(SPEC, tmp_path, capacity_bytes=SLOT, sync="sometimes")
    with pytest.raises(InvalidInput, match="pass capacity_bytes"):
        WarmTier(SPEC, tmp_path / "new")
    t = WarmTier(SPEC, tmp_path, capacity_bytes=4 * SLOT)
    with pytest.raises(InvalidInput, match="payloads must hold 1 blocks"):
        t.put_many(keys_of(0, 1), np.zeros(3, np.uint8))
    t.close()
    t.close()
    with pytest.raises(InvalidInput, match="closed"):
        t.match(keys_of(0, 1))


def test_capacity_of_existing_tier_wins(tmp_path):
    WarmTier(SPEC, tmp_path, capacity_bytes=4 * SLOT).close()
    with pytest.warns(UserWarning, match="keeps its capacity of 4 slots"):
        t = WarmTier(SPEC, tmp_path, capacity_bytes=8 * SLOT)
    assert t.stats().capacity_blocks == 4
    t.close()


def test_open_serves_hits_without_scanning(tmp_path):
    k = keys_of(0, 8)
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * SLOT) as t:
        t.put_many(k, payload_for(k, SPEC.block_bytes))
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros((8, SPEC.block_bytes), np.uint8)
        assert t.get_many(k, out) == 8
        assert t._view.state is None  # no policy rebuild (no index scan) was needed to serve hits
        np.testing.assert_array_equal(out, payload_for(k, SPEC.block_bytes))


@pytest.mark.procs
def test_fork_child_opens_its_own_environment(tmp_path):
    k = keys_of(0, 4)
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * SLOT) as t:
        t.put_many(k[:2], payload_for(k[:2], SPEC.block_bytes))
        pid = os.fork()
        if pid == 0:  # child: use the inherited handle, then leave without cleanup
            code = 1
            try:
                out = np.zeros((4, SPEC.block_bytes), np.uint8)
                ok = t.get_many(k, out) == 2 and (out[:2] == payload_for(k[:2], SPEC.block_bytes)).all()
                ok &= (t.put_many(k[2:], payload_for(k[2:], SPEC.block_bytes)) == PutResult.STORED).all()
                t.close()
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert t.match(k) == 4  # the parent's handle still works and sees the child's blocks
    check_index(str(tmp_path / SPEC.namespace))


def test_two_handles_in_one_process_never_steal_a_live_claim(tmp_path):
    """Handle B must not reap (and reuse the slot of) a claim handle A is still writing: both share
    the process identity, so only the process-wide set of live claims tells them apart."""
    from tieredkv import KVSpec, chunk_keys

    spec = KVSpec(model_id="test/claims", num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=4)
    bb = spec.block_bytes
    a = WarmTier(spec, tmp_path, 2 * 4096, verify="never")
    b = WarmTier(spec, tmp_path, verify="never")
    try:
        first = chunk_keys(spec, np.arange(12))
        other = chunk_keys(spec, np.arange(100, 104))
        a.put_many(first[:2], np.full((2, bb), 1, np.uint8))  # the tier is full
        write = a._slabs.write

        def b_stores_meanwhile(slots, rows, idx=None):
            b.put_many(other, np.full((1, bb), 2, np.uint8))
            return write(slots, rows, idx)

        a._slabs.write = b_stores_meanwhile
        a.put_many(first[2:3], np.full((1, bb), 3, np.uint8))
        a._slabs.write = write
        for tier, keys, value in ((b, other, 2), (a, first[2:3], 3)):
            out = np.zeros((1, bb), np.uint8)
            if tier.get_many(keys, out):
                assert set(out[0].tolist()) == {value}  # whatever is served is what was stored
        assert a.contains_many(first[2:3])[0]  # A's put was not robbed
    finally:
        a.close()
        b.close()
