"""A policy's choice that breaks ``policies.evict``'s checks is a tieredkv error (``CorruptState``), like
every other error a policy raises, and the hot tier still treats it as damage: a scrub, never a failed
store."""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv import TieredKVError, policies
from tieredkv.errors import CorruptState
from tieredkv.policies.lru import LRU
from tieredkv.policies.state import SlotState


class _NotACandidate(LRU):
    name = "test_not_a_candidate"

    def choose(self, st, n, candidates):
        return np.flatnonzero(~candidates)[:n]  # exactly the slots it may not take


class _TooMany(LRU):
    name = "test_too_many"

    def choose(self, st, n, candidates):
        return np.flatnonzero(candidates)[: n + 1]


def _resident(policy, n_slots=8, n=4):
    st = SlotState.private(policy, n_slots)
    slots = np.arange(n, dtype=np.int64)
    policies.insert(policy, st, slots, slots + 100, np.full(n, -1), np.zeros(n, dtype=np.int64))
    return st


@pytest.mark.parametrize("policy", [_NotACandidate(), _TooMany()], ids=lambda p: p.name)
def test_a_bad_choice_is_a_tieredkv_error(policy):
    st = _resident(policy)
    with pytest.raises(CorruptState, match=policy.name) as info:
        policies.evict(policy, st, 2)
    assert isinstance(info.value, TieredKVError)
    assert int((st.resident == 1).sum()) == 4  # nothing was evicted on a refused choice


def test_the_hot_tier_still_scrubs_on_a_refused_choice():
    from tieredkv.hot.damage import POLICY_FAULTS

    assert issubclass(CorruptState, POLICY_FAULTS)
