"""Struct-of-arrays slot state: the one thing policies read and write.

A ``SlotState`` is a set of int64 arrays, one element per slot, plus a few global int64 words and an
optional ring of uint64 "ghost" keys (recently evicted keys, for S3-FIFO and ARC). It lives either in
the hot tier's shared memory (``SlotState.over(buffer, ...)``: every process sees and changes the same
arrays) or in private memory (``SlotState.private(...)``, the simulator). Policies are the same code in
both homes, so they make the same decisions.

Every field is an aligned 8-byte word: a concurrent relaxed store (a hit bumping ``last_access``
without the lock) never tears.

Common fields, kept by ``policies.base`` for every policy:

==============  =================================================================================
``resident``    1 while the slot holds a block the policy manages, else 0
``key64``       low 64 bits of the block's key (viewed as int64)
``last_access`` tick of the last insert or hit
``insert_tick`` tick of the insert
``hits``        hits since insert
``parent``      slot of the block's parent if resident when inserted, else -1
``n_children``  resident blocks whose ``parent`` is this slot
``position``    chunk index in its prompt (recompute cost grows with it)
==============  =================================================================================

Common globals: ``tick`` (logical clock, +1 per insert or hit batch element) and ``n_resident``.

Ghosts (recently evicted keys, for S3-FIFO and ARC) live in the same buffer as a fixed-size structure:
one FIFO ring per ghost list plus one open-addressed hash table over all lists, so "is this key a
ghost, and in which list" costs O(1) and the whole thing works over shared memory (no Python dicts)::

    ghost region (int64 words)
    | per list: head, tail, live | ring keys: lists x R | ring flags: lists x R | table key: T | table ref: T |

- a list holds at most ``ghost_slots`` live keys; pushing onto a full list drops its oldest live key;
- a ring entry whose key was removed (it became resident again) stays as a dead flag word until the
  head passes it; the ring is twice the list's capacity so dead entries rarely force out live ones;
- the table maps key -> ring entry (``list * R + index``); it is ``tieredkv.hashtable.ProbeTable``
  (linear probing, backward-shift deletion, the hot tier's index uses the same), kept at most half full.
"""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput
from tieredkv.hashtable import ProbeTable

from . import _jit

COMMON_SLOT_FIELDS = ("resident", "key64", "last_access", "insert_tick", "hits", "parent",
                      "n_children", "position")
COMMON_GLOBAL_FIELDS = ("tick", "n_resident")
WORD = 8

#: Ghost ring entry flags.
GHOST_LIVE = 1
#: A policy-defined mark on a live ghost entry (ARC: "p was already adapted for this key").
GHOST_MARK = 2
#: Flag bits below this shift; a policy's tag (``ghost_push(..., tags=)``) above it.
GHOST_TAG_SHIFT = 2


class StateLayout:
    """Where each array sits inside a state buffer, for ``n_slots`` slots and one policy.

    Args:
        n_slots: slots (the cache's capacity in blocks).
        slot_fields: the policy's own per-slot int64 fields (the common ones are always there).
        global_fields: the policy's own global int64 words.
        ghost_slots: live keys each ghost list may hold (0: no ghosts).
        ghost_lists: number of ghost lists (S3-FIFO: 1; ARC: 2, for B1 and B2).
    """

    def __init__(self, n_slots: int, slot_fields: tuple[str, ...], global_fields: tuple[str, ...],
                 ghost_slots: int, ghost_lists: int = 1):
        if n_slots <= 0:
            raise InvalidInput(f"n_slots must be positive, got {n_slots}")
        self.n_slots = int(n_slots)
        self.slot_fields = COMMON_SLOT_FIELDS + tuple(f for f in slot_fields if f not in COMMON_SLOT_FIELDS)
        self.global_fields = COMMON_GLOBAL_FIELDS + tuple(
            f for f in global_fields if f not in COMMON_GLOBAL_FIELDS)
        self.ghost_slots = max(int(ghost_slots), 0)
        self.ghost_lists = int(ghost_lists) if self.ghost_slots else 0
        self.ghost_ring = 2 * self.ghost_slots
        live_max = self.ghost_slots * self.ghost_lists
        # Table at most half full: probes stay short with linear probing.
        self.ghost_table = _pow2(2 * live_max) if live_max else 0
        # Each region starts on a 64-byte line.
        self.globals_offset = 0
        globals_bytes = _round(len(self.global_fields) * WORD, 64)
        self.fields_offset = globals_bytes
        self.field_stride = _round(self.n_slots * WORD, 64)
        self.ghost_offset = self.fields_offset + len(self.slot_fields) * self.field_stride
        ghost_words = 3 * self.ghost_lists + 2 * self.ghost_lists * self.ghost_ring + 2 * self.ghost_table
        self.nbytes = self.ghost_offset + _round(max(ghost_words, 1) * WORD, 64)

    @classmethod
    def for_policy(cls, policy, n_slots: int) -> StateLayout:
        """The layout ``policy`` needs for ``n_slots`` slots."""
        return cls(n_slots, tuple(policy.slot_fields), tuple(policy.global_fields),
                   policy.ghost_capacity(n_slots), getattr(policy, "ghost_lists", 1))


class SlotState:
    """The arrays of a layout over a buffer. Attribute access: ``st.last_access``, ``st.g("tick")``.

    Args:
        layout: where the arrays sit.
        buffer: any writable buffer of at least ``offset + layout.nbytes`` bytes.
        offset: byte offset of the state in ``buffer`` (a multiple of 8).
    """

    # The common per-slot fields (a policy's own fields are set the same way, by name).
    resident: np.ndarray
    key64: np.ndarray
    last_access: np.ndarray
    insert_tick: np.ndarray
    hits: np.ndarray
    parent: np.ndarray
    n_children: np.ndarray
    position: np.ndarray

    def __init__(self, layout: StateLayout, buffer, offset: int = 0):
        if offset % WORD:
            raise InvalidInput(f"state offset must be a multiple of {WORD}, got {offset}")
        self.layout = layout
        base = np.frombuffer(buffer, dtype=np.uint8, count=layout.nbytes, offset=offset)
        self._globals = base[: len(layout.global_fields) * WORD].view(np.int64)
        self._gindex = {name: i for i, name in enumerate(layout.global_fields)}
        n = layout.n_slots
        for i, name in enumerate(layout.slot_fields):
            start = layout.fields_offset + i * layout.field_stride
            setattr(self, name, base[start:start + n * WORD].view(np.int64))
        words = base[layout.ghost_offset:].view(np.int64)
        L, R, T = layout.ghost_lists, layout.ghost_ring, layout.ghost_table
        self._ghead = words[0:3 * L:3]      # absolute index of each list's oldest ring entry
        self._gtail = words[1:3 * L:3]      # absolute index of each list's next ring entry
        self._glive = words[2:3 * L:3]      # live keys per list
        at = 3 * L
        self._gring = words[at:at + L * R]
        self._gflag = words[at + L * R:at + 2 * L * R]
        at += 2 * L * R
        # No ghosts: a private two-entry table that stays empty, so lookups need no special case.
        self._table = (ProbeTable(words[at:at + T], words[at + T:at + 2 * T]) if T
                       else ProbeTable(np.zeros(2, np.int64), np.zeros(2, np.int64)))
        # The ring words as a memoryview: the scalar paths below index it with Python ints, several
        # times cheaper than numpy scalar indexing.
        self._w = words[:3 * L + 2 * L * R].data.cast("B").cast("q")
        self._o_flag = 3 * L + L * R
        # The same words as arrays, for the compiled kernels (``_jit``); only when there are ghosts.
        self._kernels = _jit.ENABLED and T > 0
        self._gw = words[:3 * L + 2 * L * R]
        self._tshift = self._table._shift
        self.n_slots = n
        #: Keys about to be inserted, while ``evict(..., incoming=...)`` runs (process-local).
        self.incoming: np.ndarray | None = None

    @classmethod
    def private(cls, policy, n_slots: int) -> SlotState:
        """A fresh state in private memory (the simulator's home)."""
        layout = StateLayout.for_policy(policy, n_slots)
        state = cls(layout, bytearray(layout.nbytes))
        state.reset()
        return state

    @classmethod
    def over(cls, policy, n_slots: int, buffer, offset: int) -> SlotState:
        """The state inside a shared buffer (the hot tier's home). Does not reset it."""
        return cls(StateLayout.for_policy(policy, n_slots), buffer, offset)

    def reset(self) -> None:
        """Empty state: nothing resident, clock at zero, no ghosts."""
        self._globals[:] = 0
        for name in self.layout.slot_fields:
            getattr(self, name)[:] = 0
        self.parent[:] = -1
        for a in (self._ghead, self._gtail, self._glive, self._gring, self._gflag):
            a[:] = 0
        self._table.clear()

    # ---- globals ------------------------------------------------------------------------------
    def g(self, name: str) -> int:
        """The global int64 word ``name``."""
        return int(self._globals[self._gindex[name]])

    def set_g(self, name: str, value: int) -> None:
        self._globals[self._gindex[name]] = value

    def add_g(self, name: str, delta: int) -> int:
        """Add to a global word and return the new value (callers hold the lock, or accept races)."""
        i = self._gindex[name]
        self._globals[i] += delta
        return int(self._globals[i])

    def gf(self, name: str) -> float:
        """The global word ``name`` read as a float64 (same 8 bytes; 0 reads as 0.0)."""
        return float(self._globals.view(np.float64)[self._gindex[name]])

    def set_gf(self, name: str, value: float) -> None:
        self._globals.view(np.float64)[self._gindex[name]] = value

    def global_index(self, name: str) -> int:
        """Index of the global word ``name`` in ``globals_view()`` (a policy's tables of words are
        consecutive names, so one slice of the view holds a whole table)."""
        return self._gindex[name]

    def globals_view(self, dtype=np.int64) -> np.ndarray:
        """All global words as one array (``np.float64`` for tables of floats); writes go to the state."""
        return self._globals.view(dtype)

    def f64(self, field: str) -> np.ndarray:
        """A per-slot field viewed as float64 (for priorities that are not integers)."""
        return getattr(self, field).view(np.float64)

    def advance(self, n: int) -> np.ndarray:
        """Reserve ``n`` consecutive ticks; return them (1-based, increasing)."""
        end = self.add_g("tick", n)
        return np.arange(end - n + 1, end + 1, dtype=np.int64)

    def ghost_args(self) -> tuple:
        """``(w, tk, tr, lists, ring, list capacity, table shift)``: the ghost words as the compiled
        kernels take them (``_jit``, ``_kernels``)."""
        L = self.layout
        return self._gw, self._table.keys, self._table.refs, L.ghost_lists, L.ghost_ring, L.ghost_slots, self._tshift

    @property
    def resident_slots(self) -> np.ndarray:
        return np.flatnonzero(self.resident)

    # ---- ghosts ---------------------------------------------------------------------------------
    # Scalar code on purpose: ghost operations touch one key at a time under the home's lock, and a
    # probe is a handful of word reads; numpy would only add per-call overhead here.
    def ghost_len(self, lst: int = 0) -> int:
        """Live keys in ghost list ``lst``."""
        return self._w[3 * lst + 2] if self.layout.ghost_lists else 0

    def ghost_find(self, key64: int) -> tuple[int, int]:
        """``(list, flags)`` of ``key64`` if it is a ghost, else ``(-1, 0)``."""
        i = (_jit.table_find(self._table.keys, self._table.refs, int(key64), self._tshift) if self._kernels
             else self._tfind(int(key64)))
        if i < 0:
            return -1, 0
        ref = self._table.value_at(i)
        return ref // self.layout.ghost_ring, self._w[self._o_flag + ref]

    def ghost_lookup(self, key64s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``ghost_find``: per key its list (-1 if no ghost) and its flags."""
        keys = np.asarray(key64s).astype(np.int64, copy=False).reshape(-1)
        lists = np.full(len(keys), -1, dtype=np.int64)
        flags = np.zeros(len(keys), dtype=np.int64)
        if not self.layout.ghost_table or not len(keys) or not self._glive.any():
            return lists, flags
        if self._kernels:
            return _jit.ghost_lookup(self._gw, self._table.keys, self._table.refs, np.ascontiguousarray(keys),
                                     self.layout.ghost_lists, self.layout.ghost_ring, self._tshift)
        ref = self._table.lookup(keys)
        found = ref >= 0
        lists[found] = ref[found] // self.layout.ghost_ring
        flags[found] = self._gflag[ref[found]]
        return lists, flags

    def ghost_mark(self, key64: int) -> bool:
        """Set ``GHOST_MARK`` on a live ghost entry. True if ``key64`` is a ghost."""
        i = self._tfind(int(key64))
        if i < 0:
            return False
        at = self._o_flag + self._table.value_at(i)
        self._w[at] = self._w[at] | GHOST_MARK
        return True

    def ghost_push(self, key64s, lst: int = 0, *, fresh: bool = False, tags=None) -> None:
        """Append keys (oldest first) to ghost list ``lst``, dropping its oldest live keys if full.

        Args:
            key64s: the keys, distinct.
            lst: which ghost list.
            fresh: the caller knows none of the keys is a ghost already (keys of blocks that were
                resident: a key leaves the ghosts when its block is inserted), so skip that check.
            tags: optional small non-negative ints, one per key, kept in the entry's flags above the
                flag bits (``flags >> GHOST_TAG_SHIFT`` reads it back): what the policy wants to
                remember about an evicted block, e.g. its class.
        """
        if not self.layout.ghost_lists:
            return
        R, cap = self.layout.ghost_ring, self.layout.ghost_slots
        if self._kernels:
            keys_a = np.ascontiguousarray(np.atleast_1d(np.asarray(key64s, dtype=np.int64)))
            flags_a = (np.full(len(keys_a), GHOST_LIVE, dtype=np.int64) if tags is None else
                       np.ascontiguousarray(GHOST_LIVE | (np.asarray(tags, dtype=np.int64) << GHOST_TAG_SHIFT)))
            _jit.ghost_push(self._gw, self._table.keys, self._table.refs, keys_a, flags_a, lst,
                            self.layout.ghost_lists, R, cap, self._tshift, fresh)
            return
        w, o_flag, H = self._w, self._o_flag, 3 * lst
        keys = np.atleast_1d(np.asarray(key64s, dtype=np.int64)).tolist()
        flag_words = ([GHOST_LIVE] * len(keys) if tags is None else
                      (GHOST_LIVE | (np.asarray(tags, dtype=np.int64) << GHOST_TAG_SHIFT)).tolist())
        for k, flag in zip(keys, flag_words):
            if not fresh and self._tfind(k) >= 0:
                self.ghost_remove(k)
            if w[H + 2] >= cap:
                self.ghost_pop(lst)
            if w[H + 1] - w[H] >= R:  # ring full: live ones and dead holes
                self._ghost_compact(lst)
            tail = w[H + 1]
            ref = lst * R + tail % R
            w[3 * self.layout.ghost_lists + ref] = k
            w[o_flag + ref] = flag
            self._table.insert(k, ref)
            w[H + 1] = tail + 1
            w[H + 2] += 1

    def ghost_pop(self, lst: int = 0) -> int | None:
        """Forget and return the oldest live key of list ``lst`` (None if it has none)."""
        R = self.layout.ghost_ring
        if self._kernels:
            found, key = _jit.ghost_pop(self._gw, self._table.keys, self._table.refs, lst, self.layout.ghost_lists,
                                        R, self._tshift)
            return int(key) if found else None
        w, o_flag, o_ring, H = self._w, self._o_flag, 3 * self.layout.ghost_lists, 3 * lst
        head, tail = w[H], w[H + 1]
        while head < tail:
            ref = lst * R + head % R
            head += 1
            if w[o_flag + ref]:
                w[H] = head
                key = w[o_ring + ref]
                w[o_flag + ref] = 0
                self._table.delete_at(self._tfind(key))
                w[H + 2] -= 1
                return key
        w[H] = head
        return None

    def _ghost_compact(self, lst: int) -> None:
        """Squeeze the dead entries out of list ``lst``'s ring, keeping the live ones in order.

        Rare (the ring is twice the list's capacity) and O(ring): amortised over the pushes since.
        """
        R = self.layout.ghost_ring
        head, tail = int(self._ghead[lst]), int(self._gtail[lst])
        idx = lst * R + np.arange(head, tail) % R
        keep = self._gflag[idx] != 0
        keys, flags = self._gring[idx][keep], self._gflag[idx][keep]
        new = lst * R + np.arange(head, head + len(keys)) % R
        self._gflag[idx] = 0
        self._gring[new] = keys
        self._gflag[new] = flags
        for k, ref in zip(keys.tolist(), new.tolist()):
            self._table.set_value(self._tfind(k), ref)
        self._gtail[lst] = head + len(keys)

    def ghost_remove(self, key64: int) -> int:
        """Forget ``key64`` (it became resident again). Returns its list, or -1 if it was no ghost."""
        if not self.layout.ghost_lists:
            return -1
        if self._kernels:
            return int(_jit.ghost_remove(self._gw, self._table.keys, self._table.refs, int(key64),
                                         self.layout.ghost_lists, self.layout.ghost_ring, self._tshift))
        i = self._tfind(int(key64))
        if i < 0:
            return -1
        w = self._w
        ref = self._table.value_at(i)
        lst = ref // self.layout.ghost_ring
        w[self._o_flag + ref] = 0
        self._table.delete_at(i)
        w[3 * lst + 2] -= 1
        return lst

    def _tfind(self, key: int) -> int:
        return self._table.find(key)


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 7).bit_length()
