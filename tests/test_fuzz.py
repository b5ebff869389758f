"""Property tests (keys, block layout, the hot tier's index against a dict model) and random bytes in
every persistent structure: segment header, slot records, meta.json, LMDB files.

Risky opens run in a child process: whatever the bytes, the child must exit normally (a refusal is a
``TieredKVError``), never die of SIGSEGV / SIGBUS, and never hand out a block whose bytes are wrong.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tieredkv import CorruptState, FormatError, HotTier, KVSpec, PutResult, chunk_keys
from tieredkv.hashtable import ProbeTable
from tieredkv.hot import segment as seg
from tieredkv.keys import ChunkKeys, root_key
from tieredkv.layout import as_block_bytes, block_view
from tieredkv.warm.testing import payload_for

SPEC = KVSpec(model_id="test/fuzz", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- keys -----------------------------------------------------------------------------------------
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@FAST
@given(tokens=token_lists, salt=st.binary(max_size=8), cut=st.integers(0, 10))
def test_keys_chain_prefix_and_parents(tokens, salt, cut):
    k = chunk_keys(SPEC, tokens, salt)
    C = SPEC.chunk_tokens
    assert len(k) == len(tokens) // C
    assert k.keys.dtype == np.uint64 and k.keys.shape == (len(k), 2)
    # A prefix's keys are the leading keys of the whole prompt (same chain, nothing else mixed in).
    short = chunk_keys(SPEC, tokens[: cut * C], salt)
    assert np.array_equal(short.keys, k.keys[: len(short)])
    # Each key's parent is the key before it; the first's is the (namespace, salt) root.
    if len(k):
        assert k.parents[0].tobytes() == root_key(SPEC, salt)
        assert np.array_equal(k.parents[1:], k.keys[:-1])
        assert np.array_equal(k.tokens.ravel(), np.asarray(tokens[: len(k) * C], dtype=np.uint32))
    # Pure function of its inputs.
    assert np.array_equal(chunk_keys(SPEC, np.asarray(tokens, dtype=np.uint64), salt).keys, k.keys)


@FAST
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=40), data=st.data())
def test_changing_one_token_changes_that_chunk_and_every_later_key_only(tokens, data):
    C = SPEC.chunk_tokens
    k = chunk_keys(SPEC, tokens)
    pos = data.draw(st.integers(0, len(k) * C - 1))
    changed = list(tokens)
    changed[pos] = (changed[pos] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    k2 = chunk_keys(SPEC, changed)
    j = pos // C
    assert np.array_equal(k.keys[:j], k2.keys[:j])
    assert not (k.keys[j:] == k2.keys[j:]).all(axis=1).any()


@FAST
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=24),
       a=st.binary(max_size=6), b=st.binary(max_size=6))
def test_different_salts_share_no_key(tokens, a, b):
    if a == b:
        return
    ka, kb = chunk_keys(SPEC, tokens, a), chunk_keys(SPEC, tokens, b)
    sa = {r.tobytes() for r in ka.keys}
    assert not sa & {r.tobytes() for r in kb.keys}


# ---- block layout ---------------------------------------------------------------------------------
@FAST
@given(layers=st.integers(1, 3), heads=st.integers(1, 3), dim=st.integers(1, 8), chunk=st.integers(1, 5),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8"]), n=st.integers(0, 4),
       seed=st.integers(0, 2**16))
def test_block_bytes_roundtrip(layers, heads, dim, chunk, dtype, n, seed):
    spec = KVSpec(model_id="m", num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype,
                  chunk_tokens=chunk)
    assert spec.block_bytes == layers * 2 * heads * chunk * dim * spec.dtype_bytes
    raw = np.random.default_rng(seed).integers(0, 256, (n, spec.block_bytes), dtype=np.uint8)
    typed = block_view(spec, raw)
    assert typed.shape == (n, *spec.block_shape)
    # [layer][K,V][head][token][dim], C order: element (l, kv, h, t, d) sits at that flat offset.
    if n:
        idx = (n - 1, layers - 1, 1, heads - 1, chunk - 1, dim - 1)
        flat = np.ravel_multi_index(idx[1:], spec.block_shape)
        assert typed[idx].tobytes() == raw[n - 1, flat * spec.dtype_bytes:(flat + 1) * spec.dtype_bytes].tobytes()
    back = as_block_bytes(spec, typed, n)
    assert back.tobytes() == raw.tobytes()
    assert np.shares_memory(back, raw) or n == 0


# ---- the hot tier's index against a dict model ----------------------------------------------------------
UNIVERSE = 24


def forged_keys(ids) -> ChunkKeys:
    """Keys whose low words collide in 4 index positions (long probe runs, deletions in the middle shift entries back);
    the high word keeps them distinct. Tiers confirm parents and tokens, which we keep consistent."""
    ids = np.asarray(ids, dtype=np.uint64)
    keys = np.stack([ids % np.uint64(4), ids + np.uint64(1)], axis=1)
    parents = np.stack([ids, ids], axis=1)
    tokens = np.repeat(ids.astype(np.uint32)[:, None], SPEC.chunk_tokens, axis=1)
    return ChunkKeys(keys, parents, tokens)


ops = st.lists(st.tuples(st.sampled_from(["put", "put", "remove", "get", "evict"]),
                         st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=5)), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=ops)
def test_hot_index_matches_a_dict_model(sequence):
    name = f"/tieredkv-test-fuzz-{os.getpid()}-{secrets.token_hex(4)}"
    model: dict[int, bytes] = {}
    all_keys = forged_keys(range(UNIVERSE))
    # 32 slots for 24 keys: nothing is evicted unless asked, so the model is exact.
    tier = HotTier(SPEC, n_slots=32, name=name)
    try:
        for op, ids in sequence:
            k = forged_keys(ids)
            if op == "put":
                codes = tier.put_many(k, payload_for(k, SPEC.block_bytes))
                seen = set()
                for i, c in zip(ids, codes):
                    want = PutResult.EXISTS if (i in model or i in seen) else PutResult.STORED
                    assert c == want
                    seen.add(i)
                for i in ids:
                    model[i] = b""
            elif op == "remove":
                assert tier.remove(k) == len(set(ids) & set(model))
                for i in ids:
                    model.pop(i, None)
            elif op == "evict":
                ev = tier.evict(len(ids))
                gone = (ev.keys.keys[:, 1] - np.uint64(1)).tolist()
                assert len(gone) == min(len(ids), len(model)) and set(gone) <= set(model)
                assert np.array_equal(ev.payloads, payload_for(ev.keys, SPEC.block_bytes))
                for i in gone:
                    del model[i]
            else:
                out = np.zeros((len(ids), SPEC.block_bytes), np.uint8)
                n = tier.get_many(k, out)
                lead = 0
                while lead < len(ids) and ids[lead] in model:
                    lead += 1
                assert n == lead
                assert np.array_equal(out[:n], payload_for(k[:n], SPEC.block_bytes))
            assert tier.contains_many(all_keys).tolist() == [i in model for i in range(UNIVERSE)]
        census = tier.slot_census()
        assert census["ready"] == len(model) and census["free"] == 32 - len(model)
    finally:
        tier.close()
        posix_ipc.unlink_shared_memory(name)


# ---- the fixes this file found ---------------------------------------------------------------------
@pytest.mark.parametrize("field", seg._GEOMETRY[1:-1])  # n_slots and total_bytes: checked before
def test_damaged_geometry_field_is_a_format_error(seg_name, field):
    """Regression: a damaged offset or size in the header used to surface as a numpy ValueError,
    OverflowError or IndexError (or a view into the wrong region) instead of a clear refusal; a
    damaged chunk_tokens opened fine and then broke every lookup with a broadcasting ValueError."""
    with HotTier(SPEC, n_slots=16, name=seg_name) as t:
        t._map.header[field] = int(t._map.header[field]) + 8
    if field == "policy_bytes":
        with pytest.raises(CorruptState, match="policy state size"):
            HotTier(SPEC, n_slots=16, name=seg_name)
        return
    with pytest.raises(FormatError, match=r"(damaged|inconsistent) header"):
        HotTier(SPEC, n_slots=16, name=seg_name)


def test_unknown_policy_name_in_header_is_a_format_error(seg_name):
    with HotTier(SPEC, n_slots=16, name=seg_name) as t:
        t._map.header["policy"] = b"\xff\xfe"
    with pytest.raises(FormatError, match="damaged header"):
        HotTier(SPEC, n_slots=16, name=seg_name, policy=None)
    posix_ipc.unlink_shared_memory(seg_name)
    with HotTier(SPEC, n_slots=16, name=seg_name) as t:
        t._map.header["policy"] = b"from-the-future"
    with pytest.raises(FormatError, match="does not know"):
        HotTier(SPEC, n_slots=16, name=seg_name, policy=None)


@pytest.mark.parametrize("owner", [200, 2**63])
def test_slot_record_with_impossible_owner_is_recovered(seg_name, owner):
    """Regression: a WRITING slot naming an owner index past the owner table made every recovery raise
    IndexError / OverflowError; recovery runs inside the lock and leaves the segment marked dirty, so
    the segment was wedged for every process. Now the slot is treated as abandoned and freed."""
    with HotTier(SPEC, n_slots=8, name=seg_name) as t:
        k = chunk_keys(SPEC, np.arange(32))
        t.put_many(k, payload_for(k, SPEC.block_bytes))
        t._slots["state"][3] = seg.WRITING
        t._slots["owner"][3] = owner
        assert t.slot_census()["writing_dead"] == 1
        t.recover()
        assert t.slot_census() == {"capacity": 8, "free": 1, "ready": 7, "writing_live": 0, "writing_dead": 0,
                                   "pinned": 0}
        out = np.zeros((8, SPEC.block_bytes), np.uint8)
        n = t.get_many(k, out)
        assert n == 3 and np.array_equal(out[:3], payload_for(k[:3], SPEC.block_bytes))
        assert (t.put_many(k, payload_for(k, SPEC.block_bytes)) == PutResult.STORED).sum() == 1


# ---- random bytes in a segment, opened in a child process ---------------------------------------------
_HOT_CHILD = r"""
import json, sys, traceback, numpy as np, posix_ipc
from tieredkv import HotTier, KVSpec, TieredKVError, chunk_keys
from tieredkv.hot import segment as seg
from tieredkv.warm.testing import payload_for
spec = KVSpec(model_id="test/fuzz", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
name, region, seed, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(seed)
k = chunk_keys(spec, np.arange(64))
good = payload_for(k, spec.block_bytes)
out = {"ok": 0, "refused": 0, "other": [], "wrong": 0}
for case in range(cases):
    t = HotTier(spec, n_slots=16, name=name)
    t.put_many(k, good)
    base = 0 if region == "header" else int(t._map.header["slots_off"])
    span = 8 * 26 if region == "header" else 16 * seg.SLOT_DTYPE.itemsize
    n = int(rng.integers(1, 48))
    off = base + int(rng.integers(0, span))
    t._map.mm[off:off + n] = rng.bytes(n)
    t._drop_mapping()  # leave without cleaning up, as a crashed process would
    try:
        t2 = HotTier(spec, n_slots=16, name=name)
        try:
            buf = np.zeros((16, spec.block_bytes), np.uint8)
            for step in range(2):
                got = t2.get_many(k, buf)
                out["wrong"] += int(not np.array_equal(buf[:got], good[:got]))
                t2.put_many(k, good)
                t2.recover()
            c = t2.slot_census()
            assert c["free"] + c["ready"] + c["writing_live"] == c["capacity"], c
            out["ok"] += 1
        finally:
            t2.close()
    except TieredKVError:
        out["refused"] += 1
    except Exception:
        out["other"].append(traceback.format_exc(limit=3))
    posix_ipc.unlink_shared_memory(name)
print(json.dumps(out))
"""


def _run_child(script, *args, timeout=120):
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode not in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT), r.stderr[-2000:]
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.procs
@pytest.mark.parametrize("region", ["header", "slots"])
def test_random_bytes_in_segment_header_and_slot_records(seg_name, region):
    """150 cases per region: random bytes at a random place of the header (magic, version, geometry,
    counters, dirty flag, fingerprint) or of the slot table, left as a crashed process would."""
    res = _run_child(_HOT_CHILD, seg_name, region, 7 if region == "header" else 8, 150)
    print(region, {k: v for k, v in res.items() if k != "other"})
    assert res["other"] == [], res["other"][:2]
    assert res["wrong"] == 0
    assert res["ok"] + res["refused"] == 150
    if region == "slots":
        assert res["refused"] == 0  # slot records are repaired (recover), never a reason to refuse


# ---- random bytes in the warm tier's files, opened in a child process --------------------------------
_WARM_CHILD = r"""
import json, os, shutil, sys, traceback, numpy as np
from tieredkv import KVSpec, TieredKVError, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import payload_for
spec = KVSpec(model_id="test/fuzz", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
pristine, work, target, seed, cases = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rng = np.random.default_rng(seed)
k = chunk_keys(spec, np.arange(4 * 48))
good = payload_for(k, spec.block_bytes)
k2 = chunk_keys(spec, np.arange(10**6, 10**6 + 4 * 24))
out = {"ok": 0, "refused": 0, "other": [], "wrong": 0}
for case in range(cases):
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work)
    d = os.path.join(work, spec.namespace)
    path = os.path.join(d, target)
    size = os.path.getsize(path)
    n = int(rng.integers(1, 64))
    # Half the cases hit the first pages (LMDB meta pages, the root) or the meta.json head.
    lim = size if rng.random() < 0.5 else min(size, 8192)
    off = int(rng.integers(0, max(1, lim - n)))
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(rng.bytes(n))
    try:
        with WarmTier(spec, work) as t:
            buf = np.zeros((48, spec.block_bytes), np.uint8)
            got = t.get_many(k, buf)
            out["wrong"] += int(not np.array_equal(buf[:got], good[:got]))
            t.contains_many(k)
            t.put_many(k2, payload_for(k2, spec.block_bytes))
            t.evict(2)
            got = t.get_many(k, buf)
            out["wrong"] += int(not np.array_equal(buf[:got], good[:got]))
        out["ok"] += 1
    except TieredKVError:
        out["refused"] += 1
    except Exception:
        out["other"].append(traceback.format_exc(limit=3))
print(json.dumps(out))
"""


@pytest.mark.procs
@pytest.mark.parametrize("target,cases", [("meta.json", 30), ("index.lmdb/data.mdb", 40),
                                          ("index.lmdb/lock.mdb", 15)])
def test_random_bytes_in_warm_files(tmp_path, target, cases):
    from tieredkv.warm import WarmTier

    pristine = tmp_path / "pristine"
    k = chunk_keys(SPEC, np.arange(4 * 48))
    with WarmTier(SPEC, pristine, capacity_bytes=64 * 4096) as t:
        t.put_many(k, payload_for(k, SPEC.block_bytes))
    res = _run_child(_WARM_CHILD, pristine, tmp_path / "work", target, 11, cases, timeout=240)
    print(target, {k: v for k, v in res.items() if k != "other"})
    assert res["other"] == [], res["other"][:2]
    assert res["wrong"] == 0
    assert res["ok"] + res["refused"] == cases


# ---- the one open-addressing table (hot index and ghost table) against a dict model -----------------------
table_ops = st.lists(st.tuples(st.sampled_from(["insert", "insert", "delete", "rebuild"]), st.integers(-40, 40)),
                     max_size=60)


@settings(max_examples=80, deadline=None)
@given(sequence=table_ops)
def test_probe_table_matches_a_dict_model(sequence):
    """Small signed keys in a 64-entry table: long runs, wrap-around at the end, deletions that shift."""
    table = ProbeTable(np.zeros(64, np.int64), np.zeros(64, np.int64))
    model: dict[int, int] = {}
    for n, (op, key) in enumerate(sequence):
        if op == "insert" and key not in model and len(model) < 32:
            assert table.insert(key, n)
            model[key] = n
        elif op == "delete" and key in model:
            table.delete_at(table.find(key))
            del model[key]
        elif op == "rebuild":
            table.rebuild(np.array(list(model), dtype=np.int64), np.array(list(model.values()), dtype=np.int64))
        probe = np.arange(-40, 41, dtype=np.int64)
        assert table.lookup(probe).tolist() == [model.get(k, -1) for k in probe.tolist()]
        expected = [[model[k]] if k in model else [] for k in probe.tolist()]
        assert [table.values_of(k) for k in probe.tolist()] == expected
        assert int(np.count_nonzero(table.refs)) == len(model)
