"""Order helpers shared by the policies: the n smallest of a field, and a lazy ascending walk.

Both work on masks over slots and touch only numpy arrays, so a choice costs O(n_slots) vector work
plus O(victims) scalar steps, never a sort of the whole cache per eviction.
"""

from __future__ import annotations

import numpy as np

from . import _jit, _kernels


def oldest(field: np.ndarray, n: int, candidates: np.ndarray) -> np.ndarray:
    """The ``n`` candidate slots smallest by ``(field, slot)``, in that order.

    Ties in ``field`` go to the lower slot, so the choice is one and the same in every process
    (with or without the compiled kernel, ``_jit.oldest``, which does exactly this in one pass).
    """
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if _jit.ENABLED:
        return _jit.oldest(field, int(n), candidates)
    slots = np.flatnonzero(candidates)
    if n < len(slots):
        values = field[slots]
        kth = np.partition(values, n - 1)[n - 1]
        below = slots[values < kth]
        slots = np.concatenate([below, slots[values == kth][:n - len(below)]])
    return slots[np.argsort(field[slots], kind="stable")][:n]


def smallest_lex(primary: np.ndarray, secondary: np.ndarray, n: int, candidates: np.ndarray) -> np.ndarray:
    """The ``n`` candidates smallest by ``(primary, secondary)``, in that order.

    ``primary`` may be int64 or float64 (e.g. a priority); ``secondary`` breaks ties (a tick).
    """
    if _jit.ENABLED and primary.dtype == np.int64 and secondary.dtype == np.int64:
        return _kernels.smallest_lex(primary, secondary, int(n), candidates)
    slots = np.flatnonzero(candidates)
    if n < len(slots):
        p = primary[slots]
        kth = np.partition(p, n - 1)[n - 1]
        below = slots[p < kth]
        tied = slots[p == kth]
        need = n - len(below)
        if need < len(tied):
            tied = tied[np.argpartition(secondary[tied], need - 1)[:need]]
        slots = np.concatenate([below, tied])
    return slots[np.lexsort((secondary[slots], primary[slots]))][:n]


class OrderCursor:
    """Walk the slots of ``mask`` in ascending ``order``, lazily.

    The walk sees changes made while it runs, the way a clock hand or a FIFO's tail does: a slot
    removed from ``mask`` is skipped, and a slot given a new ``order`` larger than every value
    already walked (moved to a queue's head) comes up again later. Each refill selects the next
    ``chunk`` smallest values with ``argpartition`` (O(n_slots)); chunks grow fourfold.

    Args:
        order: int64 order values (unique per slot, e.g. a queue sequence number).
        mask: bool mask of slots in the walk; the caller may clear entries as it goes.
        start: walk only values >= start (a clock hand's position); None for all.
        chunk: first refill size.
    """

    __slots__ = ("order", "mask", "last", "buf", "i", "chunk")

    def __init__(self, order: np.ndarray, mask: np.ndarray, start: int | None = None, chunk: int = 32):
        self.order = order
        self.mask = mask
        self.last = None if start is None else int(start) - 1
        self.buf: list[int] = []
        self.i = 0
        self.chunk = chunk

    def next(self) -> int:
        """The next slot, or -1 when the walk is over."""
        while True:
            if self.i == len(self.buf) and not self._refill():
                return -1
            s = self.buf[self.i]
            self.i += 1
            if self.mask[s]:
                return s

    def _refill(self) -> bool:
        sel = np.flatnonzero(self.mask if self.last is None else self.mask & (self.order > self.last))
        if not len(sel):
            return False
        if self.chunk < len(sel):
            sel = sel[np.argpartition(self.order[sel], self.chunk - 1)[:self.chunk]]
        sel = sel[np.argsort(self.order[sel])]
        self.buf = sel.tolist()
        self.i = 0
        self.last = int(self.order[sel[-1]])
        self.chunk *= 4
        return True
