"""Damage to a hot segment's derived structures, and how a block call survives it.

The slot table is the truth; the index, the free stack, the pin lists and the policy's state are
derived from it (hot/recovery.py rebuilds them). A damaged word in one of them is found where it is
used (an index out of range, a free-stack entry naming a READY slot, a policy choosing too few
victims) and raised as ``Damage``; the block call that found it scrubs and runs once more, so the
caller sees a miss, never wrong bytes and never the exception.
"""

from __future__ import annotations

import functools

from tieredkv.errors import CorruptState


class Damage(Exception):
    """A derived structure (index, free stack, pin list, policy state) holds a value it cannot hold:
    a damaged word. Never reaches a caller: the call is a miss and the segment is scrubbed."""


#: What policy code raises when its state holds garbage: an index out of range, a size that asks for
#: terabytes, a choice its own checks refuse (``policies.evict`` raises CorruptState).
POLICY_FAULTS = (IndexError, ValueError, RuntimeError, OverflowError, MemoryError, CorruptState)


def survives_damage(method=None, *, user_code: bool = False):
    """Decorator for the block calls: damage to a derived structure found during the call (or a
    numpy IndexError it caused) scrubs the segment, rebuilding everything derived from the slot
    table, and runs the call once more. Damage that a scrub cannot cure is a ``CorruptState``.
    ``user_code``: the call runs a caller's function, whose own IndexError must pass through."""
    if method is None:
        return functools.partial(survives_damage, user_code=user_code)
    caught = (Damage,) if user_code else (Damage, IndexError)

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        self._heal_if_abandoned()
        try:
            result = method(self, *args, **kwargs)
        except caught as e:
            self._repair(e)
            self._retrying = True
            try:
                result = method(self, *args, **kwargs)
            except caught as again:
                raise CorruptState(f"segment {self.name} is damaged beyond what a scrub repairs ({again}); "
                                   f"remove it with `tieredkv rm {self.name}`") from again
            finally:
                self._retrying = False
        if self._index is not None and self._index.damaged:
            self._repair("a damaged index entry")  # the lookup already answered with a miss
        return result

    return guarded
