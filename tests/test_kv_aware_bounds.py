"""benchmarks/kv_aware_bounds.py: the ceilings docs/policies.md quotes for kv_aware rest on its
idealised replay being LRU exactly, its oracles staying under MIN, and its AUC and probation pieces
doing what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tieredkv.sim import Trace, belady, read_trace, simulate
from tieredkv.sim.cli import request_slice

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import kv_aware_bounds as kb  # noqa: E402


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return request_slice(read_trace(BENCHMARKS / "traces" / "mooncake_conversation_trace.jsonl"), ":1500")


def test_the_idealised_replay_with_recency_is_the_simulators_lru(conversation):
    for capacity in (300, 1531, 6126):
        ours = kb.replay(conversation, capacity, lambda at, t: t)
        assert ours == simulate(conversation, "lru", capacity)["block_hit_ratio"]


def test_the_oracles_lie_between_lru_and_min(conversation):
    s = kb.Structure(conversation)
    for capacity, dead_is_min in ((1531, False), (6126, True)):
        lru = simulate(conversation, "lru", capacity)["block_hit_ratio"]
        best = belady(conversation, capacity)["block_hit_ratio"]
        dead = kb.replay(conversation, capacity, lambda at, t: t - kb.BIG * (s.nxt[at] < 0))
        ahead = kb.replay(conversation, capacity, lambda at, t: kb.BIG * s.remaining[at] + t)
        assert lru < dead <= best and lru < ahead <= best
        # At 20% of this slice, knowing which blocks are dead is all MIN knows (the doc's claim).
        assert (dead == best) is dead_is_min


def test_structure_counts_the_accesses_to_come_and_the_known_prefix():
    trace = Trace.from_requests([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6]])
    s = kb.Structure(trace)
    assert s.remaining.tolist() == [3, 2, 1, 2, 1, 0, 1, 0, 0, 0, 0, 0]
    assert s.known.tolist() == [0, 2, 1, 3]
    assert s.nxt[:3].tolist() == [3, 4, 10]


def test_auc():
    y = np.array([False, False, True, True])
    assert kb.auc(np.array([1.0, 2, 3, 4]), y) == 1.0
    assert kb.auc(np.array([4.0, 3, 2, 1]), y) == 0.0
    assert kb.auc(np.ones(4), y) == 0.5
    assert abs(kb._probit(0.8) - 0.8416) < 1e-3


def test_probation_admits_a_chunk_stored_again_from_its_ghost():
    # Capacity 4, a FIFO of 1: chunk 1 is pushed out by 5 (its key goes to the ghosts) and comes
    # back as a miss; stored again, it goes to main, where it outlives four more new chunks.
    trace = Trace.from_requests([[1], [2], [3], [4], [5], [1], [6], [7], [8], [9], [1]])
    hits = kb.probation(trace, 4, small=0.25, ghost=1.0) * trace.n_accesses
    assert hits == 1
    # Without ghosts chunk 1 goes back to the FIFO, and the four new chunks push it out again.
    assert kb.probation(trace, 4, small=0.25, ghost=0.0) == 0.0
