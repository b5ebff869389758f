"""The warm tier's write path after the claim: where slots come from, the commit that publishes the
written blocks, and giving back the claims of a put that failed.

``put_many`` (warm/tier.py) claims slots in one write transaction (``_take_slots``: the free list,
then never-used slots, then the claims of dead writers, then the policy's victims), writes the
payloads outside any transaction, and publishes them in a second one (``_commit``), which drops every
claim that is no longer this call's (its writer was judged dead meanwhile): data first, index second.
"""

from __future__ import annotations

import numpy as np

from tieredkv.errors import TieredKVError
from tieredkv.keys import ChunkKeys, key_at
from tieredkv.warm import index as ix
from tieredkv.warm.recovery import Recovery


class Writes(Recovery):
    """Slots for a put, its commit, and the release of its claims on failure."""

    def _take_slots(self, txn, need: int) -> tuple[list[int], list]:
        """Claim up to ``need`` free slots in ``txn``: free list, then never-used, then policy victims.

        Returns:
            ``(slots, victims)``: the claimed slots, and ``(slot, key, record)`` of each block evicted
            to free one of them.
        """
        if need <= 0:
            return [], []
        slots = self._pop_free(txn, need)
        victims: list = []
        if len(slots) < need:
            # Claims of dead writers first: cheaper than evicting live blocks.
            if self._reap_claims_in(txn):
                slots += self._pop_free(txn, need - len(slots))
        if len(slots) < need:
            with self._mem:  # inside the write transaction: the writer lock is held, nothing is waited on
                victims = self._view.choose_victims(txn, self._index, need - len(slots), self._delete_record)
            slots += [int(s) for s, _, _ in victims]
        return slots, victims

    def _pop_free(self, txn, need: int) -> list[int]:
        slots: list[int] = []
        cur = txn.cursor(db=self._index.free)
        if cur.first():
            while len(slots) < need:
                key = cur.key()
                if not key:  # past the last entry (delete leaves the cursor on the next one)
                    break
                slots.append(ix.SLOT_KEY.unpack(key)[0])
                cur.delete()
        if len(slots) < need:
            hwm = ix.get_u64(txn, self._index.info, ix.INFO_HWM)
            take = min(need - len(slots), self.n_slots - hwm)
            if take > 0:
                slots.extend(range(hwm, hwm + take))
                ix.put_u64(txn, self._index.info, ix.INFO_HWM, hwm + take)
        return slots

    def _commit(self, raw: bytes, keys: ChunkKeys, idx: np.ndarray, slots: np.ndarray, sums: list[int],
                owner: int, token: int, lengths: np.ndarray | None = None) -> np.ndarray:
        """Publish the written blocks: records in, claims out, one transaction. Return a stored mask.
        ``lengths``: the bytes each block occupies in its slot (None: all raw, ``block_bytes``)."""
        m = len(idx)
        recs = np.zeros(m, dtype=self._rec)
        recs["slot"] = slots
        recs["length"] = self.block_bytes if lengths is None else lengths
        recs["checksum"] = np.asarray(sums, dtype=np.uint64)
        recs["parent"] = keys.parents[idx]
        t = ix.now_us()
        recs["insert_us"] = t
        recs["last_access_us"] = t
        recs["position"] = keys.positions[idx]
        recs["tokens"] = keys.tokens[idx]
        want = [ix.CLAIM.pack(int(s), owner, token, 0)[:16] for s in slots.tolist()]

        def commit(txn):
            gen = ix.get_u64(txn, self._index.info, ix.INFO_GEN)
            recs["gen"] = np.arange(gen + 1, gen + 1 + m, dtype=np.uint64)
            ok = np.zeros(m, dtype=bool)
            for j, i in enumerate(idx.tolist()):
                k = key_at(raw, i)
                c = txn.get(k, db=self._index.inflight)
                if c is None or c[:16] != want[j]:
                    continue  # our claim was taken (we were judged dead): the slot is not ours
                txn.delete(k, db=self._index.inflight)
                txn.put(k, recs[j].tobytes(), db=self._index.blocks)
                txn.put(ix.slot_key(int(slots[j])), k, db=self._index.slots)
                ok[j] = True
            ix.put_u64(txn, self._index.info, ix.INFO_GEN, gen + m)
            parent_slots = None
            if self._view.state is not None:
                parent_slots = self._slots_of(txn, keys.parents[idx])
            return ok, parent_slots

        ok, parent_slots = self._index.write(commit)
        if parent_slots is not None:
            with self._mem:
                self._view.inserted(slots[ok], keys.key64[idx][ok], parent_slots[ok], keys.positions[idx][ok])
        return ok

    def _slots_of(self, txn, keys2: np.ndarray) -> np.ndarray:
        """Slot of each ``(m, 2)`` key stored in ``txn``, -1 where absent."""
        raw = np.ascontiguousarray(keys2, dtype="<u8").tobytes()
        out = np.full(len(keys2), -1, dtype=np.int64)
        for j in range(len(keys2)):
            v = txn.get(key_at(raw, j), db=self._index.blocks)
            if v is not None and len(v) == self._rec.itemsize:
                out[j] = int(np.frombuffer(v, dtype=self._rec)["slot"][0])
        return out

    def _release(self, raw: bytes, idx: np.ndarray, slots: np.ndarray, owner: int, token: int) -> None:
        """Give back claims of a put that failed before its commit (best effort)."""

        def release(txn):
            for i, s in zip(idx.tolist(), slots.tolist()):
                k = key_at(raw, i)
                c = txn.get(k, db=self._index.inflight)
                if c is not None and ix.CLAIM.unpack(c)[:3] == (s, owner, token):
                    txn.delete(k, db=self._index.inflight)
                    txn.put(ix.slot_key(s), b"", db=self._index.free)

        try:
            self._index.write(release)
        except TieredKVError:
            # The index cannot be written either; the claims name this process, so its next put (or
            # anyone, once it has exited) reaps them.
            pass

