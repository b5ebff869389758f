"""WarmTier: blocks in preallocated slab files on SSD, found through an LMDB index that survives restarts.

A put is three steps, each safe to die in ("data first, index second": docs/architecture.md,
invariant 7)::

    1. claim   write txn: take free slots (free list, high-water mark, or policy victims) and record
               them in ``inflight`` under this process's registry entry   -> crash: slots reaped as free
               (tieredkv.warm.owners: liveness by kernel locks, valid across PID namespaces)
    2. data    pwritev the payloads into the claimed slots (+ fdatasync with sync="data"/"full")
                                                                          -> crash: garbage in slots
                                                                             that are still only claimed
    3. commit  write txn: records -> blocks/slots, claims dropped          -> atomic (LMDB)

A get copies without holding anything, then re-checks::

    read txn 1: records of the keys (confirm parent key + chunk tokens)
    preadv each slot into the caller's rows (``read_through``: group by group into one small buffer
               of this thread, each group hashed and handed to the caller's sink while in the CPU cache)
    read txn 2: the same records still carry the same (slot, gen)?  else the block was removed or
               recycled while we copied: the run ends there, those bytes are never returned
    checksum (always / sampled / never): a mismatch is corruption: counted, removed, a miss

Txn 2 is what makes copying outside any lock safe: a slot is rewritten only after the record that owned
it was deleted in a committed write txn, so if txn 2 (begun after the copy ended) still sees the record,
no writer touched the slot while we copied.

Policy state is a private ``SlotState`` per process (warm slot ids are its slots), built from the
records' policy fields the first time eviction needs it (not at open: open stays O(1)), refreshed when
victims turn out stale or many blocks were stored by others. Victims chosen from this view are
re-checked against LMDB inside the write transaction that frees them. Hits update the view in memory
and are written to the records in batches (every ``flush_every`` hits and at close), so a hit never
costs a write transaction or an fsync.

This module is the block interface (the ``Tier`` protocol); the rest of a handle lives beside it:

- ``warm/records.py``: what a handle holds, and the record operations both paths use;
- ``warm/reads.py``: the checked read (lookup, copy, re-check, verify, drop what failed);
- ``warm/writes.py``: slots for a put (free list, never-used, dead writers', victims) and its commit;
- ``warm/recovery.py``: opening and repairing at open, a fork's own environment, reaping dead claims;
- ``warm/view.py``: the policy view; ``warm/slabs.py``, ``warm/index.py``: the files themselves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from numpy.random import default_rng  # at import: imported lazily, numpy.random would slow the first open

from tieredkv import codec, forksafe, policies
from tieredkv.errors import InvalidInput, LockTimeout, TieredKVError
from tieredkv.halves import Halves
from tieredkv.keys import KEY_BYTES, ChunkKeys, key_at
from tieredkv.layout import as_block_bytes
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier, TierStats, check_count, out_rows
from tieredkv.warm import index as ix
from tieredkv.warm import packed
from tieredkv.warm.reads import READ_GROUP_BYTES, CheckedReads, Scratch
from tieredkv.warm.recovery import OWN_CLAIMS, OWN_CLAIMS_LOCK
from tieredkv.warm.writes import Writes

SYNC_MODES = ("none", "data", "full")
VERIFY_MODES = ("always", "sampled", "never")
DEFAULT_SLAB_BYTES = 1 << 30


class WarmTier(Writes, CheckedReads, Tier):
    """Blocks of one namespace in ``<directory>/<spec.namespace>/``, shared by processes, kept on disk.

    Args:
        spec: the KV geometry; the directory is refused if it was made for another spec.
        directory: the warm tier root; the tier lives in its ``spec.namespace`` subdirectory (0700).
        capacity_bytes: space to preallocate for slots (rounded down to whole 4 KiB-aligned slots).
            Needed to create a tier; an existing tier keeps the capacity it was made with.
        sync: durability of a ``put_many`` that returned: ``"none"`` (survives the process, not the
            OS), ``"data"`` (payloads fdatasync'd before the index commit; a system crash may lose the
            last commit but no record points at unsynced data), ``"full"`` (also fsync the index per
            commit: a returned put survives power loss). See docs/warm-tier.md for the cost of each.
        verify: check each payload's xxh3_64 on read: ``"always"`` (default), ``"sampled"`` (a random
            ``sample_rate`` share of blocks) or ``"never"``. Only ``"always"`` protects against media
            corruption: with the others a block damaged on disk is served to the caller (as KV)
            unless its read happens to be sampled. A short or recycled read, and a record that breaks
            the index's invariants, are detected in every mode. See docs/warm-tier.md.
        policy: eviction policy name or instance (``tieredkv.policies``).
        sample_rate: share of blocks checksummed per read with ``verify="sampled"``.
        flush_every: write batched hit bookkeeping to the index after this many hits (and at close).
        slab_bytes: target size of one slab file.
        map_size_bytes, map_max_bytes: initial and largest LMDB map size (address space, not disk).
        readonly: open for reading only (``put_many``/``remove``/``evict`` raise
            ``WarmTierUnavailable``). Chosen automatically when the files cannot be opened for writing.
        lock_timeout_s: longest wait for the tier's writer lock. A writer stopped inside a write
            transaction (SIGSTOP, a debugger, a frozen container) makes other processes' stores raise
            ``LockTimeout`` after this long instead of hanging; lookups never wait for a writer.
        on_evict: called with an ``Evicted`` (keys, verified bytes, hits) for the blocks ``put_many``
            evicts to make room, before their slots are rewritten: the hook that passes blocks leaving
            the warm tier on to a lower tier (a remote store). Costs one slab read per evicted block.
        compress: write blocks compressed (``tieredkv.codec.CHOICES``: "none", "zstd", "lz4"; True:
            "zstd"): fewer bytes to and from the disk; more capacity only with ``slot_fraction``
            (tieredkv.warm.packed). Pays when the disk is slower than the codec (docs/warm-tier.md).
            Reads decode every block whatever this says; a block in a codec not installed here (or
            unknown to this version) is a miss, left in place, counted in ``stats().extra["undecodable"]``.
        slot_fraction: when creating a tier, below 1 makes it compact: slots of this share of a
            block (rounded up to 4 KiB), so ``capacity_bytes`` holds ``1 / slot_fraction`` times as
            many blocks, each stored compressed (with ``compress``, or "zstd" when that is "none").
            A block that does not compress into a slot is refused (``NO_SPACE``, counted in
            ``stats().extra["too_big"]``). 0.75 holds bf16 KV (0.68-0.72 of its bytes with "zstd");
            random or fp32 data would be refused. An existing tier keeps the slots it was made with.

    Raises:
        SpecMismatch: the directory holds a tier of another spec.
        FormatError: the meta file is damaged or from a newer tieredkv.
        PermissionDenied: the directory (or a file in it) belongs to another user, is a symbolic
            link, or has a mode open to others that cannot be restricted.
        CapacityError: the disk cannot hold ``capacity_bytes`` (nothing the failed creation made is
            left behind).
        CorruptState: the index is truncated (run ``tieredkv verify --repair``) or disagrees with
            ``meta.json``. A missing or emptied index is rebuilt empty instead, with a warning.
        WarmTierUnavailable: the files cannot be opened, or a live process uses index files that
            were since deleted or replaced.
        LockTimeout: another process held the writer lock for ``lock_timeout_s`` (it is stopped
            inside a write).
        InvalidInput: bad arguments (unknown sync/verify mode, no capacity for a new tier, a
            directory that is not a non-empty path).
        MissingDependency: ``compress`` needs blosc2, which is not installed.

    A ``WarmTier`` may be used from several threads and survives ``fork`` (the child opens its own
    LMDB environment on its first call). Writes are serialised; lookups and loads never wait for a
    write (its wait for the writer lock, its data copy): they run beside it.
    """

    def __init__(self, spec: KVSpec, directory: str | os.PathLike, capacity_bytes: int | None = None, *,
                 sync: str = "none", verify: str = "always", policy: Any = "lru",
                 sample_rate: float = 1 / 16, flush_every: int = 1024,
                 slab_bytes: int = DEFAULT_SLAB_BYTES, map_size_bytes: int | None = None,
                 map_max_bytes: int | None = None, readonly: bool = False, lock_timeout_s: float = 10.0,
                 on_evict: Callable[[Evicted], None] | None = None, compress: str | bool | None = None,
                 slot_fraction: float = 1.0):
        if not isinstance(spec, KVSpec):
            raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
        if sync not in SYNC_MODES:
            raise InvalidInput(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if verify not in VERIFY_MODES:
            raise InvalidInput(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if not 0.0 < sample_rate <= 1.0:
            raise InvalidInput(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if isinstance(lock_timeout_s, bool) or not isinstance(lock_timeout_s, (int, float)) \
                or not 0 < lock_timeout_s < float("inf"):
            raise InvalidInput(f"lock_timeout_s must be a positive number of seconds, got {lock_timeout_s!r}")
        self.lock_timeout_s = float(lock_timeout_s)
        if capacity_bytes is not None and (not isinstance(capacity_bytes, (int, np.integer))
                                           or isinstance(capacity_bytes, bool) or capacity_bytes <= 0):
            raise InvalidInput(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.spec = spec
        self.sync = sync
        self.verify = verify
        name = codec.choice(compress)
        if name == "zlib":
            raise InvalidInput("compress='zlib' is too slow for the warm tier (tens of MB/s); use 'zstd' or 'lz4'")
        #: frames blocks on write (None: blocks are written raw)
        self._packer = packed.Packer(name, spec.block_bytes, spec.dtype_bytes) if name != "none" else None
        if isinstance(slot_fraction, bool) or not isinstance(slot_fraction, (int, float)) \
                or not 0.0 < slot_fraction <= 1.0:
            raise InvalidInput(f"slot_fraction must be in (0, 1], got {slot_fraction!r}")
        self._slot_fraction = float(slot_fraction)
        self.sample_rate = float(sample_rate)
        self.flush_every = max(1, int(flush_every))
        try:
            self.policy = policies.make(policy)
        except (KeyError, TypeError) as e:  # UnknownPolicy's message lists the valid names
            raise InvalidInput(str(e)) from None
        if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)) \
                or not os.fspath(directory):
            # "" would silently mean the current directory: wherever the worker happened to start.
            raise InvalidInput(f"directory (warm_dir) must be a non-empty path, got {directory!r}")
        self.root = Path(directory)
        self.path = self.root / spec.namespace
        self.readonly = bool(readonly)
        self.on_evict = on_evict
        #: whether ``on_evict`` gets the evicted bytes (read and verified); False: keys and hits only
        self.evict_payloads = True
        self._closed = True
        # Two locks, so that lookups and loads never wait for a write (LMDB readers never wait for a
        # writer; neither may this object):
        # _lock serialises this handle's writers (put_many, remove, evict, close). A writer holds it
        #   across its wait for the tier's writer lock and its data copy; readers never take it.
        # _mem guards this process's in-memory state (policy view, pending hits, counters). Held for
        #   memory work only: never across a wait for the writer lock, a data copy or an I/O call.
        #   Order: _lock -> writer lock -> _mem.
        self._lock = threading.RLock()
        self._mem = threading.RLock()
        forksafe.register(self)  # both unlocked in a forked child: a write-behind write may hold them
        self._rng = default_rng()
        self._scratch = Scratch()
        self._halves = Halves("tieredkv-warm-read")
        self._map_size = map_size_bytes
        self._map_max = map_max_bytes
        self._reset_process_state()
        self._open(capacity_bytes, slab_bytes)
        self._closed = False

    # ================================================================================== lookups, loads
    def match(self, keys: ChunkKeys) -> int:
        """How many leading keys are stored and confirmed (parent key and tokens). Reads no data."""
        self._check()  # no lock: a read never waits for a write (see __init__)
        raw = self._raw(keys)
        _, found = self._index.read(lambda txn: self._lookup(txn, raw, keys, len(keys), True))
        return int(found.sum())

    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        """Bool per key: stored and confirmed. Blocks still being written count as absent."""
        self._check()  # no lock: a read never waits for a write (see __init__)
        raw = self._raw(keys)
        _, found = self._index.read(lambda txn: self._lookup(txn, raw, keys, len(keys), False))
        return found

    def get_many(self, keys: ChunkKeys, out: np.ndarray, sink=None) -> int:
        """Copy the leading stored blocks into ``out`` and return how many were copied and verified.

        Args:
            keys: the blocks, in prompt order.
            out: a writable array with at least one row per key: ``(m, block_bytes)`` uint8 or the
                spec's dtype shaped ``(m, *block_shape)``, ``m >= len(keys)``.
            sink: ``sink(i, rows)`` is called with each group of rows (``(k, block_bytes)`` uint8,
                blocks ``i .. i+k-1``) as soon as it is read and hashed, on the caller's thread, before the
                blocks are verified: use it to move bytes on (into a model layout, say)
                without a second pass. As with ``out``, only the leading rows this call returns are
                valid. An exception in ``sink`` is raised by ``get_many``.

        Returns:
            The length of the leading run returned. The run ends at the first block that is absent,
            unconfirmed, removed or recycled while being copied, or fails its checksum (that block is
            removed and counted as corrupt). Rows past the run hold unspecified bytes.
        """
        return self._get(keys, out, sink)

    def read_through(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None],
                     staging: np.ndarray | None = None, *, parallel: bool = False) -> int:
        """``get_many`` for a caller that needs the blocks only where ``sink`` puts them: every group
        is read into the same small buffer of this thread (``staging`` is not used), hashed and handed
        to ``sink`` while it is still in the CPU cache, so a verified read writes main memory once
        (``warm/reads.py``). ``sink``'s rows are valid only during the call and may be handed over
        before they are verified: only the leading blocks this call returns are valid where the sink
        put them; the block that ends the run is treated as in ``get_many`` (removed and counted when
        corrupt). With ``parallel`` a large read is split with the tier's helper thread (each half
        one pass into a buffer of its thread), so ``sink`` is then called from two threads at once,
        out of key order, each block still exactly once.

        Returns:
            The length of the leading run, as ``get_many``.
        """
        return self._get(keys, None, sink, parallel)

    def _get(self, keys: ChunkKeys, out: np.ndarray | None, sink, parallel: bool = False) -> int:
        """``get_many`` (``out`` None: ``read_through``)."""
        # No lock: the copy is made safe by the re-check after it (module docstring), not by
        # excluding writers, so a read never waits for a write (see __init__).
        self._check()
        n = len(keys)
        raw = self._raw(keys)
        rows = out_rows(self.spec, out, n) if out is not None else None
        if n == 0:
            return 0

        def first(txn):
            recs, found = self._lookup(txn, raw, keys, n, True)
            end = int(np.argmin(found)) if not found.all() else n
            return recs, found, self._bad_records(txn, raw, keys, recs, end + 1)

        recs, found, bad = self._index.read(first)
        if bad.any():
            self._drop_bad_records(raw, recs, np.flatnonzero(bad))
            found[int(np.argmax(bad)):] = False
        run = int(found.sum())
        if run:
            run = self._copy_checked(raw, keys, recs[:run], rows, sink, parallel)
        with self._mem:
            self._counts["hits"] += run
            self._counts["misses"] += n - run
            self._counts["bytes_out"] += run * self.block_bytes
        if run:
            self._note_hits(raw[:run * KEY_BYTES], recs["gen"][:run], recs["slot"][:run])
        return run

    # ================================================================================== puts
    def put_many(self, keys: ChunkKeys, payloads: np.ndarray) -> np.ndarray:
        """Store blocks; return one ``PutResult`` code (int8) per key.

        ``EXISTS``: stored already, earlier in this batch, or being written by a live process.
        ``NO_SPACE``: no free slot and the policy found nothing to evict. When the tier is full the
        policy's victims are evicted to make room. Never waits on another writer.

        Raises:
            WarmTierUnavailable: the slab or index write failed (read-only, disk full, I/O error);
                nothing this call claimed stays claimed, the tier stays readable.
        """
        with self._lock:
            self._check()
            n = len(keys)
            raw = self._raw(keys)
            rows = as_block_bytes(self.spec, payloads, n)
            codes = np.full(n, PutResult.EXISTS, dtype=np.int8)
            if n == 0:
                return codes
            self._require_writable()
            # First occurrence of each key in the batch; later duplicates are EXISTS.
            kv = np.ascontiguousarray(keys.keys, dtype="<u8").view("V16").ravel()
            _, first = np.unique(kv, return_index=True)
            first.sort()
            framed: dict[int, np.ndarray] = {}
            if self.slot_bytes < self.block_bytes:
                # Compact: frame the new blocks before claiming, so that one that cannot fit is refused
                # without a slot, or a victim evicted, for it.
                first, framed = self._frame_new(raw, rows, first, codes)
            owner, token = self._index.identity  # this process in the tier's owner registry
            claim_time = ix.now_us()

            def claim(txn):
                todo = []
                for i in first.tolist():
                    k = key_at(raw, i)
                    if txn.get(k, db=self._index.blocks) is not None:
                        continue
                    c = txn.get(k, db=self._index.inflight)
                    if c is not None:
                        slot, oowner, otoken, ctime = ix.CLAIM.unpack(c)
                        if self._claim_live(slot, oowner, otoken, ctime):
                            continue  # a live writer (maybe another handle of ours) is writing it
                        # Its writer died (or is this process's own failed put): the slot is free.
                        txn.delete(k, db=self._index.inflight)
                        txn.put(ix.slot_key(slot), b"", db=self._index.free)
                    todo.append(i)
                fresh_from = ix.get_u64(txn, self._index.info, ix.INFO_HWM)  # slots never used start here
                slots, victims = self._take_slots(txn, len(todo))
                with OWN_CLAIMS_LOCK:  # before the commit makes the claims visible
                    OWN_CLAIMS.update((int(s), claim_time) for s in slots)
                for i, s in zip(todo, slots):
                    txn.put(key_at(raw, i), ix.CLAIM.pack(s, owner, token, claim_time),
                            db=self._index.inflight)
                return todo, slots, victims, any(s < fresh_from for s in slots)

            todo, slots, victims, reused = self._index.write(claim)
            if reused and self.sync == "data":
                # MDB_NOMETASYNC leaves this commit's meta page to the next commit's fsync: a power loss
                # before it would bring back the records of the blocks whose slots are about to be
                # rewritten (victims, or blocks removed earlier), pointing at the new bytes.
                self._index.sync_meta()
            evicted = np.asarray([v[0] for v in victims], dtype=np.int64)
            with self._mem:
                self._counts["evictions"] += len(evicted)
                self._view.forget(evicted)
            codes[todo[len(slots):]] = PutResult.NO_SPACE
            if not slots:
                return codes
            idx = np.asarray(todo[:len(slots)], dtype=np.int64)
            slot_arr = np.asarray(slots, dtype=np.int64)
            parts = None
            try:
                if self.slot_bytes < self.block_bytes:  # compact: only frames that fit a slot are stored
                    idx, slot_arr, parts = self._fitting(raw, rows, idx, slot_arr, owner, token, codes, framed)
                if len(victims) and self.on_evict is not None:
                    # The victims' slots are claimed by this call and not rewritten yet: read them now.
                    if self.evict_payloads:
                        gone = np.empty((len(victims), self.block_bytes), dtype=np.uint8)
                        self.on_evict(self._evicted(victims, gone, *self._read_verified(victims, gone)))
                    else:
                        self.on_evict(self._evicted(victims, None, np.ones(len(victims), dtype=bool)))
                sums, lengths, touched = packed.write(self._slabs, self._packer, slot_arr, rows, idx, parts)
                if self.sync != "none":
                    self._slabs.sync(touched)  # data reaches the disk before the index points at it
                stored = self._commit(raw, keys, idx, slot_arr, sums, owner, token, lengths)
            except BaseException:
                self._release(raw, idx, slot_arr, owner, token)
                raise
            finally:
                with OWN_CLAIMS_LOCK:
                    OWN_CLAIMS.difference_update((int(s), claim_time) for s in slots)
            codes[idx[stored]] = PutResult.STORED
            n_stored = int(stored.sum())
            with self._mem:
                self._counts["puts"] += n_stored
                self._counts["bytes_in"] += n_stored * self.block_bytes
            return codes

    def _frame_new(self, raw: bytes, rows: np.ndarray, first: np.ndarray,
                   codes: np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """A compact tier's put, before the claim: frame the blocks not stored yet (read without a lock)
        and refuse those whose frame does not fit a slot (``NO_SPACE``, counted ``too_big``).

        Returns:
            ``(first, framed)``: the batch positions still to claim, and the frame of each new one.
        """
        db = self._index.blocks
        stored = self._index.read(lambda txn: [txn.get(key_at(raw, i), db=db) is not None for i in first.tolist()])
        new = first[~np.asarray(stored, dtype=bool)]
        framed = dict(zip(new.tolist(), packed.pack(self._packer, rows, new)))
        big = np.asarray([i for i, p in framed.items() if p.nbytes > self.slot_bytes], dtype=np.int64)
        self._refuse_too_big(codes, big)
        return np.setdiff1d(first, big, assume_unique=True), framed

    def _refuse_too_big(self, codes: np.ndarray, idx: np.ndarray) -> None:
        """Mark the batch positions ``idx`` refused (``NO_SPACE``: their frame is larger than a slot), counted."""
        if len(idx):
            codes[idx] = PutResult.NO_SPACE
            with self._mem:
                self._counts["too_big"] += len(idx)

    def _fitting(self, raw: bytes, rows: np.ndarray, idx: np.ndarray, slots: np.ndarray, owner: int,
                 token: int, codes: np.ndarray, framed: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray, list]:
        """A compact tier's put, after the claim: the frames of the claimed blocks (``framed``, or made
        now for a block that was stored when ``_frame_new`` looked and removed since); give back the
        claims of any that do not fit (``NO_SPACE``, ``too_big``; nothing of them is written).

        Returns:
            ``(idx, slots, parts)`` of the blocks that fit.
        """
        late = np.asarray([i for i in idx.tolist() if i not in framed], dtype=np.int64)
        framed.update(zip(late.tolist(), packed.pack(self._packer, rows, late)))
        parts = [framed[i] for i in idx.tolist()]
        fit = np.asarray([p.nbytes <= self.slot_bytes for p in parts], dtype=bool)
        if not fit.all():
            self._release(raw, idx[~fit], slots[~fit], owner, token)
            self._refuse_too_big(codes, idx[~fit])
        return idx[fit], slots[fit], [p for p, f in zip(parts, fit) if f]

    # ================================================================================== policy view
    def _note_hits(self, raw: bytes, gens: np.ndarray, slots: np.ndarray) -> None:
        """Record hits: in the view now (memory only), in the index in batches (no fsync per hit)."""
        with self._mem:
            due = self._view.note_hits(raw, gens, slots)
        if due:
            self._flush(wait_s=0)  # on the read path: never wait behind a writer

    def flush(self) -> None:
        """Write batched hit bookkeeping (last access, hit count) into the records. One transaction."""
        self._flush(wait_s=None)

    def _flush(self, *, wait_s: float | None) -> None:
        # Not under _lock: on the read path (wait_s=0) it must not wait for a put. The writer lock
        # (taken without waiting there) serialises it with other writes; _mem guards the view.
        with self._mem:
            if self._closed or not self._view.pending or os.getpid() != self._pid:
                return
            pending = self._view.take_pending()
        if self.readonly:
            return
        raw = b"".join(p[0] for p in pending)
        gens = np.concatenate([p[1] for p in pending])
        ticks = np.concatenate([p[3] for p in pending])
        keys = np.frombuffer(raw, dtype="V16")
        uniq, inverse = np.unique(keys, return_inverse=True)
        count = np.bincount(inverse, minlength=len(uniq))
        last = np.zeros(len(uniq), dtype=np.int64)
        np.maximum.at(last, inverse, ticks)
        gen_of = np.zeros(len(uniq), dtype=np.uint64)
        gen_of[inverse] = gens
        ubytes = uniq.tobytes()

        def write(txn):
            for j in range(len(uniq)):
                k = key_at(ubytes, j)
                v = txn.get(k, db=self._index.blocks)
                if v is None or len(v) != self._rec.itemsize:
                    continue
                rec = np.frombuffer(v, dtype=self._rec).copy()
                if int(rec["gen"][0]) != int(gen_of[j]):
                    continue  # replaced since: its hits belonged to the old block
                rec["hits"] += count[j]
                rec["last_access_us"] = max(int(rec["last_access_us"][0]), int(last[j]))
                txn.put(k, rec.tobytes(), db=self._index.blocks)

        try:
            self._index.write(write, wait_s=wait_s)
        except LockTimeout:
            if wait_s is not None:
                # A writer holds the lock now: keep the hits for the next try (bounded memory).
                with self._mem:
                    self._view.put_back(pending)
        except TieredKVError:
            pass  # bookkeeping only: losing it skews the policy a little, never the data

    # ================================================================================== removal
    def remove(self, keys: ChunkKeys) -> int:
        """Remove the given blocks if stored; return how many were removed."""
        with self._lock:
            self._check()
            raw = self._raw(keys)
            if not len(keys):
                return 0
            self._require_writable()

            def rm(txn):
                freed, gone = [], 0  # gone: damaged records dropped without a slot to free
                for i in range(len(keys)):
                    rec, owned = self._delete_record(txn, key_at(raw, i))
                    if owned:
                        txn.put(ix.slot_key(int(rec["slot"])), b"", db=self._index.free)
                        freed.append(int(rec["slot"]))
                    elif rec is not None:
                        gone += 1
                return freed, gone

            freed, gone = self._index.write(rm)
            with self._mem:
                self._view.forget(np.asarray(freed, dtype=np.int64))
            return len(freed) + gone

    def evict(self, n: int, *, with_payloads: bool = True) -> Evicted:
        """Evict up to ``n`` blocks chosen by the policy and hand them back.

        Args:
            n: how many blocks to evict.
            with_payloads: copy the evicted payloads out (verified against their checksums; a bad one
                is dropped and counted as corrupt) before their slots are freed.

        Returns:
            ``Evicted(keys, payloads, hits)``: ``keys`` carries each block's key, parent key, tokens
            and position; ``payloads`` is ``(m, block_bytes)`` uint8, or None without
            ``with_payloads``; ``hits`` counts each block's hits (the flushed ones and this
            process's pending ones).
        """
        with self._lock:
            self._check()
            n = check_count(n)
            self._require_writable()

            def ev(txn):
                victims = []
                if n > 0:
                    with self._mem:  # inside the write transaction: nothing is waited on
                        victims = self._view.choose_victims(txn, self._index, n, self._delete_record)
                m = len(victims)
                rows = np.empty((m, self.block_bytes), dtype=np.uint8) if with_payloads else None
                # The slots cannot be claimed by anyone before this transaction commits.
                keep, lacking = self._read_verified(victims, rows) if with_payloads else (
                    np.ones(m, dtype=bool), np.zeros(m, dtype=bool))
                for s, _, _ in victims:
                    txn.put(ix.slot_key(s), b"", db=self._index.free)
                return victims, rows, keep, lacking

            victims, rows, keep, lacking = self._index.write(ev)
            with self._mem:
                self._counts["evictions"] += len(victims)
            return self._evicted(victims, rows, keep, lacking)

    def _read_verified(self, victims: list, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read the victims' slots into ``rows``. Returns ``(keep, lacking)``, bool per victim: complete
        and its checksum holds; a sound frame in a codec this process cannot run (neither kept nor
        corrupt)."""
        keep = np.ones(len(victims), dtype=bool)
        lacking = np.zeros(len(victims), dtype=bool)
        if victims:
            slots = np.asarray([v[0] for v in victims], dtype=np.int64)
            recs = np.array([v[2] for v in victims], dtype=self._rec).reshape(len(victims))
            if (recs["length"] != self.block_bytes).any():  # some are compressed frames
                complete, sums, _, failed, lacking = packed.read(
                    self._slabs, slots, recs["length"], recs["checksum"], rows, keep, None,
                    self.spec.dtype_bytes, READ_GROUP_BYTES)
                return complete & (sums == recs["checksum"]) & ~failed & ~lacking, lacking
            complete = self._slabs.read(slots, rows)
            for j, (_, _, rec) in enumerate(victims):
                keep[j] = complete[j] and xxhash.xxh3_64_intdigest(rows[j]) == int(rec["checksum"])
        return keep, lacking

    def _evicted(self, victims: list, rows: np.ndarray | None, keep: np.ndarray,
                 lacking: np.ndarray | None = None) -> Evicted:
        """``Evicted`` of the victims whose bytes verified. The others are counted corrupt, except sound
        frames this process cannot decode (``undecodable``): their bytes cannot be handed on from here."""
        chunk = self.spec.chunk_tokens
        if lacking is None:
            lacking = np.zeros(len(keep), dtype=bool)
        with self._mem:
            self._counts["corrupt"] += int((~keep & ~lacking).sum())
            self._counts["undecodable"] += int(lacking.sum())
        kept = [v for v, k in zip(victims, keep) if k]
        m = len(kept)
        raw = b"".join(v[1] for v in kept)
        karr = np.frombuffer(raw, dtype="<u8").reshape(m, 2)
        recs = np.array([v[2] for v in kept], dtype=self._rec).reshape(m)
        keys = ChunkKeys(karr, recs["parent"].astype(np.uint64).reshape(m, 2),
                         recs["tokens"].astype(np.uint32).reshape(m, chunk), 0,
                         recs["position"].astype(np.int64))
        with self._mem:
            hits = recs["hits"].astype(np.int64) + self._view.pending_hits(raw, recs["gen"])
        payloads = rows[keep] if rows is not None else None
        return Evicted(keys, payloads, hits)

    # ================================================================================== stats, close
    def stats(self) -> TierStats:
        """Counters of this process since open; residency from the index (all processes)."""
        self._check()  # a read: never waits for a write

        def read(txn):
            return (txn.stat(self._index.blocks)["entries"], txn.stat(self._index.inflight)["entries"],
                    ix.get_u64(txn, self._index.info, ix.INFO_CORRUPT))

        used, inflight, corrupt_total = self._index.read(read)
        with self._mem:
            counts, pending_n = dict(self._counts), self._view.pending_n
        too_big, undecodable = counts.pop("too_big"), counts.pop("undecodable")
        return TierStats(name="warm", capacity_blocks=self.n_slots, used_blocks=int(used), **counts,
                         extra={"path": str(self.path), "sync": self.sync, "verify": self.verify,
                                "policy": self.policy.name, "readonly": self.readonly,
                                "inflight": int(inflight), "corrupt_total": int(corrupt_total),
                                "pending_hits": pending_n, "slot_bytes": self.slot_bytes,
                                "compress": self._packer.name if self._packer is not None else "none",
                                "compact": self.slot_bytes < self.block_bytes, "too_big": too_big,
                                "undecodable": undecodable,
                                "map_size": self._index.map_size()})

    def close(self) -> None:
        """Flush hit bookkeeping and release the index and files. Idempotent; deletes nothing."""
        with self._lock:
            if self._closed:
                return
            if os.getpid() != self._pid:
                # Forked child that never used the tier: drop the inherited environment copy and the
                # inherited slab descriptors (closing the child's copies cannot disturb the parent).
                self._index.close()
                self._slabs.close()
                self._closed = True
                return
            try:
                self.flush()
            finally:
                self._closed = True  # readers that come now are refused
                # Readers take no lock: let transactions under way end before the environment goes.
                quiet = self._index.quiesce(self.lock_timeout_s + 5.0)
                try:
                    self._index.close()
                    self._slabs.close()
                finally:
                    self._scratch = Scratch()  # every thread's read buffer goes with the old one
                    self._halves.close()
                    if quiet:
                        self._index.resume()

    def __del__(self):
        try:
            if not self._closed and os.getpid() == self._pid:
                self.close()
        except Exception:
            pass

    @property
    def corrupt_seen(self) -> int:
        """Corrupt blocks this handle found and dropped (cheap: no index read, unlike ``stats``)."""
        return int(self._counts["corrupt"])

    def __repr__(self) -> str:
        return f"WarmTier({str(self.path)!r}, slots={getattr(self, 'n_slots', '?')}, sync={self.sync!r})"
