"""kv_aware: the per-class reuse odds it learns, the ghost tags they rely on, and what it buys."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tieredkv import policies
from tieredkv.policies.kv_aware import N_SIZE
from tieredkv.policies.state import GHOST_TAG_SHIFT
from tieredkv.sim import Trace, read_trace, simulate

CONVERSATION = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces",
                            "mooncake_conversation_trace.jsonl")


def test_ghost_tags_survive_push_pop_and_compaction():
    policy = policies.make("s3fifo")          # any policy with a ghost list
    st = policies.SlotState.private(policy, 20)
    cap = st.layout.ghost_slots
    keys = np.arange(100, 100 + cap)
    st.ghost_push(keys, 0, tags=keys % 7)
    for k in keys[::2].tolist():               # dead entries, so the next pushes compact the ring
        st.ghost_remove(k)
    more = np.arange(500, 500 + cap)
    st.ghost_push(more, 0, tags=more % 5)
    lists, flags = st.ghost_lookup(np.concatenate([keys, more]))
    live = lists >= 0
    assert live.sum() == cap
    tags = np.concatenate([keys % 7, more % 5])
    assert ((flags[live] >> GHOST_TAG_SHIFT) == tags[live]).all()
    assert (st.ghost_lookup(keys[::2])[0] == -1).all()


def _replay_state(trace: Trace, capacity: int):
    """Replay ``trace`` through kv_aware; return the policy and its state at the end."""
    import tieredkv.sim.replay as replay

    seen = {}
    orig = replay._Cache.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen["st"] = self.st

    replay._Cache.__init__ = spy
    try:
        policy = policies.make("kv_aware")
        result = simulate(trace, policy, capacity)
    finally:
        replay._Cache.__init__ = orig
    return policy, seen["st"], result


def test_learns_that_the_last_chunk_of_a_prompt_is_not_reused():
    """Every request resends the previous one's blocks but its partial last chunk (a conversation)."""
    rng = np.random.default_rng(0)
    requests, sessions, next_id = [], [], 0
    for _ in range(1500):
        if sessions and rng.random() < 0.7:
            i = int(rng.integers(len(sessions)))
            body = sessions[i][:-1] + list(range(next_id, next_id + 3))      # drop the partial chunk
            next_id += 3
            sessions[i] = body
        else:
            body = list(range(next_id, next_id + 6))
            next_id += 6
            sessions.append(body)
        requests.append(body)
    trace = Trace.from_requests(requests)
    policy, st, ours = _replay_state(trace, 300)
    logodds = policy._tables(st)[2].reshape(-1, 2, N_SIZE)   # hits bucket x last x store size
    fresh = logodds[0]
    assert (fresh[1] < fresh[0] - 1).all(), "last chunks should look far less reusable"
    assert ours["block_hit_ratio"] > simulate(trace, "lru", 300)["block_hit_ratio"]


def test_beats_lru_on_a_slice_of_the_conversation_trace():
    full = read_trace(CONVERSATION)
    trace = Trace.from_requests(full.request(i).tolist() for i in range(2000))
    cap = round(0.05 * trace.unique_blocks)
    assert simulate(trace, "kv_aware", cap)["block_hit_ratio"] > simulate(trace, "lru", cap)["block_hit_ratio"]


@pytest.mark.parametrize("bad", [{"horizon_factor": -1}, {"ghost_ratio": -0.5}, {"decay": 0}, {"decay": 1.5},
                                 {"refresh": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        policies.make("kv_aware", **bad)
