"""ARC: adaptive replacement between a recency list and a frequency list, tuned by their ghosts."""

from __future__ import annotations

import numpy as np

from . import _jit, _kernels
from .base import EvictionPolicy, register
from .order import OrderCursor
from .state import GHOST_MARK

T1, T2 = 1, 2        # arc_list values: seen once recently / seen at least twice
B1, B2 = 0, 1        # ghost lists: keys evicted from T1 / from T2
_NO_KEYS = np.zeros(0, dtype=np.int64)


@register
class ARC(EvictionPolicy):
    """ARC: resident blocks are in T1 (seen once) or T2 (seen again); keys evicted from them are
    remembered in ghost lists B1 and B2. A miss whose key is in B1 grows the target size ``p`` of T1
    by max(|B2|/|B1|, 1); one in B2 shrinks it by max(|B1|/|B2|, 1); either way the block enters T2.
    The victim is T1's LRU block when |T1| > p (or |T1| = p and the missing key is in B2), else T2's
    LRU block. Ghost lists are trimmed so that |T1|+|B1| <= c and the total stays <= 2c.

    N. Megiddo, D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003 (Fig. 4).

    Layout: ``arc_list`` per slot (T1/T2); recency is the common ``last_access``, so a hit (T1 -> T2,
    and MRU) is plain stores. ``p`` is a float64 global. The ghosts B1/B2 are the state's ghost lists.
    The paper adapts ``p`` and picks the victim list knowing the missing key: homes pass it as
    ``evict(..., incoming=keys)``; without it ``p`` adapts when the key is inserted, one eviction late.
    """

    name = "arc"
    slot_fields = ("arc_list",)
    global_fields = ("arc_p",)
    ghost_lists = 2

    def ghost_capacity(self, n_slots):
        return n_slots

    def _adapt(self, st, lst: int) -> None:
        b1, b2 = st.ghost_len(B1), st.ghost_len(B2)
        p = st.gf("arc_p")
        if lst == B1:
            p = min(float(st.n_slots), p + max(b2 / b1, 1.0))
        else:
            p = max(0.0, p - max(b1 / b2, 1.0))
        st.set_gf("arc_p", p)

    def on_miss(self, st, key64s):
        if _jit.ENABLED:
            w, tk, tr, L, R, _, shift = st.ghost_args()
            st.set_gf("arc_p", float(_kernels.arc_miss(w, tk, tr, np.ascontiguousarray(key64s, dtype=np.int64), L, R,
                                                       shift, st.gf("arc_p"), st.n_slots)))
            return
        lists, flags = st.ghost_lookup(key64s)
        todo = (lists >= 0) & (flags & GHOST_MARK == 0)
        for key, lst in zip(key64s[todo].tolist(), lists[todo].tolist()):
            self._adapt(st, lst)
            st.ghost_mark(key)

    def on_insert(self, st, slots):
        if _jit.ENABLED:
            w, tk, tr, L, R, _, shift = st.ghost_args()
            st.set_gf("arc_p", float(_kernels.arc_insert(st.arc_list, st.resident, st.key64, slots, w, tk, tr, L, R,
                                                         shift, st.gf("arc_p"), st.n_slots)))
            return
        lists = st.arc_list
        resident = st.resident == 1
        resident[slots] = False  # count what was there before this batch
        t1 = int(np.count_nonzero(resident & (lists == T1)))
        t2 = int(np.count_nonzero(resident)) - t1
        c = st.n_slots
        keys = st.key64[slots]
        found, marks = st.ghost_lookup(keys)
        for s, key, lst, flags in zip(slots.tolist(), keys.tolist(), found.tolist(), marks.tolist()):
            if lst >= 0:
                lst, flags = st.ghost_find(key)  # still there? an earlier key of the batch may have popped it
            if lst >= 0:                      # cases II and III: a ghost comes back, into T2
                if not flags & GHOST_MARK:
                    self._adapt(st, lst)
                st.ghost_remove(key)
                lists[s] = T2
                t2 += 1
                continue
            b1, b2 = st.ghost_len(B1), st.ghost_len(B2)  # case IV: new key, into T1
            if t1 + b1 >= c:
                if b1:
                    st.ghost_pop(B1)
            elif t1 + t2 + b1 + b2 >= 2 * c and b2:
                st.ghost_pop(B2)
            lists[s] = T1
            t1 += 1

    def on_hit(self, st, slots):
        if _jit.ENABLED:
            _kernels.arc_hit(st.arc_list, slots)
            return
        st.arc_list[slots] = T2

    def on_remove(self, st, slots, evicted):
        if evicted and _jit.ENABLED:
            w, tk, tr, L, R, cap, shift = st.ghost_args()
            _kernels.arc_remove(st.arc_list, st.key64, slots, w, tk, tr, L, R, cap, shift)
        elif evicted:
            keys, from_t1 = st.key64[slots], st.arc_list[slots] == T1
            # Each ghost list keeps its own order; resident keys are never ghosts (fresh=True).
            st.ghost_push(keys[from_t1], B1, fresh=True)
            st.ghost_push(keys[~from_t1], B2, fresh=True)

    @staticmethod
    def _x_in_b2(st, incoming, n: int, i: int) -> bool:
        """Is the key whose insert needs the i-th of n evictions in B2? (False if unknown.)"""
        if incoming is None:
            return False
        j = len(incoming) - n + i
        return j >= 0 and st.ghost_find(int(incoming[j]))[0] == B2

    def choose(self, st, n, candidates):
        if _jit.ENABLED:
            w, tk, tr, L, R, _, shift = st.ghost_args()
            incoming = st.incoming
            return _kernels.arc_choose(st.arc_list, st.resident, st.last_access, candidates, int(n), st.gf("arc_p"),
                                       _NO_KEYS if incoming is None else np.ascontiguousarray(incoming, dtype=np.int64),
                                       incoming is not None, w, tk, tr, L, R, shift)
        lists = st.arc_list
        in_t1 = lists == T1
        t1 = int(np.count_nonzero((st.resident == 1) & in_t1))
        walks = {T1: OrderCursor(st.last_access, candidates & in_t1),
                 T2: OrderCursor(st.last_access, candidates & ~in_t1)}
        p = st.gf("arc_p")
        incoming = st.incoming
        victims: list[int] = []
        for i in range(n):
            first = T1 if t1 >= 1 and (t1 > p or (t1 == p and self._x_in_b2(st, incoming, n, i))) else T2
            s = walks[first].next()
            if s < 0:
                s = walks[T1 + T2 - first].next()
                if s < 0:
                    break
            if lists[s] == T1:
                t1 -= 1
            victims.append(s)
        return np.array(victims, dtype=np.int64)
