"""One open-addressing hash table over two int64 arrays, for the hot tier's index and the policies' ghosts.

The table maps an int64 key to an int64 value >= 0. It owns no memory: it works over two arrays of
``T`` (a power of two) words that may live in shared memory (the hot segment's index, the policy
state's ghost table) or in private memory, so every process that maps them sees the same table::

    keys  | k0 | k1 | .. | k(T-1) |      the key of each entry
    refs  | r0 | r1 | .. | r(T-1) |      value + 1 of each entry; 0: empty

- **Home**: Fibonacci hashing of the key, ``(key * 2**64/phi mod 2**64) >> (64 - log2 T)`` (Knuth, TAOCP
  vol. 3, 6.4): keys that differ only in their high bits, or small integer keys (simulator traces),
  still spread over the table.
- **Probing**: linear, from the home to the first empty entry. Keys need not be unique (the hot index
  keys by 64 of a key's 128 bits): ``lookup`` returns the first entry, ``values_of`` all of them.
- **Deletion**: backward shift (Knuth's Algorithm R): the entries after the hole that may move closer
  to their home do so, so there are no tombstones and probe runs stay as short as at insertion.
- **Load**: callers keep the table at most half full (the hot index: at most a quarter), so runs are
  short and a vectorised lookup of a whole prompt's keys takes a few numpy passes.

Concurrency is the caller's: writers serialise (the hot tier's metadata lock). A lock-free reader
racing with a writer (the hot tier's lookups) can miss an entry that is being inserted or shifted, but
an entry it finds was written whole at some time (each field is one aligned 8-byte word; a writer
stores the key before the ref that makes the entry visible), so callers confirm what they find.
"""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
_FIB = 0x9E3779B97F4A7C15  # 2**64 / golden ratio
#: When no more than this many keys of a batch still probe on, a Python loop over them (a few word
#: reads each) is cheaper than one more numpy pass per probe distance (about 5 calls per pass).
_SCALAR_TAIL = 8


class ProbeTable:
    """A linear-probing table over ``keys`` and ``refs`` (int64 arrays of the same power-of-two size).

    Args:
        keys: the key words (int64, C-contiguous).
        refs: ``value + 1`` per entry, 0 for an empty one (int64, C-contiguous).
    """

    __slots__ = ("keys", "refs", "size", "mask", "_shift", "_k", "_r", "_fib_u64", "_shift_u64")

    def __init__(self, keys: np.ndarray, refs: np.ndarray):
        size = len(refs)
        if len(keys) != size or size < 2 or size & (size - 1):
            raise ValueError(f"a ProbeTable needs two arrays of one power-of-two size >= 2, got {len(keys)} "
                             f"and {size}")
        self.keys, self.refs, self.size, self.mask = keys, refs, size, size - 1
        self._shift = 64 - (size.bit_length() - 1)
        self._fib_u64, self._shift_u64 = np.uint64(_FIB), np.uint64(self._shift)
        # The same words as memoryviews: the scalar paths index them with Python ints, several times
        # cheaper than numpy scalar indexing (a probe is a few word reads).
        self._k = keys.data.cast("B").cast("q")
        self._r = refs.data.cast("B").cast("q")

    def home(self, key: int) -> int:
        """The entry where ``key``'s probe run starts."""
        return ((key & _M64) * _FIB & _M64) >> self._shift

    def homes(self, keys: np.ndarray) -> np.ndarray:
        """``home`` of every key, vectorised (int64 positions)."""
        k = np.asarray(keys, dtype=np.int64).view(np.uint64)
        return ((k * self._fib_u64) >> self._shift_u64).view(np.int64)  # < size: fits

    # ---- scalar ---------------------------------------------------------------------------------
    def find(self, key: int) -> int:
        """Position of the first entry holding ``key``, or -1."""
        return self._find_from(self.home(key), key)

    def _find_from(self, i: int, key: int) -> int:
        k, r, mask = self._k, self._r, self.mask
        for _ in range(self.size):
            if not r[i]:
                return -1
            if k[i] == key:
                return i
            i = (i + 1) & mask
        return -1

    def find_value(self, key: int, value: int) -> int:
        """Position of the entry holding exactly ``(key, value)``, or -1."""
        return self._find_value_from(self.home(key), key, value)

    def _find_value_from(self, i: int, key: int, value: int) -> int:
        k, r, mask, ref = self._k, self._r, self.mask, value + 1
        for _ in range(self.size):
            if not r[i]:
                return -1
            if r[i] == ref and k[i] == key:
                return i
            i = (i + 1) & mask
        return -1

    def values_of(self, key: int) -> list[int]:
        """Values of every entry holding ``key``, in probe order (keys need not be unique)."""
        k, r, mask = self._k, self._r, self.mask
        i, out = self.home(key), []
        for _ in range(self.size):
            if not r[i]:
                break
            if k[i] == key:
                out.append(r[i] - 1)
            i = (i + 1) & mask
        return out

    def value_at(self, pos: int) -> int:
        """The value of the (non-empty) entry at ``pos``."""
        return self._r[pos] - 1

    def set_value(self, pos: int, value: int) -> None:
        """Replace the value of the (non-empty) entry at ``pos``; its key stays."""
        self._r[pos] = value + 1

    def insert(self, key: int, value: int) -> bool:
        """Add ``(key, value)`` in the first empty entry of ``key``'s run. False if the table is full."""
        k, r, mask = self._k, self._r, self.mask
        i = self.home(key)
        for _ in range(self.size):
            if not r[i]:
                k[i] = key
                r[i] = value + 1  # last: the entry becomes visible with its key in place
                return True
            i = (i + 1) & mask
        return False

    def delete_at(self, pos: int) -> None:
        """Empty entry ``pos``, shifting later entries of its run back (no tombstones).

        An entry at ``j`` moves into the hole ``i`` unless its home lies cyclically in ``(i, j]``
        (it would then move before its home, where no probe for it starts).
        """
        k, r, mask, i = self._k, self._r, self.mask, pos
        j = i
        for _ in range(self.size):
            j = (j + 1) & mask
            if not r[j]:
                break
            h = self.home(k[j])
            if (i < j and i < h <= j) or (i > j and (h > i or h <= j)):
                continue
            k[i] = k[j]
            r[i] = r[j]
            i = j
        r[i] = 0

    # ---- vectorised -------------------------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Value of the first entry holding each key (-1 where absent), all keys at once: one numpy
        pass per probe distance.

        The number of passes is bounded by the table size, so a lookup ends even if a racing writer
        keeps the table changing under it.
        """
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if not len(keys):
            return np.full(0, -1, dtype=np.int64)
        # Distance 0 for every key at once (at a low load most keys end here). An empty entry's ref
        # is 0, so ``ref - 1`` already answers -1 for it; only entries held by another key probe on.
        pos = self.homes(keys)
        ref = self.refs[pos]
        out = ref - 1
        go_on = ref != 0
        go_on &= self.keys[pos] != keys
        if not go_on.any():
            return out
        out[go_on] = -1
        active = np.flatnonzero(go_on)
        pos = (pos[active] + 1) & self.mask
        for _ in range(self.size - 1):
            if len(active) <= _SCALAR_TAIL:
                for a, i in zip(active.tolist(), pos.tolist()):
                    at = self._find_from(i, int(keys[a]))
                    if at >= 0:
                        out[a] = self._r[at] - 1
                break
            ref = self.refs[pos]
            live = ref != 0
            hit = live & (self.keys[pos] == keys[active])
            out[active[hit]] = ref[hit] - 1
            go_on = live & ~hit
            if not go_on.any():
                break
            active, pos = active[go_on], (pos[go_on] + 1) & self.mask
        return out

    def positions_of(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Position of the entry holding exactly ``(keys[i], values[i])`` for each i, or -1 (the
        vectorised ``find_value``)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        want = np.asarray(values, dtype=np.int64).reshape(-1) + 1
        out = np.full(len(keys), -1, dtype=np.int64)
        active = np.arange(len(keys))
        pos = self.homes(keys)
        for _ in range(self.size):
            if len(active) <= _SCALAR_TAIL:
                for a, i in zip(active.tolist(), pos.tolist()):
                    out[a] = self._find_value_from(i, int(keys[a]), int(want[a]) - 1)
                break
            ref = self.refs[pos]
            hit = (ref == want[active]) & (self.keys[pos] == keys[active])
            out[active[hit]] = pos[hit]
            go_on = (ref != 0) & ~hit
            active, pos = active[go_on], (pos[go_on] + 1) & self.mask
        return out

    def insert_many(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """Add every ``(keys[i], values[i])``, vectorised: in pass ``d`` every entry not placed yet tries
        the position ``d`` after its home and takes it if empty (the first of several contenders
        wins), so every entry stays reachable from its home without crossing an empty one. Within a
        pass the keys are stored before the refs that make them visible. False if the table filled up
        first (the entries placed so far stay).
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        values = np.asarray(values, dtype=np.int64).reshape(-1)
        pos = self.homes(keys)
        idx = np.arange(len(keys))
        for _ in range(self.size):
            if not len(idx):
                return True
            empty = np.flatnonzero(self.refs[pos] == 0)
            if len(empty):
                taken = pos[empty]
                if _distinct(taken):  # no two entries contend for one position (the common case)
                    placed = empty
                else:
                    taken, first = np.unique(taken, return_index=True)
                    placed = empty[first]
                self.keys[taken] = keys[idx[placed]]
                self.refs[taken] = values[idx[placed]] + 1
                if len(placed) == len(idx):
                    return True
                keep = np.ones(len(idx), dtype=bool)
                keep[placed] = False
                idx, pos = idx[keep], pos[keep]
            pos = (pos + 1) & self.mask
        return not len(idx)

    def delete_many(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Remove every entry holding exactly ``(keys[i], values[i])`` (pairs not in the table are
        skipped); returns how many were removed. Vectorised, and with no tombstones: the entries
        after each hole up to the end of its run are taken out and inserted again (``insert_many``),
        which leaves every run as an insertion would have. A lock-free reader may miss a re-inserted
        entry meanwhile (see the module docstring), never find a wrong one.
        """
        holes = np.unique(self.positions_of(keys, values))
        holes = holes[holes >= 0]
        if not len(holes):
            return 0
        # The rest of each hole's run: walk on from every hole to the first empty entry.
        moved = []
        pos = (holes + 1) & self.mask
        for _ in range(self.size):
            if len(pos) <= _SCALAR_TAIL:
                r, mask, tail = self._r, self.mask, []
                for i in pos.tolist():
                    for _ in range(self.size):
                        if not r[i]:
                            break
                        tail.append(i)
                        i = (i + 1) & mask
                moved.append(np.asarray(tail, dtype=np.int64))
                break
            live = self.refs[pos] != 0
            pos = pos[live]
            moved.append(pos)
            pos = (pos + 1) & self.mask
        if moved:
            after = np.unique(np.concatenate(moved))
            after = after[~np.isin(after, holes, assume_unique=True)]
        else:
            after = np.zeros(0, dtype=np.int64)
        keys_after, values_after = self.keys[after].copy(), self.refs[after] - 1
        self.refs[holes] = 0
        self.refs[after] = 0
        if not self.insert_many(keys_after, values_after):  # pragma: no cover - fewer entries than before
            raise ValueError("a probe table lost entries while deleting")
        return len(holes)

    def clear(self) -> None:
        """Empty every entry."""
        self.refs[:] = 0
        self.keys[:] = 0

    def rebuild(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Empty the table and insert every ``(keys[i], values[i])`` (``insert_many``)."""
        if len(values) > self.size:
            raise ValueError(f"{len(values)} entries do not fit in a table of {self.size}")
        self.clear()
        self.insert_many(keys, values)


def _distinct(values: np.ndarray) -> bool:
    """Whether no value of the 1-D array ``values`` appears twice."""
    ordered = np.sort(values)
    return bool((ordered[1:] != ordered[:-1]).all())
