"""The probe table's batch calls (insert_many, delete_many, positions_of) against a dict model.

Small signed keys in a 64-entry table give long runs, wrap-around at the end and holes inside runs;
keys need not be unique (the hot index keys by one word of a 128-bit key), so the model is a multiset
of (key, value) pairs.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tieredkv.hashtable import ProbeTable

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

batches = st.lists(st.tuples(st.sampled_from(["insert", "delete", "scalar_delete"]),
                             st.lists(st.integers(-40, 40), min_size=1, max_size=12)), max_size=25)


def _check(table: ProbeTable, model: list[tuple[int, int]]) -> None:
    probe = np.arange(-45, 46, dtype=np.int64)
    for k in probe.tolist():
        assert sorted(table.values_of(k)) == sorted(v for mk, v in model if mk == k)
    # lookup answers one of the key's values (the first in its run), or -1
    got = table.lookup(probe).tolist()
    for k, v in zip(probe.tolist(), got):
        values = [mv for mk, mv in model if mk == k]
        assert (v in values) if values else v == -1
    assert int(np.count_nonzero(table.refs)) == len(model)
    pairs = np.array(model, dtype=np.int64).reshape(-1, 2)
    pos = table.positions_of(pairs[:, 0], pairs[:, 1])
    assert (pos >= 0).all() and len(set(pos.tolist())) == len(model)
    assert (table.keys[pos] == pairs[:, 0]).all() and (table.refs[pos] == pairs[:, 1] + 1).all()


@FAST
@given(ops=batches)
def test_batch_calls_match_a_multiset_model(ops):
    table = ProbeTable(np.zeros(64, np.int64), np.zeros(64, np.int64))
    model: list[tuple[int, int]] = []
    value = 0
    for op, keys in ops:
        if op == "insert":
            keys = keys[: max(0, 40 - len(model))]
            values = list(range(value, value + len(keys)))
            value += len(keys)
            assert table.insert_many(np.array(keys, np.int64), np.array(values, np.int64))
            model += list(zip(keys, values))
        else:
            # delete the model's pairs whose key is listed (some keys listed are absent: skipped),
            # plus a pair that was never there (a key with a value nobody stored)
            gone = [(k, v) for k, v in model if k in keys]
            ask = gone + [(keys[0], 10_000)]
            if op == "delete":
                removed = table.delete_many(np.array([k for k, _ in ask], np.int64),
                                            np.array([v for _, v in ask], np.int64))
                assert removed == len(gone)
            else:  # the scalar path and the batch path must keep one table
                for k, v in gone:
                    table.delete_at(table.find_value(k, v))
            model = [p for p in model if p not in gone]
        _check(table, model)


def test_insert_many_reports_a_full_table():
    table = ProbeTable(np.zeros(8, np.int64), np.zeros(8, np.int64))
    assert not table.insert_many(np.arange(10, dtype=np.int64), np.arange(10, dtype=np.int64))
    assert int(np.count_nonzero(table.refs)) == 8


def test_delete_many_keeps_entries_whose_run_wraps_the_end():
    """Entries homed near the end of the table spill over to its start; deleting one before them must
    leave every one reachable."""
    table = ProbeTable(np.zeros(16, np.int64), np.zeros(16, np.int64))
    last = next(k for k in range(1, 10_000) if table.home(k) == 15)
    same_home = [k for k in range(1, 200_000) if table.home(k) == 15][:5]
    assert last == same_home[0]
    assert table.insert_many(np.array(same_home, np.int64), np.arange(5, dtype=np.int64))
    assert table.delete_many(np.array(same_home[:1], np.int64), np.array([0], np.int64)) == 1
    assert table.lookup(np.array(same_home, np.int64)).tolist() == [-1, 1, 2, 3, 4]
    assert int(np.count_nonzero(table.refs)) == 4
