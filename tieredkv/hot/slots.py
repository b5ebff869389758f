"""The slot table of a hot segment, and the bookkeeping every state change of a slot goes through.

A slot is FREE, WRITING (claimed by one owner's call; generation odd) or READY (published; generation
even). The slot table is the truth; the index, the free stack and the policy's residency are derived
from it and kept in step here, always under the segment lock (hot/recovery.py). A generation only
ever moves forward, so a lock-free reader that saw one value and sees another knows the slot changed.

``SlotTable`` declares the state a hot-tier handle keeps (hot/handle.py fills it in when it attaches).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tieredkv import policies
from tieredkv.hot import batch
from tieredkv.hot.damage import POLICY_FAULTS, Damage
from tieredkv.hot.index import HotIndex
from tieredkv.hot.segment import FREE, STAT_FIELDS
from tieredkv.keys import ChunkKeys
from tieredkv.spec import KVSpec

#: Column of each counter in an owner row's ``stats``.
STAT = {name: i for i, name in enumerate(STAT_FIELDS)}


class SlotTable:
    """A handle's views of one segment's slot table and what is derived from it."""

    spec: KVSpec
    name: str
    n_slots: int
    _h: Any  # the segment header (one record of segment.HEADER_DTYPE)
    _owners: np.ndarray  # owner registry: token, pid, pin list and counters of each open handle
    _slots: np.ndarray  # the slot table: state, generation, key, parent, owner of each slot
    _words: np.ndarray  # the same records as rows of uint64 words (hot/batch.py)
    _pin_lists: np.ndarray  # every owner row's pin list, ``(MAX_OWNERS, MAX_PINS)``
    _n_pins: np.ndarray  # every owner row's pin count
    _tokens: np.ndarray  # each slot's chunk tokens (confirm a hash match)
    _free: np.ndarray  # the free stack; ``_h["free_top"]`` entries are live
    _data: np.ndarray  # the blocks, one row per slot
    _index: HotIndex  # key -> slot, lock-free to read
    _policy: Any  # the eviction policy (policies.EvictionPolicy)
    _state: policies.SlotState  # the policy's per-slot state, in the segment
    _stats: np.ndarray  # this handle's row of STAT_FIELDS counters
    _owner: int  # this handle's row in the owner registry (-1: not registered)
    _token: int  # this handle's token in that row (tells it from a dead predecessor's)
    _retrying: bool  # a block call runs again after a repair (see damage.survives_damage)

    # ---- lookups (lock-free) ---------------------------------------------------------------------
    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot holding each key (WRITING or READY) or -1. Lock-free; the answer is a hint that
        callers confirm against the slot (its key, state and generation)."""
        return self._index.find(keys)

    def _confirmed(self, keys: ChunkKeys, found: np.ndarray) -> np.ndarray:
        """Bool per key: slot ``found`` (from ``_find``: it held the key) holds it READY with the same
        parent and chunk tokens."""
        return batch.check(self._words, self._tokens, found, keys)[1]

    def _held(self, keys: ChunkKeys) -> np.ndarray:
        """Bool per key: a slot holds it READY with the same parent and chunk tokens (``_find`` and
        ``_confirmed`` in one pass over the batch). Lock-free."""
        return batch.confirmed(self._index, self._words, self._tokens, keys)[2]

    def _indexed_slots(self) -> np.ndarray:
        """Slots the index must hold: READY or WRITING with a key. Victims detached from their old
        key (zeroed, see ``_choose_victims``) and FREE slots are not indexed."""
        rec = self._slots
        return np.flatnonzero((rec["state"] != FREE) & (rec["key"] != 0).any(axis=1))

    # ---- slot bookkeeping (under the lock) -------------------------------------------------------
    def _free_slots(self, slots: np.ndarray) -> None:
        """WRITING/READY slots -> FREE, out of the index and the policy, onto the free stack."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        rec = self._slots
        try:
            policies.remove(self._policy, self._state, slots)
        except POLICY_FAULTS as e:
            raise Damage(f"policy state: {e}") from e
        gen = rec["gen"][slots]
        rec["gen"][slots] = gen + 1 + (gen + 1) % 2  # next even value, always a change
        rec["state"][slots] = FREE
        self._index.remove(slots, rec["key"][slots])
        self._push_free(slots)

    def _push_free(self, slots: np.ndarray) -> None:
        """Push FREE slots onto the stack, highest first, so that they pop lowest first: a batch
        freed together is taken again as one ascending run of adjacent slots. Under the lock."""
        top = int(self._h["free_top"])
        if top + len(slots) > self.n_slots:
            raise Damage(f"free stack holds {top} entries, {len(slots)} more would pass its {self.n_slots}")
        self._free[top:top + len(slots)] = np.sort(slots)[::-1]
        self._h["free_top"] = top + len(slots)

    def _take_free(self, n: int) -> np.ndarray:
        top = int(self._h["free_top"])
        if top > self.n_slots:
            raise Damage(f"free stack top {top} is past its {self.n_slots} entries")
        k = min(n, top)
        got = self._free[top - k:top][::-1].copy()
        # Every entry must name a FREE slot, once: handing out a READY slot would overwrite a block.
        if k and ((got < 0).any() or (got >= self.n_slots).any() or not _distinct(got)
                  or (self._slots["state"][got] != FREE).any()):
            raise Damage("the free stack names a slot that is not free")
        self._h["free_top"] = top - k
        return got

    def _release_spare(self, spare: np.ndarray) -> None:
        """Claimed (WRITING by us, out of the index and policy) slots -> FREE. Under the lock."""
        if not len(spare):
            return
        rec = self._slots
        gen = rec["gen"][spare]
        rec["gen"][spare] = gen + 1 + (gen + 1) % 2
        rec["state"][spare] = FREE
        self._push_free(spare)

    def _claim(self, slots: np.ndarray, claim: int) -> None:
        """Slots -> WRITING by this handle, for the call whose id is ``claim``. Under the lock."""
        batch.claim(self._words, slots, claim, self._owner, self._token)


def _distinct(values: np.ndarray) -> bool:
    """Whether no value of ``values`` (1-D) appears twice."""
    ordered = np.sort(values)
    return bool((ordered[1:] != ordered[:-1]).all())
