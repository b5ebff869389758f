"""benchmarks/kv_aware_ideas.py: the ideas docs/policies.md reports as not closing the gap must be
measured fairly: their features use the past only, a zero shift is LRU, and the LHD prototype stays
between nothing and MIN."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tieredkv.sim import Trace, belady, read_trace
from tieredkv.sim.cli import request_slice

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import kv_aware_bounds as kb  # noqa: E402
import kv_aware_ideas as ki  # noqa: E402


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return request_slice(read_trace(BENCHMARKS / "traces" / "mooncake_conversation_trace.jsonl"), ":600")


def test_the_features_use_only_the_past(conversation):
    """An access's features do not change when the requests after it are cut off."""
    short = request_slice(conversation, ":300")
    full = ki.features(conversation, kb.Structure(conversation))
    cut = ki.features(short, kb.Structure(short))
    n = short.n_accesses
    assert set(full) == set(cut)
    for name in full:
        assert np.array_equal(full[name][:n], cut[name]), name


def test_features_on_a_small_tree():
    trace = Trace.from_requests([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6]])
    f = ki.features(trace, kb.Structure(trace))
    # Block 2 has had children 3, then 3 and 4; block 1 children 2, then 2 and 5.
    assert np.exp(f["children"]).round().astype(int).tolist() == [2, 2, 1, 2, 3, 1, 3, 1, 3, 3, 2, 1]
    assert f["fork"].tolist() == [0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 0, 0]
    assert f["not last"].tolist() == [1, 1, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0]
    # Frequency counts accesses so far, evictions or not; the root's popularity is block 1's.
    assert np.exp(f["frequency"]).round().astype(int).tolist() == [1, 1, 1, 2, 2, 1, 3, 1, 4, 3, 2, 1]
    assert np.exp(f["root popularity"]).round().astype(int).tolist() == [1] * 3 + [2] * 3 + [3] * 2 + [4] * 4


def test_a_zero_shift_is_lru_and_the_gap_is_measured_against_it(conversation):
    split = ki.Split(conversation)
    assert split.gap("children", 0.0, 1000) == 0.0
    assert -5 < split.gap("not last", 1.0, 1000) <= 1.0


def test_lhd_lies_between_nothing_and_min(conversation):
    for capacity in (300, 3000):
        ours = ki.lhd(conversation, capacity)
        assert 0 < ours <= belady(conversation, capacity)["block_hit_ratio"]
    # With room for every block nothing is evicted: every repeated access hits.
    repeats = 1 - conversation.unique_blocks / conversation.n_accesses
    assert ki.lhd(conversation, conversation.unique_blocks) == pytest.approx(repeats)
