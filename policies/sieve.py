"""SIEVE: a FIFO queue with a visited bit and a hand that does not move blocks."""

from __future__ import annotations

import numpy as np

from . import _jit, _kernels
from .base import EvictionPolicy, register
from .order import OrderCursor


@register
class Sieve(EvictionPolicy):
    """SIEVE: new blocks enter at the queue's head; the hand walks from the tail towards the head,
    clearing visited bits, and evicts the first unvisited block; the hand stays where it stopped and
    wraps to the tail after the head. Unlike CLOCK, survivors keep their place in the queue.

    Y. Zhang, J. Yang, Y. Yue, Y. Vigfusson, K. V. Rashmi, "SIEVE is Simpler than LRU: an Efficient
    Turn-Key Eviction Algorithm for Web Caches", NSDI 2024.

    Layout: queue position is ``sieve_order`` (grows with each insert); the hand is the global
    ``sieve_hand``, an order value: it points at the first block whose order is >= it, so evicting
    the block under the hand moves it on by itself. A hit is one plain store of ``sieve_visited``.
    """

    name = "sieve"
    slot_fields = ("sieve_visited", "sieve_order")
    global_fields = ("sieve_seq", "sieve_hand")

    def on_insert(self, st, slots):
        if _jit.ENABLED:
            st.set_g("sieve_seq", int(_kernels.sieve_insert(st.sieve_visited, st.sieve_order, slots,
                                                            st.g("sieve_seq"))))
            return
        st.sieve_visited[slots] = 0
        end = st.add_g("sieve_seq", len(slots))
        st.sieve_order[slots] = np.arange(end - len(slots), end)

    def on_hit(self, st, slots):
        if _jit.ENABLED:
            _kernels.sieve_hit(st.sieve_visited, slots)
            return
        st.sieve_visited[slots] = 1

    def choose(self, st, n, candidates):
        if _jit.ENABLED:
            victims, hand = _kernels.sieve_choose(st.sieve_visited, st.sieve_order, st.resident, candidates, int(n),
                                                  st.g("sieve_hand"))
            st.set_g("sieve_hand", int(hand))
            return victims
        visited, order = st.sieve_visited, st.sieve_order
        mask = candidates.copy()
        head = int(order[st.resident == 1].max())  # the newest block's order
        hand_at = st.g("sieve_hand")
        hand = OrderCursor(order, mask, start=hand_at)
        fresh = False  # True right after wrapping: an empty walk then means nothing is left
        victims: list[int] = []
        while len(victims) < n:
            s = hand.next()
            if s < 0:
                if fresh:
                    break
                hand, fresh = OrderCursor(order, mask), True  # past the head: wrap to the tail
                continue
            fresh = False
            if visited[s]:
                visited[s] = 0
                continue
            victims.append(s)
            mask[s] = False
            # The hand moves on towards the head; past the head it is "nowhere" and the next
            # eviction starts at the tail (blocks inserted meanwhile are not walked first).
            hand_at = int(order[s]) + 1 if order[s] < head else 0
        st.set_g("sieve_hand", hand_at)
        return np.array(victims, dtype=np.int64)
