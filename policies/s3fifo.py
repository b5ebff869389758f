"""S3-FIFO: a small probationary FIFO, a main FIFO with lazy promotion, and a ghost FIFO."""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput

from . import _jit, _kernels
from .base import EvictionPolicy, register
from .order import OrderCursor

SMALL, MAIN = 0, 1     # s3_queue values
GHOST, PENDING = 0, 1  # ghost lists


@register
class S3FIFO(EvictionPolicy):
    """S3-FIFO: three FIFO queues. New blocks enter the small queue S (10% of the cache) unless their
    key is in the ghost queue G, in which case they enter the main queue M. Evicting from S moves a
    block hit at least ``move_threshold`` times to M, and otherwise evicts it and remembers its key
    in G. Evicting from M reinserts a block with a non-zero counter at M's head, one less (CLOCK
    inside M), and evicts the first with counter zero. S is evicted from while it holds more than its
    share and M is within its own; hits add one to a counter capped at ``max_freq``.

    J. Yang, Y. Zhang, Z. Qiu, Y. Yue, K. V. Rashmi, "FIFO queues are all you need for cache
    eviction", SOSP 2023. Defaults follow the paper and libCacheSim (small 10%, ghost 90% of the
    cache in entries, move to main at 2 hits, 2-bit counters).

    A hit is one plain store of ``s3_freq``; queue moves happen only in ``choose`` (under the lock).

    Args:
        small_ratio: share of the slots for S.
        ghost_ratio: ghost entries, as a share of the slots.
        move_threshold: hits in S that earn a move to M.
        max_freq: counter cap.
    """

    name = "s3fifo"
    slot_fields = ("s3_queue", "s3_freq", "s3_order")
    # Ghost list 0 is G; list 1 holds keys that missed while in G and are about to enter M (taken
    # out of G before the evictions they cause, as in the paper's read-then-insert order).
    ghost_lists = 2
    global_fields = ("s3_seq", "s3_evicted")

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 0.9, move_threshold: int = 2,
                 max_freq: int = 3):
        if not 0 < small_ratio < 1:
            raise InvalidInput(f"small_ratio must be in (0, 1), got {small_ratio}")
        if ghost_ratio < 0:
            raise InvalidInput(f"ghost_ratio must be >= 0, got {ghost_ratio}")
        self.small_ratio = float(small_ratio)
        self.ghost_ratio = float(ghost_ratio)
        self.move_threshold = int(move_threshold)
        self.max_freq = int(max_freq)

    def ghost_capacity(self, n_slots):
        return int(self.ghost_ratio * n_slots)

    def small_capacity(self, n_slots: int) -> int:
        return max(int(self.small_ratio * n_slots), 1)

    def on_miss(self, st, key64s):
        if _jit.ENABLED:
            _kernels.s3fifo_miss(*_ghost(st, key64s))
            return
        found = key64s[st.ghost_lookup(key64s)[0] == GHOST]
        for key in found.tolist():
            st.ghost_remove(key)
        st.ghost_push(found, PENDING)

    def on_insert(self, st, slots):
        if _jit.ENABLED:
            w, tk, tr, L, R, _, shift = st.ghost_args()
            seq = _kernels.s3fifo_insert(st.s3_queue, st.s3_freq, st.s3_order, st.resident, st.key64, slots, w, tk, tr,
                                         L, R, shift, not st.g("s3_evicted"), self.small_capacity(st.n_slots),
                                         st.g("s3_seq"))
            st.set_g("s3_seq", int(seq))
            return
        keys = st.key64[slots]
        queue = np.where(st.ghost_lookup(keys)[0] >= 0, MAIN, SMALL)
        for key in keys[queue == MAIN].tolist():
            st.ghost_remove(key)
        if not st.g("s3_evicted"):
            # Warm-up (nothing evicted yet): once S is full, new blocks fill M directly, so a cold
            # cache is not all probation.
            resident = st.resident == 1
            resident[slots] = False
            room = self.small_capacity(st.n_slots) - int(np.count_nonzero(resident & (st.s3_queue == SMALL)))
            new = np.flatnonzero(queue == SMALL)
            queue[new[max(room, 0):]] = MAIN
        st.s3_queue[slots] = queue
        st.s3_freq[slots] = 0
        end = st.add_g("s3_seq", len(slots))
        st.s3_order[slots] = np.arange(end - len(slots), end)

    def on_hit(self, st, slots):
        if _jit.ENABLED:
            _kernels.saturating_hit(st.s3_freq, slots, self.max_freq)
            return
        st.s3_freq[slots] = np.minimum(st.s3_freq[slots] + 1, self.max_freq)

    def on_remove(self, st, slots, evicted):
        if evicted and _jit.ENABLED:
            w, tk, tr, L, R, cap, shift = st.ghost_args()
            _kernels.s3fifo_remove(st.s3_queue, st.key64, slots, w, tk, tr, L, R, cap, shift)
        elif evicted:
            # Resident keys are never ghosts (on_insert takes them out), hence fresh=True.
            st.ghost_push(st.key64[slots][st.s3_queue[slots] == SMALL], GHOST, fresh=True)

    def choose(self, st, n, candidates):
        if _jit.ENABLED:
            victims, seq = _kernels.s3fifo_choose(st.s3_queue, st.s3_freq, st.s3_order, st.resident, candidates,
                                                  int(n), st.n_slots, self.small_capacity(st.n_slots),
                                                  self.move_threshold, st.g("s3_seq"))
            st.set_g("s3_seq", int(seq))
            if len(victims):
                st.set_g("s3_evicted", 1)
            return victims
        queue, freq, order = st.s3_queue, st.s3_freq, st.s3_order
        resident = st.resident == 1
        in_small = queue == SMALL
        n_small = int(np.count_nonzero(resident & in_small))
        n_main = int(np.count_nonzero(resident)) - n_small
        main_cap = st.n_slots - self.small_capacity(st.n_slots)
        small_mask = candidates & in_small
        main_mask = candidates & ~in_small
        small_walk = OrderCursor(order, small_mask)
        main_walk = OrderCursor(order, main_mask)
        seq = st.g("s3_seq")
        victims: list[int] = []
        while len(victims) < n:
            from_main = n_main > main_cap or n_small == 0
            victim = -1
            if not from_main:
                # Evict from S: the tail moves to M if it was hit enough, else it leaves (to G).
                while True:
                    s = small_walk.next()
                    if s < 0:
                        break
                    small_mask[s] = False
                    n_small -= 1
                    if freq[s] >= self.move_threshold:
                        seq = _kernels.s3fifo_requeue(queue, freq, order, s, True, seq)
                        main_mask[s] = True
                        n_main += 1
                    else:
                        victim = s
                        break
            if victim < 0:
                # Evict from M: CLOCK over a FIFO (a counter > 0 buys one more round, one less).
                while True:
                    s = main_walk.next()
                    if s < 0:
                        break
                    if freq[s]:
                        seq = _kernels.s3fifo_requeue(queue, freq, order, s, False, seq)
                    else:
                        victim = s
                        main_mask[s] = False
                        n_main -= 1
                        break
            if victim < 0:
                s = small_walk.next()  # M had no candidate left: take S's tail whatever its count
                if s < 0:
                    break
                small_mask[s] = False
                n_small -= 1
                victim = s
            victims.append(victim)
        st.set_g("s3_seq", seq)
        if victims:
            st.set_g("s3_evicted", 1)
        return np.array(victims, dtype=np.int64)

    def __repr__(self):
        return (f"S3FIFO(small_ratio={self.small_ratio}, ghost_ratio={self.ghost_ratio}, "
                f"move_threshold={self.move_threshold}, max_freq={self.max_freq})")


def _ghost(st, key64s) -> tuple:
    """``s3fifo_miss``'s arguments: the ghost words around the missing keys."""
    w, tk, tr, L, R, cap, shift = st.ghost_args()
    return w, tk, tr, np.ascontiguousarray(key64s, dtype=np.int64), L, R, cap, shift
