"""Helpers for tests and benchmarks of the warm tier: key-derived payloads and an index checker."""

from __future__ import annotations

import os

import numpy as np

from tieredkv.keys import ChunkKeys
from tieredkv.warm import index as ix
from tieredkv.warm import meta as mt


def payload_for(keys: ChunkKeys, block_bytes: int) -> np.ndarray:
    """``(n, block_bytes)`` uint8 payloads that are a pure function of each key (so any reader can
    check any block it got, byte for byte, without knowing who wrote it)."""
    n = len(keys)
    raw = np.ascontiguousarray(keys.keys, dtype="<u8")
    reps = -(-block_bytes // 16)
    rows = np.tile(raw.view(np.uint8).reshape(n, 16), (1, reps))[:, :block_bytes]
    # Mix in the byte offset so a block shifted within its slot does not verify either.
    return rows ^ (np.arange(block_bytes, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)


def check_index(tier_dir: str, *, allow_claims: bool = False) -> dict:
    """Check the index invariants of a closed or idle tier; raise AssertionError naming a violation.

    Every slot below the high-water mark is in exactly one of: used (``slots``), ``free``, or claimed
    (``inflight``, only if ``allow_claims``); ``blocks`` and ``slots`` mirror each other.

    Returns:
        ``{"used", "free", "claimed", "never_used", "n_slots"}`` counts.
    """
    meta = mt.read_meta(tier_dir)
    index = ix.Index(os.path.join(tier_dir, mt.INDEX_NAME), sync="none", map_size=1 << 20,
                     map_max=1 << 40, readonly=True)
    rec = ix.record_dtype(meta["spec"]["chunk_tokens"])
    try:
        txn = index.begin_read()
        try:
            n = ix.get_u64(txn, index.info, ix.INFO_N_SLOTS)
            hwm = ix.get_u64(txn, index.info, ix.INFO_HWM)
            owner = np.full(n, -1, dtype=np.int8)
            used = 0
            for k, v in txn.cursor(db=index.blocks):
                assert len(v) == rec.itemsize, f"record of {k.hex()} has {len(v)} bytes"
                s = int(np.frombuffer(v, dtype=rec)[0]["slot"])
                assert s < hwm, f"block {k.hex()} in slot {s} >= hwm {hwm}"
                assert owner[s] == -1, f"slot {s} used twice"
                assert txn.get(ix.slot_key(s), db=index.slots) == k, f"slots[{s}] does not name {k.hex()}"
                owner[s] = 0
                used += 1
            assert txn.stat(index.slots)["entries"] == used, "slots and blocks differ in size"
            free = 0
            for sk, _ in txn.cursor(db=index.free):
                s = ix.SLOT_KEY.unpack(sk)[0]
                assert s < hwm and owner[s] == -1, f"free slot {s} is also used / claimed / >= hwm"
                owner[s] = 1
                free += 1
            claimed = 0
            for k, c in txn.cursor(db=index.inflight):
                s = ix.CLAIM.unpack(c)[0]
                assert allow_claims, f"claim of slot {s} left in the index"
                assert owner[s] == -1, f"claimed slot {s} is also used / free"
                owner[s] = 2
                claimed += 1
            lost = np.flatnonzero(owner[:hwm] == -1)
            assert not len(lost), f"slots {lost[:10].tolist()} are neither used, free nor claimed"
        finally:
            txn.abort()
    finally:
        index.close()
    return {"used": used, "free": free, "claimed": claimed, "never_used": int(n - hwm), "n_slots": int(n)}
