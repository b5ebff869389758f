"""Promotion rules: should a block read from the warm tier be copied into the hot tier now?

Each rule answers from the block's warm-tier hit count (including the read being made)::

    from tieredkv.policies import promotion
    rule = promotion.make("on_nth_hit:2")
    rule.should_promote(np.array([1, 2, 5]))   # -> [False, True, True]
"""

from __future__ import annotations

import abc

import numpy as np

from tieredkv.errors import InvalidInput

from .rules import RuleRegistry

_RULES = RuleRegistry("promotion")
register, names, make = _RULES.register, _RULES.names, _RULES.make

__all__ = ["Always", "Never", "OnNthHit", "PromotionRule", "make", "names", "register"]


class PromotionRule(abc.ABC):
    """Base class: override ``should_promote``."""

    name = ""

    @abc.abstractmethod
    def should_promote(self, warm_hits: np.ndarray) -> np.ndarray:
        """Bool per block: promote now. ``warm_hits``: warm-tier hits so far, this one included.

        Answer from the counts alone: a load also asks before it reads (with the counts the read would
        make) whether to keep the bytes for a promotion, and reads the blocks without keeping them when
        none would be promoted.
        """

    def __repr__(self):
        return f"{type(self).__name__}()"


@register
class Always(PromotionRule):
    """Promote every block read from the warm tier (the hot tier then holds what was used last)."""

    name = "always"

    def should_promote(self, warm_hits):
        return np.ones(np.shape(warm_hits), dtype=bool)


@register
class Never(PromotionRule):
    """Never promote: warm hits are served from the warm tier every time."""

    name = "never"

    def should_promote(self, warm_hits):
        return np.zeros(np.shape(warm_hits), dtype=bool)


@register
class OnNthHit(PromotionRule):
    """Promote a block at its N-th warm hit: one-off reads do not push hot blocks out.

    Args:
        n: hits needed (``"on_nth_hit:2"``); 1 behaves like ``always``.
    """

    name = "on_nth_hit"

    def __init__(self, n: int = 2):
        if n < 1:
            raise InvalidInput(f"on_nth_hit needs N >= 1, got {n}")
        self.n = int(n)

    def should_promote(self, warm_hits):
        return np.asarray(warm_hits) >= self.n

    def __repr__(self):
        return f"OnNthHit({self.n})"
