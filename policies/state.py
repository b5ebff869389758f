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
"""

from __future__ import annotations

import numpy as np

COMMON_SLOT_FIELDS = ("resident", "key64", "last_access", "insert_tick", "hits", "parent",
                      "n_children", "position")
COMMON_GLOBAL_FIELDS = ("tick", "n_resident")
WORD = 8


class StateLayout:
    """Where each array sits inside a state buffer, for ``n_slots`` slots and one policy."""

    def __init__(self, n_slots: int, slot_fields: tuple[str, ...], global_fields: tuple[str, ...],
                 ghost_slots: int):
        if n_slots <= 0:
            raise ValueError(f"n_slots must be positive, got {n_slots}")
        self.n_slots = int(n_slots)
        self.slot_fields = COMMON_SLOT_FIELDS + tuple(f for f in slot_fields if f not in COMMON_SLOT_FIELDS)
        self.global_fields = COMMON_GLOBAL_FIELDS + tuple(
            f for f in global_fields if f not in COMMON_GLOBAL_FIELDS) + ("ghost_head", "ghost_len")
        self.ghost_slots = int(ghost_slots)
        # Each region starts on a 64-byte line.
        self.globals_offset = 0
        globals_bytes = _round(len(self.global_fields) * WORD, 64)
        self.fields_offset = globals_bytes
        self.field_stride = _round(self.n_slots * WORD, 64)
        self.ghost_offset = self.fields_offset + len(self.slot_fields) * self.field_stride
        self.nbytes = self.ghost_offset + _round(max(self.ghost_slots, 1) * WORD, 64)

    @classmethod
    def for_policy(cls, policy, n_slots: int) -> "StateLayout":
        return cls(n_slots, tuple(policy.slot_fields), tuple(policy.global_fields),
                   policy.ghost_capacity(n_slots))


class SlotState:
    """The arrays of a layout over a buffer. Attribute access: ``st.last_access``, ``st.g("tick")``."""

    def __init__(self, layout: StateLayout, buffer, offset: int = 0):
        self.layout = layout
        base = np.frombuffer(buffer, dtype=np.uint8, count=layout.nbytes, offset=offset)
        self._globals = base[: len(layout.global_fields) * WORD].view(np.int64)
        self._gindex = {name: i for i, name in enumerate(layout.global_fields)}
        n = layout.n_slots
        for i, name in enumerate(layout.slot_fields):
            start = layout.fields_offset + i * layout.field_stride
            setattr(self, name, base[start:start + n * WORD].view(np.int64))
        self.ghost = base[layout.ghost_offset:layout.ghost_offset + max(layout.ghost_slots, 1) * WORD].view(np.int64)
        self.n_slots = n

    @classmethod
    def private(cls, policy, n_slots: int) -> "SlotState":
        """A fresh state in private memory (the simulator's home)."""
        layout = StateLayout.for_policy(policy, n_slots)
        state = cls(layout, bytearray(layout.nbytes))
        state.reset()
        return state

    @classmethod
    def over(cls, policy, n_slots: int, buffer, offset: int) -> "SlotState":
        """The state inside a shared buffer (the hot tier's home). Does not reset it."""
        return cls(StateLayout.for_policy(policy, n_slots), buffer, offset)

    def reset(self) -> None:
        """Empty state: nothing resident, clock at zero."""
        self._globals[:] = 0
        for name in self.layout.slot_fields:
            getattr(self, name)[:] = 0
        self.parent[:] = -1
        self.ghost[:] = 0

    # ---- globals ------------------------------------------------------------------------------
    def g(self, name: str) -> int:
        return int(self._globals[self._gindex[name]])

    def set_g(self, name: str, value: int) -> None:
        self._globals[self._gindex[name]] = value

    def add_g(self, name: str, delta: int) -> int:
        """Add to a global word and return the new value (callers hold the lock, or accept races)."""
        i = self._gindex[name]
        self._globals[i] += delta
        return int(self._globals[i])

    def advance(self, n: int) -> np.ndarray:
        """Reserve ``n`` consecutive ticks; return them (1-based, increasing)."""
        end = self.add_g("tick", n)
        return np.arange(end - n + 1, end + 1, dtype=np.int64)

    # ---- ghosts: a FIFO ring of recently evicted key64s ------------------------------------------
    def ghost_push(self, key64s: np.ndarray) -> None:
        cap = self.layout.ghost_slots
        if cap <= 0:
            return
        for k in np.asarray(key64s, dtype=np.int64):
            head = self.g("ghost_head")
            self.ghost[head % cap] = k
            self.set_g("ghost_head", (head + 1) % cap)
            self.set_g("ghost_len", min(self.g("ghost_len") + 1, cap))

    def ghost_contains(self, key64: int) -> bool:
        n = self.g("ghost_len")
        return bool(n) and bool(np.any(self.ghost[:n] == key64)) if n < self.layout.ghost_slots else \
            bool(n) and bool(np.any(self.ghost[: self.layout.ghost_slots] == key64))

    def ghost_remove(self, key64: int) -> bool:
        """Forget one ghost entry equal to key64 (it became resident again). True if found."""
        n = min(self.g("ghost_len"), self.layout.ghost_slots)
        hits = np.flatnonzero(self.ghost[:n] == key64)
        if not len(hits):
            return False
        # Overwrite with a value no key64 takes in practice, keeping the ring's order intact.
        self.ghost[hits[0]] = _GHOST_HOLE
        return True

    @property
    def resident_slots(self) -> np.ndarray:
        return np.flatnonzero(self.resident)


_GHOST_HOLE = np.int64(-0x7FFF_FFFF_FFFF_FFFF)


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to
