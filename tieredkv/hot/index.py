"""The hot tier's hash index: key -> slot, over the segment's index region.

A ``ProbeTable`` (``tieredkv.hashtable``) keyed by the low 64 bits of each block's key, its value the
slot; the slot table holds the full 128-bit key, and a lookup checks it there, so keys whose low
words collide are told apart::

    index region | key words: T x int64 | refs: T x int64 (slot + 1, 0 = empty) |     T >= 4 x n_slots

Writers (insert, remove, rebuild) hold the segment's metadata lock. Lookups take no lock: their answer
is a hint that the tier confirms against the slot (state, generation, key, parent, tokens), so a
lookup racing with a writer may miss, but never hands out a wrong block.
"""

from __future__ import annotations

import numpy as np

from tieredkv.errors import CorruptState
from tieredkv.hashtable import ProbeTable


def index_slots_for(n_slots: int) -> int:
    """Table size for ``n_slots`` slots: a power of two >= 4 x n_slots (>= 16).

    Load factor <= 1/4 and backward-shift deletion keep probe runs short, and a batch lookup is as
    slow as its longest run.
    """
    return 1 << max(4, (4 * n_slots - 1).bit_length())


class HotIndex:
    """Key -> slot over ``region`` (``(2, T)`` int64: key words, then refs) and the slot keys.

    Args:
        region: the segment's index region viewed as ``(2, T)`` int64.
        slot_keys: the slot table's ``key`` column, ``(n_slots, 2)`` uint64.
        name: the segment's name, for error messages.
    """

    def __init__(self, region: np.ndarray, slot_keys: np.ndarray, name: str = "?"):
        self.table = ProbeTable(region[0], region[1])
        self.slot_keys = slot_keys
        self.name = name
        #: Set when a lookup met an entry naming no slot (a damaged word): the answer was a miss,
        #: and the tier rebuilds the index from the slot table (``rebuild`` clears it).
        self.damaged = False

    def clear(self) -> None:
        self.table.clear()

    def hint(self, keys: np.ndarray) -> np.ndarray:
        """Slot indexed under the first word of each ``(n, 2)`` uint64 key, or -1, unchecked: the
        slot may hold another key sharing that word (the caller compares whole records, see
        hot/batch.py). Lock-free."""
        slots = self.table.lookup(np.asarray(keys, dtype=np.uint64).reshape(-1, 2)[:, 0].view(np.int64))
        wild = slots >= len(self.slot_keys)  # lookup never returns below -1; past the slot table is damage
        if wild.any():
            self.damaged = True
            slots[wild] = -1
        return slots

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Slot indexed under each ``(n, 2)`` uint64 key, or -1. Lock-free; confirm what it returns.

        The table matches the key's first word; the slot it names must hold the whole key (as in a
        slot table read just now). Two keys whose first words collide (rare: a 2**-64 chance per pair
        of xxh3 keys, or forged keys in tests) are told apart by a scalar scan of the probe run, off
        the common path.
        """
        keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 2)
        slots = self.hint(keys)
        n = len(self.slot_keys)
        differ = self.slot_keys[slots] != keys  # slot -1 reads the last row: masked out below
        differ = (differ[:, 0] | differ[:, 1]) & (slots >= 0)
        if not differ.any():
            return slots
        lo = keys[:, 0].view(np.int64)
        for i in np.flatnonzero(differ).tolist():
            want = keys[i]
            found = [s for s in self.table.values_of(int(lo[i])) if 0 <= s < n]
            slots[i] = next((s for s in found if (self.slot_keys[s] == want).all()), -1)
        return slots

    def insert(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Index each ``slots[i]`` under ``keys[i]`` (``(n, 2)`` uint64), all at once. Under the lock.

        Raises:
            CorruptState: the table is full (impossible at a load of 1/4 unless the segment is damaged).
        """
        lo = np.asarray(keys, dtype=np.uint64).reshape(-1, 2)[:, 0].view(np.int64)
        if not self.table.insert_many(lo, np.asarray(slots, dtype=np.int64)):
            raise CorruptState(f"segment {self.name}: hash index is full")

    def remove(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Drop the entries of ``slots`` indexed under ``keys`` (``(n, 2)`` uint64), all at once. Under
        the lock. A slot that is not indexed (a detached victim being freed, say) is skipped.
        """
        if len(slots):
            lo = np.asarray(keys, dtype=np.uint64).reshape(-1, 2)[:, 0].view(np.int64)
            self.table.delete_many(lo, np.asarray(slots, dtype=np.int64))

    def rebuild(self, slots: np.ndarray) -> None:
        """Index exactly ``slots`` under the keys the slot table holds for them. Under the lock."""
        slots = np.asarray(slots, dtype=np.int64)
        self.table.rebuild(self.slot_keys[slots, 0].view(np.int64), slots)
        self.damaged = False
