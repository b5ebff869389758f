"""Eviction policies: exact victims on hand-made sequences, registry, rules, ghosts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from policy_home import Home
from tieredkv import InvalidInput, policies
from tieredkv.policies import demotion, promotion
from tieredkv.policies.state import SlotState

A, B, C, D, E, F = 1, 2, 3, 4, 5, 6


# ---- exact victims -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, n_slots, seq, victims", [
    # LRU: the hit on A saves it; B, then C, then D are least recently used in turn.
    ("lru", 3, [A, B, C, A, D, E, A, F], [B, C, D]),
    # FIFO: hits change nothing: A goes first although it was just hit, and comes back as a miss.
    ("fifo", 3, [A, B, C, A, D, E, A], [A, B, C]),
    # LFU: C has no hits (A 2, B 1); then D (0 hits) rather than B (1 hit).
    ("lfu", 3, [A, B, C, A, A, B, D, E], [C, D]),
    # CLOCK: A's bit buys it a second chance (moved behind the hand); B, C go; then A, bit spent.
    ("clock", 3, [A, B, C, A, D, E, F], [B, C, A]),
    # SIEVE: same start as CLOCK, but the hand stays past A, so D (not A) goes third.
    ("sieve", 3, [A, B, C, A, D, E, F], [B, C, D]),
    # ARC, c=2: B from T1 (p=0); B returns from B1 (p=1) so A goes from T2; A returns from B2 (p=0)
    # so C goes from T1; D is new and T1 is empty, so B goes from T2.
    ("arc", 2, [A, B, A, C, B, A, D], [B, A, C, B]),
])
def test_exact_victims(name, n_slots, seq, victims):
    assert Home(name, n_slots).run(seq) == victims


def test_s3fifo_exact_victims():
    # 10 slots: S holds 1, M 9, G 9. While nothing was evicted, a full S sends new keys to M.
    h = Home("s3fifo", 10)
    h.run(range(1, 11))
    assert h.run([11, 12]) == [1, 11]            # S's tail (never hit) leaves for G each time
    assert h.run([1]) == [1, 11, 12]             # 1 is in G: it enters M; S's 12 made the room
    assert h.run([13]) == [1, 11, 12, 2]         # M now over its share: its tail 2 (no hits) goes
    h.run([13, 13, 4])                           # 13 hit twice in S, 4 once in M
    assert h.run([14]) == [1, 11, 12, 2, 3]      # 13 moves to M instead of leaving; M's tail 3 goes
    assert h.run([15]) == [1, 11, 12, 2, 3, 14]
    assert h.run([12]) == [1, 11, 12, 2, 3, 14, 15]  # 12 back from G into M; S's 15 goes
    # M over its share: 4 (hit once) is reinserted with its counter spent, 5 goes instead.
    assert h.run([16]) == [1, 11, 12, 2, 3, 14, 15, 5]


def test_prefix_aware_evicts_leaves_first():
    # A <- B <- C is one prompt's chain, D another prompt. A is hit, so LRU order is B, C, D, A.
    def fill(name, batch):
        h = Home(name, 4)
        h.insert([A, B, C], parents=[None, A, B], positions=[0, 1, 2])
        h.insert([D])
        h.access(A)
        if batch:
            h.insert([E, F])
        else:
            h.insert([E]), h.insert([F])
        return h.victims

    assert fill("lru", False) == [B, C]                  # strands C: its parent B is gone first
    assert fill("prefix_aware", False) == [C, B]         # leaves only: C, then B (now a leaf)
    assert fill("prefix_aware:fifo", False) == [C, B]
    # One eviction call for two victims picks among the leaves of the moment: C and D.
    assert fill("prefix_aware", True) == [C, D]


def test_prefix_aware_climbs_a_chain_when_leaves_run_out():
    h = Home("prefix_aware:s3fifo", 3)
    h.insert([A, B, C], parents=[None, A, B], positions=[0, 1, 2])
    assert h.insert([D, E, F]) == [C, B, A]


def test_cost_aware_keeps_deep_and_hot_blocks():
    h = Home(policies.make("cost_aware", position_weight=1 / 64), 3)
    h.insert([A]), h.insert([B], positions=[63]), h.insert([C])
    # value: A 1, B 1 + 63/64, C 1 -> A and C tie, A is older.
    assert h.insert([D]) == [A]
    h.access(C)                                  # C: L(1) + 2 * 1 = 3; D: L(1) + 1 = 2
    assert h.insert([E]) == [B]                  # B (1.98) is now the cheapest
    assert h.insert([F]) == [D]


def test_cost_aware_formula():
    p = policies.make("cost_aware", position_weight=0.5)
    assert p.cost(np.array([0, 2])).tolist() == [1.0, 2.0]


# ---- registry and rules ----------------------------------------------------------------------------
def test_unknown_policy_lists_valid_names():
    with pytest.raises(policies.UnknownPolicy) as e:
        policies.make("lru2")
    for name in ("lru", "s3fifo", "arc", "prefix_aware", "cost_aware"):
        assert name in str(e.value)
    with pytest.raises(policies.UnknownPolicy):
        policies.make("prefix_aware:nope")


def test_registry_has_every_policy():
    assert set(policies.names()) >= {"lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc",
                                     "prefix_aware", "cost_aware"}
    assert policies.make("prefix_aware").base.name == "lru"
    assert policies.make("prefix_aware:arc").base.name == "arc"
    assert policies.make("s3fifo", small_ratio=0.2).small_ratio == 0.2
    with pytest.raises(InvalidInput, match="takes no parameters"):
        policies.make("lru", bogus=1)


def test_promotion_rules():
    hits = np.array([1, 2, 3])
    assert promotion.make("always").should_promote(hits).tolist() == [True] * 3
    assert promotion.make("never").should_promote(hits).tolist() == [False] * 3
    assert promotion.make("on_nth_hit:2").should_promote(hits).tolist() == [False, True, True]
    assert set(promotion.names()) == {"always", "never", "on_nth_hit"}
    with pytest.raises(policies.UnknownPolicy, match="always, never, on_nth_hit"):
        promotion.make("sometimes")
    with pytest.raises(ValueError):
        promotion.make("on_nth_hit:x")


def test_demotion_rules():
    hits = np.array([0, 1, 3])
    on_evict, wt, nth = (demotion.make(n) for n in ("on_evict", "write_through", "on_nth_hit:1"))
    assert (on_evict.at_store, wt.at_store, nth.at_store) == (False, True, False)
    assert on_evict.should_demote(hits).tolist() == [True] * 3
    assert wt.should_demote(hits).tolist() == [False] * 3
    assert nth.should_demote(hits).tolist() == [False, True, True]
    with pytest.raises(policies.UnknownPolicy, match="on_evict, on_nth_hit, write_behind, write_through"):
        demotion.make("lazy")


# ---- ghosts -------------------------------------------------------------------------------------
def test_ghost_lists_match_a_reference_model():
    class P:
        slot_fields, global_fields, ghost_lists = (), (), 2

        def ghost_capacity(self, n):
            return n

    cap = 16
    st = SlotState.private(P(), cap)
    rng = random.Random(3)
    model = [[], []]
    for step in range(6000):
        key, lst, op = rng.randrange(60), rng.randrange(2), rng.random()
        if op < 0.55:
            st.ghost_push([key], lst)
            for m in model:
                if key in m:
                    m.remove(key)
            model[lst].append(key)
            if len(model[lst]) > cap:
                model[lst].pop(0)
        elif op < 0.85:
            expect = next((i for i, m in enumerate(model) if key in m), -1)
            if expect >= 0:
                model[expect].remove(key)
            assert st.ghost_remove(key) == expect
        else:
            assert st.ghost_pop(lst) == (model[lst].pop(0) if model[lst] else None)
        assert [st.ghost_len(i) for i in (0, 1)] == [len(m) for m in model]
        if step % 97 == 0:
            keys = np.arange(60)
            expect = [0 if k in model[0] else 1 if k in model[1] else -1 for k in range(60)]
            assert st.ghost_lookup(keys)[0].tolist() == expect
            assert [st.ghost_find(k)[0] for k in range(60)] == expect
