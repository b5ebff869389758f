"""Helpers for tests and benchmarks of the warm tier: key-derived payloads and an index checker."""

from __future__ import annotations

import numpy as np

from tieredkv.keys import ChunkKeys
from tieredkv.warm import files
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
    index = files.open_index(tier_dir)
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
            for _, c in txn.cursor(db=index.inflight):
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


# ---- child-process workloads (run with `python -c`, so tests can SIGKILL them) ---------------------
TEST_SPEC_ARGS = dict(model_id="test/warm-tiny", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)


def prompt_keys(spec, prompt: int, n_chunks: int):
    """Keys of synthetic prompt ``prompt``: prompts ``p`` and ``p + 1000`` share no tokens."""
    from tieredkv.keys import chunk_keys
    base = (prompt % 7) * 10_000  # prompts with equal ``prompt % 7`` share a prefix
    tokens = np.concatenate([np.arange(base, base + 2 * spec.chunk_tokens),
                             np.arange(n_chunks * spec.chunk_tokens) + 1_000_000 + prompt * 997])
    return chunk_keys(spec, tokens[: n_chunks * spec.chunk_tokens])


def writer(root: str, *, capacity_slots: int, batches: int, chunks: int = 8, sync: str = "none",
           seed: int = 0, spec_args: dict | None = None) -> None:
    """Store ``batches`` prompts, printing ``committed <prompt>`` after each put_many returns."""
    import sys

    from tieredkv.spec import KVSpec
    from tieredkv.warm.tier import WarmTier
    spec = KVSpec(**(spec_args or TEST_SPEC_ARGS))
    slot = -(-spec.block_bytes // 4096) * 4096
    with WarmTier(spec, root, capacity_bytes=capacity_slots * slot, sync=sync) as tier:
        for b in range(batches):
            p = seed * 100_000 + b
            k = prompt_keys(spec, p, chunks)
            tier.put_many(k, payload_for(k, spec.block_bytes))
            sys.stdout.write(f"committed {p}\n")
            sys.stdout.flush()


def mixer(root: str, seed: int, seconds: float, capacity_slots: int, spec_args: dict | None = None,
          verify: str = "never") -> dict:
    """Read and write overlapping prompts for ``seconds``; check every block read, byte for byte."""
    import time

    from tieredkv.spec import KVSpec
    from tieredkv.warm.tier import WarmTier
    spec = KVSpec(**(spec_args or TEST_SPEC_ARGS))
    slot = -(-spec.block_bytes // 4096) * 4096
    rng = np.random.default_rng(seed)
    counts = {"reads": 0, "blocks_read": 0, "bad": 0, "stored": 0, "removed": 0, "evicted": 0}
    with WarmTier(spec, root, capacity_bytes=capacity_slots * slot, verify=verify) as tier:
        end = time.monotonic() + seconds
        out = np.empty((16, spec.block_bytes), dtype=np.uint8)
        while time.monotonic() < end:
            k = prompt_keys(spec, int(rng.integers(0, 40)), int(rng.integers(1, 16)))
            got = tier.get_many(k, out[:len(k)])
            counts["reads"] += 1
            counts["blocks_read"] += got
            if got and not np.array_equal(out[:got], payload_for(k[:got], spec.block_bytes)):
                counts["bad"] += 1
            codes = tier.put_many(k[got:], payload_for(k[got:], spec.block_bytes))
            counts["stored"] += int((codes == 0).sum())
            r = rng.random()
            if r < 0.05:
                counts["removed"] += tier.remove(k[:1])
            elif r < 0.1:
                ev = tier.evict(2)
                counts["evicted"] += len(ev.keys)
                if len(ev.keys) and not np.array_equal(ev.payloads, payload_for(ev.keys, spec.block_bytes)):
                    counts["bad"] += 1
    return counts
