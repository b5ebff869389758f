"""The host journal (tieredkv.journal): real processes append concurrently, readers follow rotation and
skip damage, and a TieredCache with ``journal=True`` records what it stores and what its tiers evict."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tieredkv import KVSpec, TieredCache, chunk_keys
from tieredkv import journal as jr
from tieredkv.cache import HOT, WARM


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


_APPENDER = textwrap.dedent("""
    import sys
    from tieredkv import journal as jr
    path, who, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    j = jr.HostJournal(path, max_bytes=1 << 30)
    for i in range(n):
        j.append(jr.NOTED, who, [(who * 100000 + i).to_bytes(8, "little") * 2], [b"x" * (i % 50)])
    j.close()
""")


@pytest.mark.procs
def test_processes_append_concurrently_and_no_record_is_torn(tmp_path):
    path = str(tmp_path / "j.journal")
    reader = jr.JournalReader(path)
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, path, str(w), "300"]) for w in (1, 2, 3)]
    got = []
    while any(p.poll() is None for p in procs):
        got += reader.poll()
    assert [p.wait() for p in procs] == [0, 0, 0]
    got += reader.poll()
    assert len(got) == 900 and reader.corrupt == 0
    for who in (1, 2, 3):  # each process's records, complete and in its own order
        mine = [int.from_bytes(r.key_bytes()[0][:8], "little") - who * 100000 for r in got if r.tier == who]
        assert mine == list(range(300))
        assert all(r.notes == (b"x" * (i % 50),) for i, r in enumerate(x for x in got if x.tier == who))


def test_a_reader_follows_rotation_and_counts_what_it_missed(tmp_path):
    path = str(tmp_path / "j.journal")
    j = jr.HostJournal(path, max_bytes=1000)
    reader = jr.JournalReader(path)
    late = jr.JournalReader(path, from_start=False)
    j.append(jr.STORED, HOT, [key(0)])
    assert [r.key_bytes() for r in reader.poll()] == [[key(0)]]
    for i in range(1, 15):  # ~70 bytes each: about one rotation
        j.append(jr.STORED, HOT, [key(i)])
    assert [r.key_bytes()[0] for r in reader.poll()] == [key(i) for i in range(1, 15)]
    assert reader.lost_files == 0
    for i in range(15, 100):  # several rotations before the next poll
        j.append(jr.EVICTED, WARM, [key(i)])
    got = [r.key_bytes()[0] for r in reader.poll()]
    assert reader.lost_files > 0
    assert got == sorted(got) and got[-1] == key(99)  # what it read is in order and ends with the newest
    assert [r.key_bytes()[0] for r in late.poll()][-1] == key(99)
    j.append(jr.CLEARED, HOT)
    (cleared,) = reader.poll()
    assert cleared.op == jr.CLEARED and len(cleared.keys) == 0
    j.close()


def test_damage_is_skipped_and_counted(tmp_path):
    path = str(tmp_path / "j.journal")
    j = jr.HostJournal(path)
    reader = jr.JournalReader(path)
    j.append(jr.STORED, HOT, [key(1)])
    with open(path, "r+b") as f:  # flip a byte inside the record's key: its checksum fails
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    j.append(jr.STORED, HOT, [key(2)])
    assert [r.key_bytes() for r in reader.poll()] == [[key(2)]]
    assert reader.corrupt == 1
    with open(path, "ab") as f:  # garbage where a record should start
        f.write(b"\x00" * 64)
    assert reader.poll() == [] and reader.corrupt == 2
    j.close()
    with pytest.raises(Exception, match="notes for"):
        jr.HostJournal(path).append(jr.NOTED, HOT, [key(1), key(2)], [b"one"])


def test_a_cache_journals_its_stores_and_its_tiers_evictions(seg_name, tmp_path):
    spec = KVSpec(model_id="journal-test", num_layers=1, num_kv_heads=1, head_dim=32, dtype="float32",
                  chunk_tokens=16)
    tokens = np.arange(16 * 6)
    kv = np.random.default_rng(0).standard_normal((1, 2, 1, len(tokens), 32)).astype(np.float32)
    with TieredCache(spec, hot_blocks=4, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                     demotion="write_through", journal=True) as cache:
        assert cache.hot.evict_payloads is False  # keys-only eviction hook: no copy of the evicted bytes
        path = jr.journal_path(seg_name)
        assert cache.journal.path == path and os.path.exists(path)
        reader = jr.JournalReader(path)
        cache.store(tokens[:48], kv[:, :, :, :48])
        keys = chunk_keys(spec, tokens)
        recs = reader.poll()
        stored = {(r.tier, k) for r in recs if r.op == jr.STORED for k in r.key_bytes()}
        assert stored == {(t, bytes(k)) for t in (HOT, WARM) for k in keys[:3]}
        cache.store(tokens, kv)  # 3 more chunks: the hot tier (4 slots) evicts
        recs = reader.poll()
        evicted = [k for r in recs if r.op == jr.EVICTED for k in r.key_bytes()]
        assert evicted and all(r.tier == HOT for r in recs if r.op == jr.EVICTED)
        gone = ~cache.hot.contains_many(keys)
        assert set(evicted) <= {bytes(k) for k, g in zip(keys, gone) if g}
        reader.close()
    jr.remove(path)
    assert not os.path.exists(path)
