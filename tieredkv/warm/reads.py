"""The warm tier's checked reads: records confirmed, slots copied without any lock, then re-checked
and verified.

``get_many`` and ``read_through`` (warm/tier.py, whose docstring draws the steps) look the records up
(``_lookup``, read transaction 1), copy their slots and re-check them (``_copy_checked``: the copy, one
group of about ``READ_GROUP_BYTES`` at a time, each group hashed while it is still in the CPU cache;
read transaction 2; the checksums) and remove what failed (``_drop_bad_records``, ``_drop_corrupt``,
never waiting behind a writer: this is the read path). Copying outside any lock is safe because a slot
is rewritten only after the record that owned it was deleted in a committed write transaction: if
transaction 2, begun after the copy ended, still sees the same (slot, gen), no writer touched the slot
meanwhile.

``read_through`` reads every group into the same small buffer of the calling thread (``Scratch``, in
``_read_hashing``), so a group is in the CPU cache from the moment the kernel copies it in until the
sink has copied it out: main memory is written once, by the sink, where ``get_many`` writes the
caller's rows and the sink then writes the destination (twice). A sink sees a group before the group is
verified (as ``get_many``'s sink does); only the leading blocks the call returns are valid where it
put them.
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash

from tieredkv.errors import TieredKVError
from tieredkv.keys import ChunkKeys, key_at
from tieredkv.layout import page_aligned_empty
from tieredkv.warm import index as ix
from tieredkv.warm import packed
from tieredkv.warm.records import Records

#: A read is split into groups of about this size (at least one block), each read, checksummed and handed
#: to the caller's sink before the next one is read by the same thread: the group is still in the CPU's
#: L2 cache when it is hashed and copied out, so a verified read touches main memory about as often as a
#: plain read (one pass) instead of three (read, hash, copy). Pipelines across threads did worse (a
#: helper hashing one 32 MiB group while the next was read hashed out of DRAM, 3.9x the time of hashing
#: in L2; one reading 1 MiB groups three ahead of the sink was slower on 2 loaded cores). A
#: ``read_through`` the caller allows to run in parallel (its sink only writes each block's own places)
#: is instead split in two halves of whole groups (``tieredkv.halves``, from ``SPLIT_BYTES`` on): the
#: tier's helper thread reads, hashes and sinks the second half into a buffer of its own while the
#: calling thread does the first, so each group stays on one thread. A 112 MiB verified restore then
#: runs at 0.81-0.95x a page-cache read on 2 quiet cores, against about 0.7x on one thread
#: (docs/benchmarks.md); on busy cores ``tieredkv.halves`` does not split.
READ_GROUP_BYTES = 1 << 20


class Scratch(threading.local):
    """One kept, page-aligned buffer per reading thread for ``read_through``'s groups (reads take no
    lock, so threads cannot share one). Kept, not allocated per call: a fresh buffer costs a page
    fault per 4 KiB, and a fresh one is not in the CPU cache."""

    buf: np.ndarray | None = None

    def rows(self, k: int, block_bytes: int) -> np.ndarray:
        """``(k, block_bytes)`` uint8 rows of this thread's buffer (grown when too small)."""
        need = k * block_bytes
        if self.buf is None or self.buf.size < need:
            self.buf = None  # drop the old one before allocating the larger one
            self.buf = page_aligned_empty(need)
        return self.buf[:need].reshape(k, block_bytes)


class CheckedReads(Records):
    """Lookups confirmed against the keys, copies re-checked against the index and verified."""

    def _lookup(self, txn, raw: bytes, keys: ChunkKeys, n: int, prefix: bool) -> tuple[np.ndarray, np.ndarray]:
        """Records of the first ``n`` keys and a mask of those found *and* confirmed.

        With ``prefix`` the scan stops at the first miss (the mask is False from there on).
        """
        get = txn.get
        db = self._index.blocks
        size = self._rec.itemsize
        blank = bytes(size)
        vals = []
        # One LMDB call per key is the floor here (LMDB has no batch get); values are joined and
        # parsed in one numpy pass below, so no per-block Python object outlives this loop.
        for i in range(n):
            v = get(key_at(raw, i), db=db)
            if v is None or len(v) != size:
                if prefix:
                    break
                v = blank
            vals.append(v)
        m = len(vals)
        recs = np.frombuffer(b"".join(vals), dtype=self._rec) if m else np.zeros(0, self._rec)
        found = np.zeros(n, dtype=bool)
        if m:
            # A damaged slot field must be a miss, never an index past the slabs.
            found[:m] = (packed.servable(recs["length"], self.block_bytes, self.slot_bytes)
                         & (recs["slot"] < self.n_slots)
                         & (recs["parent"] == keys.parents[:m]).all(axis=1)
                         & (recs["tokens"] == keys.tokens[:m]).all(axis=1))
        if prefix and not found.all():
            found[int(np.argmin(found)):] = False
        return recs, found

    def _bad_records(self, txn, raw: bytes, keys: ChunkKeys, recs: np.ndarray, n: int) -> np.ndarray:
        """Among the first ``n`` records (found for ``keys``), those that break an index invariant.

        A record whose key and tokens match but whose slot is out of range, or whose slot's reverse
        entry names another key, was damaged on disk (one flipped byte in the slot field is enough):
        serving it would hand out another block's bytes or fail on every load. Returns a bool mask.
        """
        m = min(n, len(recs))
        if not m:
            return np.zeros(0, dtype=bool)
        bad = ((recs["slot"][:m] >= self.n_slots)
               & packed.valid_length(recs["length"][:m], self.block_bytes, self.slot_bytes)
               & (recs["parent"][:m] == keys.parents[:m]).all(axis=1)
               & (recs["tokens"][:m] == keys.tokens[:m]).all(axis=1))
        if self.verify == "always":
            # Another block's slot fails this block's checksum (dropped and counted there); the
            # reverse lookups (one LMDB get per block) are needed only where bytes go unchecked.
            return bad
        get, db = txn.get, self._index.slots
        for i in np.flatnonzero(~bad).tolist():
            if get(ix.slot_key(int(recs["slot"][i])), db=db) != key_at(raw, i):
                bad[i] = True
        return bad

    def _drop_bad_records(self, raw: bytes, recs: np.ndarray, which: np.ndarray) -> None:
        """Delete records that break an invariant (if unchanged since read), counting them as corrupt.

        Their slots are left alone: a damaged record cannot say which slot is really its own.
        """
        with self._mem:
            self._counts["corrupt"] += len(which)
        if self.readonly or not len(which):
            return
        entries = [(key_at(raw, i), int(recs["gen"][i])) for i in which.tolist()]

        def drop(txn):
            dropped = 0
            for key, gen in entries:
                v = txn.get(key, db=self._index.blocks)
                if v is not None and len(v) == self._rec.itemsize \
                        and int(np.frombuffer(v, dtype=self._rec)[0]["gen"]) == gen:
                    txn.delete(key, db=self._index.blocks)
                    dropped += 1
            total = ix.get_u64(txn, self._index.info, ix.INFO_CORRUPT) + dropped
            ix.put_u64(txn, self._index.info, ix.INFO_CORRUPT, total)

        try:
            self._index.write(drop, wait_s=0)  # on the read path: never wait behind a writer
        except TieredKVError:
            pass  # dropped by a later read

    def _copy_checked(self, raw: bytes, keys: ChunkKeys, recs: np.ndarray, rows: np.ndarray | None,
                      sink=None, parallel: bool = False) -> int:
        """Copy ``recs``' slots into ``rows``, re-check and verify; return the good leading run.

        ``rows`` None (``read_through``): each group is read into this thread's scratch buffer and
        handed to ``sink`` (required then), the only place its bytes go.
        """
        run = len(recs)
        slots = recs["slot"].astype(np.int64)
        check = np.full(run, self.verify != "never")
        if self.verify == "sampled":
            with self._mem:  # a Generator is not thread-safe
                check &= self._rng.random(run) < self.sample_rate
        failed = lacking = np.zeros(run, dtype=bool)
        if (recs["length"] == self.block_bytes).all():
            complete, sums = self._read_hashing(slots, rows, check, sink, parallel)
        else:  # some blocks are stored compressed: always checked, then decompressed
            if rows is None:  # into rows of their own (decompressing dominates such a read)
                rows = np.empty((run, self.block_bytes), dtype=np.uint8)
            complete, sums, check, failed, lacking = packed.read(
                self._slabs, slots, recs["length"], recs["checksum"], rows, check, sink, self.spec.dtype_bytes,
                READ_GROUP_BYTES)
        # Re-check after the copy (module docstring): same slot and gen <=> bytes were stable.
        again, found = self._index.read(lambda txn: self._lookup(txn, raw, keys, run, True))
        stable = found.copy()
        m = len(again)
        stable[:m] &= (again["slot"] == recs["slot"][:m]) & (again["gen"] == recs["gen"][:m])
        stable[m:] = False
        bad = stable & ~complete
        bad |= stable & complete & check & (sums != recs["checksum"])
        bad |= stable & failed
        end = np.flatnonzero(~stable | bad | lacking)  # lacking: this process lacks the codec (a miss)
        good = int(end[0]) if len(end) else run
        if good < run and lacking[good] and stable[good]:
            with self._mem:
                self._counts["undecodable"] += 1
        if bad.any():
            self._drop_corrupt(raw, recs, np.flatnonzero(bad))
        return good

    def _read_hashing(self, slots: np.ndarray, rows: np.ndarray | None, check: np.ndarray,
                      sink=None, parallel: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Read ``slots`` into ``rows`` and checksum the ``check`` rows, one group of about
        ``READ_GROUP_BYTES`` at a time: each group is hashed and handed to ``sink`` right after it is
        read, while it is still in the CPU cache. ``rows`` None: every group is read into this
        thread's scratch buffer (``read_through``), overwritten by the next one once ``sink`` returns.
        ``parallel`` (``read_through`` only): the sink may be called from the helper thread, out of key
        order, and a large read is split between the two threads (``tieredkv.halves.SPLIT_BYTES``).

        Returns:
            ``(complete, sums)``: blocks read in full, and the xxh3_64 of each checked row (0 elsewhere).
        """
        n = len(slots)
        per_group = max(1, READ_GROUP_BYTES // self.block_bytes)
        if rows is not None and (n <= per_group or not (check.any() or sink is not None)):
            per_group = max(n, 1)  # one read: nothing gains from being in the cache
        if n > per_group:
            self._slabs.prefetch(slots)  # cold data: the disk reads ahead of the groups, as for one read
        complete = np.zeros(n, dtype=bool)
        sums = [0] * n
        checks = check.tolist()

        def groups(b0: int, e0: int) -> None:
            """Read, hash and sink groups from block ``b0`` up to ``e0`` on the calling thread."""
            scratch = self._scratch.rows(min(e0 - b0, per_group), self.block_bytes) if rows is None else rows
            # Per group: lists, not numpy calls (a 112 MiB restore of 1.75 MiB blocks is 64 groups).
            for b in range(b0, e0, per_group):
                e = min(e0, b + per_group)
                group = scratch[:e - b] if rows is None else rows[b:e]
                ok = self._slabs.read(slots[b:e], group)
                complete[b:e] = ok
                for j, whole in enumerate(ok.tolist()):
                    if whole and checks[b + j]:
                        sums[b + j] = xxhash.xxh3_64_intdigest(group[j])
                if sink is not None:
                    sink(b, group)

        if parallel:
            self._halves.split(n, self.block_bytes, groups, step=per_group)  # whole groups per thread
        else:
            groups(0, n)
        return complete, np.array(sums, dtype=np.uint64)

    def _drop_corrupt(self, raw: bytes, recs: np.ndarray, which: np.ndarray) -> None:
        """Count bad blocks and remove their records (if still the same gen) so they are never served."""
        with self._mem:
            self._counts["corrupt"] += len(which)
        if self.readonly:
            return  # cannot remove; every later read detects them again (short or checksum)
        entries = [(key_at(raw, i), int(recs["slot"][i]), int(recs["gen"][i]))
                   for i in which.tolist()]

        def drop(txn):
            removed = []
            dropped = 0
            for key, slot, gen in entries:
                rec, owned = self._delete_record(txn, key, expect_gen=gen)
                dropped += rec is not None
                if owned:
                    txn.put(ix.slot_key(slot), b"", db=self._index.free)
                    removed.append(slot)
            total = ix.get_u64(txn, self._index.info, ix.INFO_CORRUPT) + dropped
            ix.put_u64(txn, self._index.info, ix.INFO_CORRUPT, total)
            return removed

        try:
            removed = self._index.write(drop, wait_s=0)  # on the read path: never wait behind a writer
        except TieredKVError:
            return  # index not writable now: the block stays bad and is detected again on every read
        with self._mem:
            self._view.forget(np.asarray(removed, dtype=np.int64))

