"""The state of a WarmTier handle, and the record operations both its read and its write path use.

A block's record in the index's ``blocks`` table is keyed by its 16-byte key and holds its slot,
generation, checksum, parent key, tokens and policy fields (``warm/index.py``, ``record_dtype``);
the ``slots`` table maps each used slot back to its key. ``Records`` declares what a handle keeps
(``warm/recovery.py`` fills it in when the tier opens) and turns keys into record keys and back out.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from tieredkv.errors import WarmTierUnavailable
from tieredkv.keys import ChunkKeys
from tieredkv.spec import KVSpec
from tieredkv.tier import check_keys
from tieredkv.warm import index as ix
from tieredkv.warm.slabs import Slabs
from tieredkv.warm.view import PolicyView


class Records:
    """What a ``WarmTier`` handle holds, and the record operations shared by its paths."""

    spec: KVSpec
    root: Path  # the warm tier root directory
    path: Path  # <directory>/<spec.namespace>
    sync: str  # one of SYNC_MODES
    verify: str  # one of VERIFY_MODES
    sample_rate: float  # share of blocks checksummed with verify="sampled"
    readonly: bool
    lock_timeout_s: float
    policy: Any  # the eviction policy (policies.EvictionPolicy)
    flush_every: int  # write batched hits after this many
    n_slots: int
    slot_bytes: int  # below block_bytes in a compact tier (every block a compressed frame)
    block_bytes: int
    meta: dict  # meta.json
    _rec: np.dtype  # the record layout (ix.record_dtype)
    _index: ix.Index
    _slabs: Slabs
    _packer: Any  # warm.packed.Packer framing blocks on write, or None (blocks written raw)
    _slot_fraction: float  # slot size / block size for a tier created by this handle (< 1: compact)
    _view: PolicyView  # this process's policy state and its unwritten hits
    _counts: dict[str, int]  # this process's counters since open
    _rng: np.random.Generator  # sampling for verify="sampled"
    _scratch: Any  # warm.reads.Scratch: each reading thread's buffer for read_through's groups
    _halves: Any  # tieredkv.halves.Halves: the second thread of a split read_through
    _lock: threading.RLock  # serialises this handle's writers (see WarmTier.__init__)
    _mem: threading.RLock  # guards the in-memory state above; held for memory work only
    _pid: int  # the process the index environment belongs to
    _closed: bool
    _map_size: int | None
    _map_max: int | None

    def _raw(self, keys: ChunkKeys) -> bytes:
        """The keys as LMDB key bytes, 16 per key, after checking them against the spec."""
        check_keys(self.spec, keys)
        return np.ascontiguousarray(keys.keys, dtype="<u8").tobytes()

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

    def _require_writable(self) -> None:
        if self.readonly:
            raise WarmTierUnavailable(f"the warm tier {self.path} is open read-only (read-only files or "
                                      f"readonly=True); reads still work")
