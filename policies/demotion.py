"""Demotion (admission to the warm tier) rules: when does a hot block get written to SSD?

A rule answers two questions: ``at_store`` (write every block to warm when it is stored in hot:
needed for full cold-start recovery; ``background`` says whether that write runs off the request's
path) and ``should_demote(hot_hits)`` (of the blocks just evicted from hot, which to write to warm)::

    from tieredkv.policies import demotion
    rule = demotion.make("on_nth_hit:2")
    rule.at_store, rule.should_demote(np.array([0, 1, 3]))   # -> False, [False, False, True]
"""

from __future__ import annotations

import abc

import numpy as np

from tieredkv.errors import InvalidInput

from .rules import RuleRegistry

_RULES = RuleRegistry("demotion")
register, names, make = _RULES.register, _RULES.names, _RULES.make

__all__ = ["DemotionRule", "OnEvict", "OnNthHit", "WriteBehind", "WriteThrough", "make", "names", "register"]


class DemotionRule(abc.ABC):
    """Base class: set ``at_store`` and override ``should_demote``."""

    name = ""
    #: Write each block to the warm tier as soon as it is stored in the hot tier.
    at_store: bool = False
    #: With ``at_store``: queue that write for a background thread instead of making it before
    #: ``store`` returns (the simulator makes the same decisions either way).
    background: bool = False

    @abc.abstractmethod
    def should_demote(self, hot_hits: np.ndarray) -> np.ndarray:
        """Bool per block evicted from hot: write it to warm. ``hot_hits``: its hits while hot."""

    def __repr__(self):
        return f"{type(self).__name__}()"


@register
class OnEvict(DemotionRule):
    """Write a block to warm when the hot tier evicts it (the classic exclusive two-level cache)."""

    name = "on_evict"

    def should_demote(self, hot_hits):
        return np.ones(np.shape(hot_hits), dtype=bool)


@register
class WriteThrough(DemotionRule):
    """Write every block to warm at store time; evictions then need no write (already there)."""

    name = "write_through"
    at_store = True

    def should_demote(self, hot_hits):
        return np.zeros(np.shape(hot_hits), dtype=bool)


@register
class WriteBehind(WriteThrough):
    """Like write-through, but the warm write runs on a background thread from a bounded queue:
    ``store`` returns once the block is in hot. A full queue drops the warm write (counted); a clean
    close flushes the queue; a killed process loses at most what was queued."""

    name = "write_behind"
    background = True


@register
class OnNthHit(DemotionRule):
    """On eviction, write to warm only blocks hit at least N times while hot: spares the SSD the
    one-off blocks (as NVIDIA Dynamo's KV block manager does for offload).

    Args:
        n: hits needed (``"on_nth_hit:2"``).
    """

    name = "on_nth_hit"

    def __init__(self, n: int = 1):
        if n < 0:
            raise InvalidInput(f"on_nth_hit needs N >= 0, got {n}")
        self.n = int(n)

    def should_demote(self, hot_hits):
        return np.asarray(hot_hits) >= self.n

    def __repr__(self):
        return f"OnNthHit({self.n})"
