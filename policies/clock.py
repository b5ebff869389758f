"""CLOCK (second chance), with an optional n-bit reference counter."""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput

from . import _jit, _kernels
from .base import EvictionPolicy, register
from .order import OrderCursor


@register
class Clock(EvictionPolicy):
    """CLOCK: blocks sit on a circle; the hand evicts the first block whose counter is zero, and
    decrements (gives a second chance to) every block with a non-zero counter that it passes.

    F. J. Corbató, "A paging experiment with the Multics system", MIT Project MAC, 1968. With
    ``bits > 1`` the reference bit becomes a saturating counter (a hit adds one up to 2**bits - 1).

    Layout: the circle is kept as a FIFO order (``clock_order``): the hand stands at the smallest
    order, a passed block gets a new largest order (it goes behind the hand), a new block is put
    just behind the hand. A hit is one plain store of ``clock_ref``.

    Args:
        bits: width of the reference counter (1 = classic CLOCK).
        init_ref: counter of a newly inserted block.
    """

    name = "clock"
    slot_fields = ("clock_ref", "clock_order")
    global_fields = ("clock_seq",)

    def __init__(self, bits: int = 1, init_ref: int = 0):
        if bits < 1:
            raise InvalidInput(f"clock bits must be >= 1, got {bits}")
        self.max_ref = (1 << int(bits)) - 1
        if not 0 <= init_ref <= self.max_ref:
            raise InvalidInput(f"clock init_ref must be in [0, {self.max_ref}], got {init_ref}")
        self.init_ref = int(init_ref)

    def on_insert(self, st, slots):
        if _jit.ENABLED:
            st.set_g("clock_seq", int(_kernels.clock_insert(st.clock_ref, st.clock_order, slots, self.init_ref,
                                                            st.g("clock_seq"))))
            return
        st.clock_ref[slots] = self.init_ref
        end = st.add_g("clock_seq", len(slots))
        st.clock_order[slots] = np.arange(end - len(slots), end)

    def on_hit(self, st, slots):
        if _jit.ENABLED:
            _kernels.saturating_hit(st.clock_ref, slots, self.max_ref)
            return
        st.clock_ref[slots] = np.minimum(st.clock_ref[slots] + 1, self.max_ref)

    def choose(self, st, n, candidates):
        if _jit.ENABLED:
            victims, seq = _jit.clock_choose(st.clock_ref, st.clock_order, candidates, int(n), st.g("clock_seq"))
            st.set_g("clock_seq", int(seq))
            return victims
        ref, order = st.clock_ref, st.clock_order
        mask = candidates.copy()
        hand = OrderCursor(order, mask)
        seq = st.g("clock_seq")
        victims: list[int] = []
        while len(victims) < n:
            s = hand.next()
            if s < 0:
                break
            r = int(ref[s])
            if r:
                ref[s] = r - 1
                order[s] = seq  # passed: now just behind the hand
                seq += 1
            else:
                victims.append(s)
                mask[s] = False
        st.set_g("clock_seq", seq)
        return np.array(victims, dtype=np.int64)

    def __repr__(self):
        return f"Clock(bits={self.max_ref.bit_length()}, init_ref={self.init_ref})"
