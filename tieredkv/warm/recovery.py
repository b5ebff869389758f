"""Opening a warm tier and cleaning up after the dead: repair at open, a fork's own environment,
reaping the claims of writers that died.

Opening checks the directory and its files, creates a missing tier, rebuilds an emptied index from
``meta.json``, restores missing or truncated slabs (dropping the blocks whose bytes are gone) and
falls back to reading only where the files may not be written. A claim (step 1 of a put, warm/tier.py)
names its writer in the tier's owner registry (warm/owners.py); a claim whose writer is dead is reaped,
its slot freed, by the next writer short of space, by a put of the same key, and at open.
"""

from __future__ import annotations

import os
import threading
import warnings

import lmdb

from tieredkv import codec, forksafe
from tieredkv.errors import CorruptState, FormatError, InvalidInput, MissingDependency, WarmTierUnavailable
from tieredkv.warm import files, packed
from tieredkv.warm import index as ix
from tieredkv.warm import meta as mt
from tieredkv.warm.records import Records
from tieredkv.warm.view import PolicyView

#: Claims this process holds right now, as (slot, claim time): a claim in the index that names this
#: process is live only if it is here. Several WarmTier handles in one process share the LMDB
#: environment and the owner registration, so without this one handle would reap (and reuse the slot
#: of) a claim another handle is still writing.
OWN_CLAIMS: set[tuple[int, int]] = set()
OWN_CLAIMS_LOCK = threading.Lock()
forksafe.register_function(lambda: forksafe.renew(OWN_CLAIMS_LOCK))


class Recovery(Records):
    """Open (repairing what a crash left), reopen after a fork, reap dead writers' claims."""

    # ================================================================================== opening
    def _reset_process_state(self) -> None:
        """Counters, pending hit bookkeeping and the policy view: all private to one process."""
        self._pid = os.getpid()
        self._counts = dict(hits=0, misses=0, bytes_in=0, bytes_out=0, puts=0, evictions=0, corrupt=0,
                            recoveries=0, too_big=0, undecodable=0)
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
            meta = files.create(path, self.spec, capacity_bytes, slab_bytes, self._map_size, self._map_max,
                                self._slot_fraction)
        mt.check_spec(meta, self.spec, path)
        if capacity_bytes is not None and capacity_bytes // meta["slot_bytes"] != meta["n_slots"]:
            warnings.warn(f"warm tier {path} keeps its capacity of {meta['n_slots']} slots "
                          f"({meta['capacity_bytes']} bytes); capacity_bytes={capacity_bytes} is only "
                          f"used to create a tier", stacklevel=4)
        if self._slot_fraction < 1 and files.slot_bytes_of(self.spec, self._slot_fraction) != meta["slot_bytes"]:
            warnings.warn(f"warm tier {path} keeps its slots of {meta['slot_bytes']} bytes; slot_fraction="
                          f"{self._slot_fraction} is only used to create a tier", stacklevel=4)
        if mt.is_compact(meta) and self._packer is None and not self.readonly:
            # Every block of a compact tier is a frame: it is written compressed whatever was asked.
            try:
                self._packer = packed.Packer(codec.DEFAULT, self.spec.block_bytes, self.spec.dtype_bytes)
            except MissingDependency as e:
                # Still open it: its frames are misses here, and every put is refused (no block fits a
                # slot uncompressed, counted ``too_big``), but the process that shares it starts.
                warnings.warn(f"warm tier {path} is compact (every block compressed) and this process "
                              f"cannot compress: it reads nothing and stores nothing here ({e})", stacklevel=4)
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
            if self.readonly or not ix.refuses_writes(exc):
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

    # ================================================================================== claims
    def _claim_live(self, slot: int, owner: int, token: int, claim_time: int) -> bool:
        """Whether the writer of a claim still runs: our own claims from ``OWN_CLAIMS``, others' from
        the owner registry's locks (valid across PID namespaces, immune to pid reuse)."""
        if (owner, token) == self._index.identity:
            with OWN_CLAIMS_LOCK:
                return (slot, claim_time) in OWN_CLAIMS
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

