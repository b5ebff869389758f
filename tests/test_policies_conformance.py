"""One conformance suite for every eviction policy in the registry.

A random workload (chained inserts, hits, explicit removes, pinned slots) checks after every call
that a policy only evicts candidates, returns distinct resident slots, keeps ``n_resident`` exact,
and decides identically over a shared buffer (``SlotState.over``) and in private memory.
"""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv import policies
from tieredkv.policies import StateLayout

NAMES = policies.names() + ["prefix_aware:s3fifo", "prefix_aware:arc", "prefix_aware:clock"]
N_SLOTS = 24


def _workload(name: str, *, buffer=None, seed: int = 0, steps: int = 400):
    """Drive ``name`` through a seeded random workload; return (victim lists, final state arrays)."""
    policy = policies.make(name)
    if buffer is None:
        st = policies.SlotState.private(policy, N_SLOTS)
    else:
        st = policies.SlotState.over(policy, N_SLOTS, buffer, 64)
        st.reset()
    prefix = name.startswith("prefix_aware")
    rng = np.random.default_rng(seed)
    slot_of: dict[int, int] = {}
    key_at: dict[int, int] = {}
    free = list(range(N_SLOTS))
    next_key = 1
    log = []
    for _ in range(steps):
        op = rng.random()
        resident = sorted(slot_of.values())
        if op < 0.55 or not resident:
            # A chain of new blocks, under a random resident parent (or a new root).
            k = int(rng.integers(1, 6))
            keys = list(range(next_key, next_key + k))
            next_key += k
            evictable = rng.random(N_SLOTS) > 0.2          # some slots pinned
            need = k - len(free)
            parent_before = np.where(st.resident == 1, st.parent, -1)
            candidates = (st.resident == 1) & evictable
            victims = policies.evict(policy, st, need, evictable, incoming=np.array(keys))
            # -- checks on every eviction
            assert len(set(victims.tolist())) == len(victims), "a slot chosen twice"
            assert candidates[victims].all(), "evicted a non-candidate (pinned or free slot)"
            assert (st.resident[victims] == 0).all()
            if prefix:
                # Never strand a block: every child a victim had before the call went in the same
                # call, before it (leaves first).
                order = {v: i for i, v in enumerate(victims.tolist())}
                for v in victims.tolist():
                    for kid in np.flatnonzero(parent_before == v).tolist():
                        assert kid in order and order[kid] < order[v], "evicted a block with a resident child"
                assert len(victims) <= max(need, 0)
            else:
                assert len(victims) == min(max(need, 0), int(candidates.sum()))
            for v in victims.tolist():
                del slot_of[key_at.pop(v)]
            free.extend(victims.tolist())
            log.append(("evict", victims.tolist()))
            keys = keys[:len(free)]
            if keys:
                slots = [free.pop() for _ in keys]
                parent = slot_of[int(rng.choice(list(slot_of)))] if slot_of and rng.random() < 0.7 else -1
                parents = [parent] + slots[:-1]
                for key, s in zip(keys, slots):
                    slot_of[key], key_at[s] = s, key
                policies.insert(policy, st, np.array(slots), np.array(keys), np.array(parents),
                                np.arange(len(keys)))
        elif op < 0.9:
            hits = rng.choice(resident, size=min(len(resident), int(rng.integers(1, 4))), replace=False)
            policies.hit(policy, st, hits)
        else:
            s = int(rng.choice(resident))
            policies.remove(policy, st, np.array([s]))
            del slot_of[key_at.pop(s)]
            free.append(s)
            log.append(("remove", s))
        # -- invariants after every call
        assert st.g("n_resident") == int(st.resident.sum()) == len(slot_of)
        assert sorted(np.flatnonzero(st.resident).tolist()) == sorted(slot_of.values())
        live = st.resident == 1
        counted = np.bincount(st.parent[live & (st.parent >= 0)], minlength=N_SLOTS)
        assert (st.n_children[live] == counted[live]).all(), "n_children out of step with parent links"
    arrays = {f: getattr(st, f).copy() for f in st.layout.slot_fields}
    return log, arrays


@pytest.mark.parametrize("name", NAMES)
def test_conformance(name):
    log, _ = _workload(name)
    assert any(kind == "evict" and v for kind, v in log), "the workload never evicted"


@pytest.mark.parametrize("name", NAMES)
def test_shared_buffer_decides_like_private(name):
    private_log, private_arrays = _workload(name, seed=1)
    layout = StateLayout.for_policy(policies.make(name), N_SLOTS)
    shared = bytearray(layout.nbytes + 128)
    shared_log, shared_arrays = _workload(name, buffer=shared, seed=1)
    assert shared_log == private_log
    for field, arr in private_arrays.items():
        assert np.array_equal(shared_arrays[field], arr), field


@pytest.mark.parametrize("name", NAMES)
def test_over_attaches_to_existing_state(name):
    """A second view over the same bytes (another process's mapping) sees the first one's state."""
    policy = policies.make(name)
    layout = StateLayout.for_policy(policy, 8)
    buf = bytearray(layout.nbytes)
    a = policies.SlotState.over(policy, 8, buf, 0)
    a.reset()
    policies.insert(policy, a, np.arange(8), np.arange(100, 108), np.full(8, -1), np.zeros(8, dtype=np.int64))
    policies.hit(policy, a, np.array([0, 1]))
    b = policies.SlotState.over(policy, 8, buf, 0)
    assert b.g("n_resident") == 8
    got = policies.evict(policy, b, 2)
    assert len(got) == 2 and (a.resident[got] == 0).all()


def test_custom_policy_registers_in_a_few_lines():
    @policies.register
    class MostRecentlyUsed(policies.EvictionPolicy):
        name = "test_mru"

        def choose(self, st, n, candidates):
            slots = np.flatnonzero(candidates)
            return slots[np.argsort(-st.last_access[slots])][:n]

    try:
        assert "test_mru" in policies.names()
        st = policies.SlotState.private(policies.make("test_mru"), 3)
        p = policies.make("test_mru")
        policies.insert(p, st, np.arange(3), np.arange(3), np.full(3, -1), np.zeros(3, dtype=np.int64))
        assert policies.evict(p, st, 1).tolist() == [2]
    finally:
        from tieredkv.policies import base
        base._REGISTRY.pop("test_mru", None)
