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
    preadv each slot into the caller's rows
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
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash
from numpy.random import default_rng  # at import: imported lazily, numpy.random would slow the first open

from tieredkv import codec, forksafe, policies
from tieredkv.errors import CorruptState, FormatError, InvalidInput, LockTimeout, TieredKVError, WarmTierUnavailable
from tieredkv.keys import KEY_BYTES, ChunkKeys, key_at
from tieredkv.layout import as_block_bytes
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier, TierStats, check_count, check_keys, out_rows
from tieredkv.warm import files, packed
from tieredkv.warm import index as ix
from tieredkv.warm import meta as mt
from tieredkv.warm.view import PolicyView

#: Claims this process holds right now, as (slot, claim time): a claim in the index that names this
#: process is live only if it is here. Several WarmTier handles in one process share the LMDB
#: environment and the owner registration, so without this one handle would reap (and reuse the slot
#: of) a claim another handle is still writing.
_OWN_CLAIMS: set[tuple[int, int]] = set()
_OWN_CLAIMS_LOCK = threading.Lock()
forksafe.register_function(lambda: forksafe.renew(_OWN_CLAIMS_LOCK))


def _work(rows: np.ndarray, which: np.ndarray, sink, b: int, e: int) -> list[int]:
    """Checksum ``rows[which]`` and hand ``rows[b:e]`` to ``sink``; returns the digests."""
    sums = [xxhash.xxh3_64_intdigest(rows[i]) for i in which.tolist()]
    if sink is not None:
        sink(b, rows[b:e])
    return sums


#: A read is split into groups of about this size (at least one block), each read, checksummed and handed
#: to the caller's sink before the next one is read, all on the caller's thread: the group is still in
#: the CPU's L2 cache when it is hashed and copied out, so a verified read touches main memory about as
#: often as a plain read (one pass) instead of three (read, hash, copy). A helper thread hashing one
#: 32 MiB group while the next was read gave no overlap on 2 cores and hashed out of DRAM (3.9x the
#: time of hashing in L2, docs/benchmarks.md).
READ_GROUP_BYTES = 1 << 20

SYNC_MODES = ("none", "data", "full")
VERIFY_MODES = ("always", "sampled", "never")
DEFAULT_SLAB_BYTES = 1 << 30

class WarmTier(Tier):
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
            "zstd"): fewer bytes to and from the disk, the same capacity (tieredkv.warm.packed). Pays
            when the disk is slower than the codec (docs/warm-tier.md). Reads decode every block
            whatever this says; a block in a codec not installed here is a miss.

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
                 on_evict: Callable[[Evicted], None] | None = None, compress: str | bool | None = None):
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
        self._map_size = map_size_bytes
        self._map_max = map_max_bytes
        self._reset_process_state()
        self._open(capacity_bytes, slab_bytes)
        self._closed = False

    # ================================================================================== opening
    def _reset_process_state(self) -> None:
        """Counters, pending hit bookkeeping and the policy view: all private to one process."""
        self._pid = os.getpid()
        self._counts = dict(hits=0, misses=0, bytes_in=0, bytes_out=0, puts=0, evictions=0, corrupt=0,
                            recoveries=0)
        # The policy state of this process and the hits it has not written yet (warm/view.py).
        self._view = PolicyView(self.policy, getattr(self, "n_slots", 0), getattr(self, "_rec", None),
                                self.flush_every)

    def _open(self, capacity_bytes: int | None, slab_bytes: int) -> None:
        path = str(self.path)
        if not self.readonly:
            files.make_dir(self.root, self.path)
        files.check_access(path)  # also: the directory exists, is ours, is no symlink; modes 0700/0600
        with files.init_lock(path, self.lock_timeout_s):
            self._open_locked(path, capacity_bytes, slab_bytes)

    def _open_locked(self, path: str, capacity_bytes: int | None, slab_bytes: int) -> None:
        index_path = os.path.join(path, mt.INDEX_NAME)
        try:
            meta = mt.read_meta(path)
        except FileNotFoundError:
            if os.path.exists(index_path):
                raise FormatError(f"{path}/{mt.META_NAME} is missing but the index exists; run "
                                  f"`tieredkv verify --repair {path}` to restore it") from None
            if self.readonly:
                raise WarmTierUnavailable(f"no warm tier at {path} (opened read-only, nothing to create)") from None
            meta = files.create(path, self.spec, capacity_bytes, slab_bytes, self._map_size, self._map_max)
        mt.check_spec(meta, self.spec, path)
        if capacity_bytes is not None and capacity_bytes // meta["slot_bytes"] != meta["n_slots"]:
            warnings.warn(f"warm tier {path} keeps its capacity of {meta['n_slots']} slots "
                          f"({meta['capacity_bytes']} bytes); capacity_bytes={capacity_bytes} is only "
                          f"used to create a tier", stacklevel=4)
        self.meta = meta
        self.n_slots = int(meta["n_slots"])
        self.slot_bytes = int(meta["slot_bytes"])
        self.block_bytes = self.spec.block_bytes
        self._rec = ix.record_dtype(self.spec.chunk_tokens)
        self._view.n_slots, self._view.rec = self.n_slots, self._rec
        self._slabs = files.slabs_of(path, meta, readonly=self.readonly)
        if not self.readonly:
            os.makedirs(os.path.join(path, mt.INDEX_NAME), mode=0o700, exist_ok=True)
        self._open_index()
        if not self.readonly:
            n_slots, n_blocks = self._index.read(lambda txn: (
                ix.get_u64(txn, self._index.info, ix.INFO_N_SLOTS), txn.stat(self._index.blocks)["entries"]))
            if n_slots == 0 and n_blocks == 0:
                # The index was deleted or emptied (meta.json, written last at creation, says the tier
                # was complete). Its records are gone, so every slot is free: start an empty index
                # from meta.json rather than refuse to open forever.
                self._index.write(lambda txn: ix.init_info(txn, self._index, meta["n_slots"], mt.encode_meta(meta)))
                self._counts["recoveries"] += 1
                warnings.warn(f"warm tier {path}: the index was missing or empty; rebuilt an empty one "
                              f"from {mt.META_NAME} (the blocks it indexed are lost; the slabs are kept)",
                              stacklevel=5)
                n_slots = self.n_slots
            if n_slots != self.n_slots:
                raise CorruptState(f"{path}: the index says {n_slots} slots, meta.json says "
                                   f"{self.n_slots}; run `tieredkv verify {path}`")
            try:
                self._repair_slabs()
                self._slabs.open()
            except PermissionError:
                self.readonly = True  # files we may not write: serve reads
                self._slabs.readonly = True
                self._index.close()
                self._open_index()
        if self.readonly:
            self._slabs.open()
        else:
            self._reap_claims(only_if_any=True)

    def _index_sizes(self) -> tuple[int, int]:
        return files.index_sizes(self.n_slots, self._rec.itemsize, self._map_size, self._map_max)

    def _open_index(self) -> None:
        size, limit = self._index_sizes()
        try:
            self._index = ix.Index(os.path.join(str(self.path), mt.INDEX_NAME), sync=self.sync,
                                   map_size=size, map_max=limit, readonly=self.readonly,
                                   lock_timeout_s=self.lock_timeout_s)
        except (lmdb.Error, WarmTierUnavailable) as exc:  # the latter: the owner registry
            if self.readonly or not ix._is_permission(exc):
                raise WarmTierUnavailable(f"cannot open the warm tier index in {self.path}: {exc}") from exc
            self.readonly = True
            self._slabs.readonly = True
            self._index = ix.Index(os.path.join(str(self.path), mt.INDEX_NAME), sync=self.sync,
                                   map_size=size, map_max=limit, readonly=True,
                                   lock_timeout_s=self.lock_timeout_s)
        self._index.reader_check()

    def _repair_slabs(self) -> None:
        """Missing or truncated slabs: drop the blocks whose bytes are gone, restore the files."""
        damaged, dropped = files.repair_slabs(self._index, self._slabs)
        if damaged:
            self._counts["corrupt"] += dropped
            self._counts["recoveries"] += len(damaged)
            files.warn_repaired(str(self.path), damaged, dropped, stacklevel=6)

    # ================================================================================== guards
    def _check(self) -> None:
        if self._closed:
            raise InvalidInput(f"this WarmTier ({self.path}) is closed; open a new one")
        if os.getpid() != self._pid:
            with self._lock, self._mem:  # first call in a forked child: one thread reopens
                if os.getpid() != self._pid:
                    self._after_fork()

    # ---- fork (tieredkv.forksafe): no LMDB transaction may be open on another thread at fork, or the
    # child can neither close the inherited environment (py-lmdb waits for that thread for ever) nor
    # open its own (py-lmdb refuses a second one). Every transaction (read or write) of the process
    # enters the index's gate, so the parent closes the gate just before fork: fork waits for the
    # transactions under way (short; bounded), not for a whole put (its lock wait, its data copy).
    _fork_quiet = True

    def _before_fork(self) -> None:
        self._fork_quiet = self._index.quiesce(self.lock_timeout_s + 5.0)

    def _after_fork_in_parent(self) -> None:
        if self._fork_quiet:
            self._index.resume()

    def _after_fork(self) -> None:
        # LMDB: never use an environment opened by the parent. Drop the inherited copy (see
        # Index.close), open our own, and start with empty per-process state. Slab descriptors are
        # plain fds: inherited ones work for pread/pwrite as they are.
        if not self._fork_quiet:
            # Forked while a transaction of the parent's could not end in time: the inherited
            # environment cannot be closed in this child, so this handle serves nothing here.
            self._closed = True
            raise WarmTierUnavailable(f"{self.path}: this process was forked while a warm write held the "
                                      f"index for over {self.lock_timeout_s + 5.0:.0f} s; open a new WarmTier")
        self._index.close()
        self._reset_process_state()
        self._open_index()

    def _require_writable(self) -> None:
        if self.readonly:
            raise WarmTierUnavailable(f"the warm tier {self.path} is open read-only (read-only files or "
                                      f"readonly=True); reads still work")

    # ================================================================================== lookups
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
            found[:m] = (packed.servable(recs["length"], self.block_bytes) & (recs["slot"] < self.n_slots)
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
        bad = ((recs["slot"][:m] >= self.n_slots) & packed.valid_length(recs["length"][:m], self.block_bytes)
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

    def _raw(self, keys: ChunkKeys) -> bytes:
        """The keys as LMDB key bytes, 16 per key, after checking them against the spec."""
        check_keys(self.spec, keys)
        return np.ascontiguousarray(keys.keys, dtype="<u8").tobytes()

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
        # No lock: the copy is made safe by the re-check after it (module docstring), not by
        # excluding writers, so a read never waits for a write (see __init__).
        self._check()
        n = len(keys)
        raw = self._raw(keys)
        rows = out_rows(self.spec, out, n)
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
            run = self._copy_checked(raw, keys, recs[:run], rows, sink)
        with self._mem:
            self._counts["hits"] += run
            self._counts["misses"] += n - run
            self._counts["bytes_out"] += run * self.block_bytes
        if run:
            self._note_hits(raw[:run * KEY_BYTES], recs["gen"][:run], recs["slot"][:run])
        return run

    def _copy_checked(self, raw: bytes, keys: ChunkKeys, recs: np.ndarray, rows: np.ndarray, sink=None) -> int:
        """Copy ``recs``' slots into ``rows``, re-check and verify; return the good leading run."""
        run = len(recs)
        slots = recs["slot"].astype(np.int64)
        check = np.full(run, self.verify != "never")
        if self.verify == "sampled":
            with self._mem:  # a Generator is not thread-safe
                check &= self._rng.random(run) < self.sample_rate
        failed = lacking = np.zeros(run, dtype=bool)
        if (recs["length"] == self.block_bytes).all():
            complete, sums = self._read_hashing(slots, rows, check, sink)
        else:  # some blocks are stored compressed: always checked, then decompressed
            complete, sums, check, failed, lacking = packed.read(
                self._slabs, slots, recs["length"], recs["checksum"], rows, check, sink, self.spec.dtype_bytes,
                READ_GROUP_BYTES)
        # Re-check after the copy (see the module docstring): same slot and gen <=> bytes were stable.
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
        if bad.any():
            self._drop_corrupt(raw, recs, np.flatnonzero(bad))
        return good

    def _read_hashing(self, slots: np.ndarray, rows: np.ndarray, check: np.ndarray,
                      sink=None) -> tuple[np.ndarray, np.ndarray]:
        """Read ``slots`` into ``rows`` and checksum the ``check`` rows, one group of about
        ``READ_GROUP_BYTES`` at a time: each group is hashed and handed to ``sink`` right after it is
        read, while it is still in the CPU cache.

        Returns:
            ``(complete, sums)``: blocks read in full, and the xxh3_64 of each checked row (0 elsewhere).
        """
        n = len(slots)
        sums = np.zeros(n, dtype=np.uint64)
        per_group = max(1, READ_GROUP_BYTES // self.block_bytes)
        if n <= per_group or not (check.any() or sink is not None):
            complete = self._slabs.read(slots, rows)
            which = np.flatnonzero(check & complete)
            sums[which] = _work(rows, which, sink, 0, n)
            return complete, sums
        complete = np.zeros(n, dtype=bool)
        self._slabs.prefetch(slots)  # cold data: the disk reads ahead of the groups, as for one read
        for b in range(0, n, per_group):
            e = min(n, b + per_group)
            complete[b:e] = self._slabs.read(slots[b:e], rows[b:e])
            todo = np.flatnonzero(check[b:e] & complete[b:e]) + b
            sums[todo] = _work(rows, todo, sink, b, e)
        return complete, sums

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

    def _delete_record(self, txn, key: bytes, *,
                       expect_gen: int | None = None) -> tuple[np.ndarray | None, bool]:
        """Delete ``key``'s record (and its reverse entry, not freeing the slot).

        Returns:
            ``(record, owned)``: the deleted record (None: absent, or not of ``expect_gen``), and
            whether its slot was really its own (in range, the reverse entry names ``key``). A record
            whose slot field was damaged is deleted but frees nothing: it cannot say which slot is its.
        """
        v = txn.get(key, db=self._index.blocks)
        if v is None or len(v) != self._rec.itemsize:
            return None, False
        rec = np.frombuffer(v, dtype=self._rec)[0]
        if expect_gen is not None and int(rec["gen"]) != expect_gen:
            return None, False
        txn.delete(key, db=self._index.blocks)
        slot = int(rec["slot"])
        if slot >= self.n_slots or txn.get(ix.slot_key(slot), db=self._index.slots) != key:
            return rec, False
        txn.delete(ix.slot_key(slot), db=self._index.slots)
        return rec, True

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
                slots, victims = self._take_slots(txn, len(todo))
                with _OWN_CLAIMS_LOCK:  # before the commit makes the claims visible
                    _OWN_CLAIMS.update((int(s), claim_time) for s in slots)
                for i, s in zip(todo, slots):
                    txn.put(key_at(raw, i), ix.CLAIM.pack(s, owner, token, claim_time),
                            db=self._index.inflight)
                return todo, slots, victims

            todo, slots, victims = self._index.write(claim)
            evicted = np.asarray([v[0] for v in victims], dtype=np.int64)
            with self._mem:
                self._counts["evictions"] += len(evicted)
                self._view.forget(evicted)
            codes[todo[len(slots):]] = PutResult.NO_SPACE
            if not slots:
                return codes
            idx = np.asarray(todo[:len(slots)], dtype=np.int64)
            slot_arr = np.asarray(slots, dtype=np.int64)
            try:
                if len(victims) and self.on_evict is not None:
                    # The victims' slots are claimed by this call and not rewritten yet: read them now.
                    if self.evict_payloads:
                        gone = np.empty((len(victims), self.block_bytes), dtype=np.uint8)
                        self.on_evict(self._evicted(victims, gone, self._read_verified(victims, gone)))
                    else:
                        self.on_evict(self._evicted(victims, None, np.ones(len(victims), dtype=bool)))
                sums, lengths, touched = packed.write(self._slabs, self._packer, slot_arr, rows, idx)
                if self.sync != "none":
                    self._slabs.sync(touched)  # data reaches the disk before the index points at it
                stored = self._commit(raw, keys, idx, slot_arr, sums, owner, token, lengths)
            except BaseException:
                self._release(raw, idx, slot_arr, owner, token)
                raise
            finally:
                with _OWN_CLAIMS_LOCK:
                    _OWN_CLAIMS.difference_update((int(s), claim_time) for s in slots)
            codes[idx[stored]] = PutResult.STORED
            n_stored = int(stored.sum())
            with self._mem:
                self._counts["puts"] += n_stored
                self._counts["bytes_in"] += n_stored * self.block_bytes
            return codes

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

    # ================================================================================== claims
    def _claim_live(self, slot: int, owner: int, token: int, claim_time: int) -> bool:
        """Whether the writer of a claim still runs: our own claims from ``_OWN_CLAIMS``, others' from
        the owner registry's locks (valid across PID namespaces, immune to pid reuse)."""
        if (owner, token) == self._index.identity:
            with _OWN_CLAIMS_LOCK:
                return (slot, claim_time) in _OWN_CLAIMS
        return self._index.claim_alive(owner, token)

    def _reap_claims_in(self, txn) -> int:
        """Free the slots of claims whose writer is dead (or this process's own, between calls)."""
        dead = []
        for k, c in txn.cursor(db=self._index.inflight):
            slot, owner, token, ctime = ix.CLAIM.unpack(c)
            if not self._claim_live(slot, owner, token, ctime):
                dead.append((k, slot))
        for k, slot in dead:
            txn.delete(k, db=self._index.inflight)
            txn.put(ix.slot_key(slot), b"", db=self._index.free)
        return len(dead)

    def _reap_claims(self, *, only_if_any: bool = False) -> int:
        if only_if_any:
            n = self._index.read(lambda txn: txn.stat(self._index.inflight)["entries"])
            if not n:
                return 0
        reaped = self._index.write(self._reap_claims_in)
        with self._mem:
            self._counts["recoveries"] += reaped
        return reaped

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
                keep = self._read_verified(victims, rows) if with_payloads else np.ones(m, dtype=bool)
                for s, _, _ in victims:
                    txn.put(ix.slot_key(s), b"", db=self._index.free)
                return victims, rows, keep

            victims, rows, keep = self._index.write(ev)
            with self._mem:
                self._counts["evictions"] += len(victims)
            return self._evicted(victims, rows, keep)

    def _read_verified(self, victims: list, rows: np.ndarray) -> np.ndarray:
        """Read the victims' slots into ``rows``; bool per victim: complete and its checksum holds."""
        keep = np.ones(len(victims), dtype=bool)
        if victims:
            slots = np.asarray([v[0] for v in victims], dtype=np.int64)
            recs = np.array([v[2] for v in victims], dtype=self._rec).reshape(len(victims))
            if (recs["length"] != self.block_bytes).any():
                complete, sums, _, failed, lacking = packed.read(
                    self._slabs, slots, recs["length"], recs["checksum"], rows, keep, None,
                    self.spec.dtype_bytes, READ_GROUP_BYTES)
                return complete & (sums == recs["checksum"]) & ~failed & ~lacking
            complete = self._slabs.read(slots, rows)
            for j, (_, _, rec) in enumerate(victims):
                keep[j] = complete[j] and xxhash.xxh3_64_intdigest(rows[j]) == int(rec["checksum"])
        return keep

    def _evicted(self, victims: list, rows: np.ndarray | None, keep: np.ndarray) -> Evicted:
        """``Evicted`` of the victims whose bytes verified (the others are counted corrupt)."""
        chunk = self.spec.chunk_tokens
        with self._mem:
            self._counts["corrupt"] += int((~keep).sum())
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
        return TierStats(name="warm", capacity_blocks=self.n_slots, used_blocks=int(used), **counts,
                         extra={"path": str(self.path), "sync": self.sync, "verify": self.verify,
                                "policy": self.policy.name, "readonly": self.readonly,
                                "inflight": int(inflight), "corrupt_total": int(corrupt_total),
                                "pending_hits": pending_n, "slot_bytes": self.slot_bytes,
                                "compress": self._packer.name if self._packer is not None else "none",
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
