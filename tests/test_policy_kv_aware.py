"""kv_aware: the per-class reuse odds it learns, the ghost tags they rely on, recall from the ghosts,
the horizon learned from reuse times, the prefix-tree rules (superseded branches and stranded blocks
go first), and what it buys."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tieredkv import policies
from tieredkv.policies.kv_aware import CLASS_BITS, HIT_BUCKETS, HIT_STRIDE, N_SIZE, N_START
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
    hits, evicted, logodds = (t.reshape(HIT_BUCKETS, N_START, 2, N_SIZE) for t in policy._tables(st))
    seen = (hits + evicted)[0] > 20          # hits bucket 0: start x last x store size
    both = seen[:, 0, :] & seen[:, 1, :]
    assert both.any()
    fresh = logodds[0]
    assert (fresh[:, 1, :][both] < fresh[:, 0, :][both] - 1).all(), "last chunks should look far less reusable"
    assert ours["block_hit_ratio"] > simulate(trace, "lru", 300)["block_hit_ratio"]


def test_beats_lru_on_a_slice_of_the_conversation_trace():
    full = read_trace(CONVERSATION)
    trace = Trace.from_requests(full.request(i).tolist() for i in range(2000))
    cap = round(0.05 * trace.unique_blocks)
    assert simulate(trace, "kv_aware", cap)["block_hit_ratio"] > simulate(trace, "lru", cap)["block_hit_ratio"]


def test_the_most_observed_class_keeps_lru_order():
    """Log-odds are measured against the most observed class, so its blocks get no shift at all."""
    rng = np.random.default_rng(1)
    trace = Trace.from_requests([rng.integers(0, 400, size=8).tolist() for _ in range(1500)])
    policy, st, _ = _replay_state(trace, 100)
    hits, evicted, logodds = policy._tables(st)
    # The table is recomputed every `refresh` evictions: the counts at the end of a replay may have
    # another most observed class than those the table came from, so recompute it now.
    reference = int(np.argmax(hits + evicted))
    policy._relearn(st)
    assert logodds[reference] == 0.0
    assert (logodds != 0).any()


def _chain(policy, st, slots, keys, parent, start):
    """Insert ``slots`` as one store: a chain under ``parent`` (a slot or -1) at prompt ``start``."""
    slots = np.asarray(slots)
    parents = np.concatenate([[parent], slots[:-1]])
    policies.insert(policy, st, slots, np.asarray(keys), parents, np.arange(start, start + len(slots)))


@pytest.mark.parametrize("supersede", [True, False])
def test_a_superseded_branch_goes_first(supersede):
    """The next turn extends x with a new child: x's older child (the previous turn's partial last
    chunk) goes before older blocks. Without the rule it is plain recency."""
    policy = policies.make("kv_aware", supersede=supersede)
    st = policies.SlotState.private(policy, 10)
    _chain(policy, st, [0, 1], [10, 11], -1, 0)          # other conversation, least recent
    _chain(policy, st, [2, 3, 4], [20, 21, 22], -1, 0)    # r, x, partial last chunk (slot 4)
    policies.hit(policy, st, np.array([2, 3]))
    _chain(policy, st, [5, 6], [23, 24], 3, 2)            # next turn: x gets a second child
    victims = policies.evict(policy, st, 1)
    assert victims.tolist() == ([4] if supersede else [0])


def test_a_block_with_many_children_demotes_none():
    """A shared system prompt has many children (conversations): a new one supersedes nothing."""
    policy = policies.make("kv_aware")
    st = policies.SlotState.private(policy, 10)
    _chain(policy, st, [1], [2], -1, 0)                   # an unrelated, least recent block
    _chain(policy, st, [0], [1], -1, 0)                   # the shared prefix
    _chain(policy, st, [2], [3], 0, 1)
    _chain(policy, st, [3], [4], 0, 1)                    # second child: the first is demoted...
    policies.hit(policy, st, np.array([0, 2, 3]))         # ...until its next hit
    _chain(policy, st, [4], [5], 0, 1)                    # a third child demotes neither
    assert policies.evict(policy, st, 1).tolist() == [1]


@pytest.mark.parametrize("orphans", [True, False])
def test_children_of_an_evicted_block_go_next(orphans):
    policy = policies.make("kv_aware", orphans=orphans)
    st = policies.SlotState.private(policy, 10)
    _chain(policy, st, [0, 1, 2], [1, 2, 3], -1, 0)
    _chain(policy, st, [3, 4], [7, 8], -1, 0)
    policies.hit(policy, st, np.array([1, 2]))            # the chain's tail is now most recent
    assert policies.evict(policy, st, 1).tolist() == [0]  # the least recent: the chain's head
    assert policies.evict(policy, st, 1).tolist() == ([1] if orphans else [3])


@pytest.mark.parametrize("last_first", [True, False])
def test_last_first_demotes_a_stores_fresh_last_chunk(last_first):
    """With ``last_first`` a store's last chunk (a prompt's partial last chunk) goes before older
    blocks; one stored again from its ghost is not demoted. Without it, plain recency."""
    policy = policies.make("kv_aware", last_first=last_first, ghost_ratio=2.0)
    st = policies.SlotState.private(policy, 10)
    _chain(policy, st, [0, 1], [10, 11], -1, 0)           # least recent; slot 1 a last chunk
    _chain(policy, st, [2, 3, 4], [20, 21, 22], -1, 0)    # slot 4 a last chunk
    first = [policies.evict(policy, st, 1).tolist()[0] for _ in range(2)]
    assert first == ([1, 4] if last_first else [0, 1])
    free, back = first
    back_key = 22 if last_first else 10                  # a key now in the ghosts
    _chain(policy, st, [free], [30], -1, 0)              # a fresh last chunk: demoted by the rule
    _chain(policy, st, [back], [back_key], -1, 0)        # recalled from its ghost: not demoted
    then = [policies.evict(policy, st, 1).tolist()[0] for _ in range(2)]
    assert then == ([1, 0] if last_first else [2, 3])


@pytest.mark.parametrize("ghosts", [2.0, 0.0])
def test_a_block_stored_again_from_its_ghost_gets_its_class_back(ghosts):
    """Evicted after one hit, then stored again by a one-block store: with ghosts it comes back in
    its old class one hit up (hits bucket 2), not as the fresh last chunk of its new store."""
    policy = policies.make("kv_aware", ghost_ratio=ghosts)
    st = policies.SlotState.private(policy, 4)
    _chain(policy, st, [0, 1], [10, 11], -1, 0)           # classes 0 and 3: not last / last of a store
    assert st.kv_class[[0, 1]].tolist() == [0, 3]
    policies.hit(policy, st, np.array([0]))               # hits bucket 1: class 0 + HIT_STRIDE
    last_access = int(st.last_access[0])
    only_0 = np.zeros(4, dtype=bool)
    only_0[0] = True
    assert policies.evict(policy, st, 1, only_0).tolist() == [0]
    if ghosts:
        lists, flags = st.ghost_lookup(np.array([10]))
        tag = int(flags[0]) >> GHOST_TAG_SHIFT
        assert lists[0] == 0 and tag == HIT_STRIDE | (last_access << CLASS_BITS)
    successes = policy._tables(st)[0][HIT_STRIDE]
    _chain(policy, st, [0], [10], -1, 0)                  # stored again: a success of its old class
    assert policy._tables(st)[0][HIT_STRIDE] == successes + (1 if ghosts else 0)
    assert st.kv_class[0] == (2 * HIT_STRIDE if ghosts else 3)
    assert st.g("kv_recalled") == (1 if ghosts else 0)
    assert (st.ghost_lookup(np.array([10]))[0] == -1).all()           # its ghost entry is used up


def test_the_store_features_describe_only_what_is_not_recalled():
    """A follow-up whose prefix this cache dropped stores it again with its new chunks: the recalled
    prefix gets its old classes back, and the new chunks are classed as a follow-up's (the store
    starts, for them, at position 3 with 2 chunks), not as a 5-chunk new prompt's."""
    policy = policies.make("kv_aware")
    st = policies.SlotState.private(policy, 8)
    _chain(policy, st, [0, 1, 2], [1, 2, 3], -1, 0)       # a new prompt of 3 chunks: classes 0, 0, 3
    assert sorted(policies.evict(policy, st, 3).tolist()) == [0, 1, 2]
    _chain(policy, st, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5], -1, 0)
    start, size = 1, 0                                    # start bucket of position 3, size bucket of 2
    follow_up = [(start * 2 + last) * N_SIZE + size for last in (0, 1)]
    assert st.kv_class[[0, 1, 2]].tolist() == [HIT_STRIDE, HIT_STRIDE, HIT_STRIDE + 3]
    assert st.kv_class[[3, 4]].tolist() == follow_up


def _conversations(lag: int, n: int = 3000) -> tuple[Trace, int]:
    """Even requests start a conversation of 4 new blocks; odd ones resend the conversation started
    ``lag`` pairs earlier plus 2 new blocks. Returns the trace and the ticks from a conversation's
    start to its follow-up (ticks count block accesses: every pair of requests makes 4 + 6)."""
    requests, convs, next_id = [], [], 0
    for i in range(n):
        if i % 2 == 0:
            convs.append(list(range(next_id, next_id + 4)))
            next_id += 4
            requests.append(convs[-1])
        else:
            c = convs[max(len(convs) - 1 - lag, 0)]
            requests.append(c + [next_id, next_id + 1])
            next_id += 2
    return Trace.from_requests(requests), lag * 10 + 4


def test_the_horizon_is_the_reuse_time_whatever_the_capacity():
    """Stored blocks come back after a fixed time: the learned horizon is horizon_factor x that time at
    a capacity that keeps them (resident hits) and at one that does not (ghost hits), although the
    blocks' ages at eviction differ several times between the two."""
    trace, reuse = _conversations(lag=40)
    for capacity in (120, 900):
        policy, st, _ = _replay_state(trace, capacity)
        assert st.gf("kv_horizon") == pytest.approx(policy.horizon_factor * reuse, rel=0.1), capacity


@pytest.mark.parametrize("bad", [{"horizon_factor": -1}, {"ghost_ratio": -0.5}, {"decay": 0}, {"decay": 1.5},
                                 {"refresh": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        policies.make("kv_aware", **bad)
