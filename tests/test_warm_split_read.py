"""Split one-pass warm reads: a ``read_through(..., parallel=True)`` of at least ``halves.SPLIT_BYTES`` is
shared between the calling thread and the tier's helper thread, each reading, hashing and sinking its
half of the groups into a buffer of its own.

Under test: every block reaches the sink exactly once, from two threads, with its stored bytes; a block
damaged on disk ends the run there whichever half it is in; an exception in the helper's half is
raised by the call; a busy helper, busy CPUs or ``parallel=False`` read on the calling thread alone; a
forked child reads split again (the parent's helper thread does not exist there); a restore through
``TieredCache`` into host memory takes the split path with either promotion rule, and its promotion
into the hot tier is copied in two halves too.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from test_warm_read_through import flip_bytes_on_disk

from helpers import kv_for, payload_for, same_bytes
from tieredkv import KVSpec, TieredCache, chunk_keys, halves
from tieredkv.halves import Halves
from tieredkv.layout import model_to_blocks
from tieredkv.warm import WarmTier
from tieredkv.warm import reads as warm_reads

SPEC = KVSpec(model_id="test/split-read", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
              chunk_tokens=8)  # 4 KiB blocks
N = 24
GROUP = 2  # blocks per group here: 12 groups, split 6 / 6 (blocks 0-11 on the caller, 12-23 on the helper)


def prompt(n_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n_tokens)


@pytest.fixture
def small_splits(monkeypatch):
    """Groups of ``GROUP`` blocks, every read of 4 blocks or more split, and a CPU free for the helper
    whatever the host's load (``tieredkv.halves.other_cpu_free``, tested in test_halves.py)."""
    monkeypatch.setattr(halves, "other_cpu_free", lambda: True)
    monkeypatch.setattr(warm_reads, "READ_GROUP_BYTES", GROUP * SPEC.block_bytes)
    monkeypatch.setattr(halves, "SPLIT_BYTES", 4 * SPEC.block_bytes)


@pytest.fixture
def warm(tmp_path, small_splits):
    keys = chunk_keys(SPEC, prompt(N * SPEC.chunk_tokens))
    with WarmTier(SPEC, tmp_path, capacity_bytes=32 * 4096, verify="always") as t:
        assert (t.put_many(keys, payload_for(SPEC, keys)) == 0).all()
        yield t, keys


def recording_sink():
    """A sink that keeps a copy of every group with the thread that handed it over."""
    seen: list[tuple[int, np.ndarray, int]] = []
    lock = threading.Lock()

    def sink(i, rows):
        with lock:
            seen.append((i, rows.copy(), threading.get_ident()))

    return seen, sink


def assembled(seen, n: int) -> tuple[np.ndarray, list[int]]:
    """The blocks the sink got, in key order, and how often each block index was handed over."""
    out = np.zeros((n, SPEC.block_bytes), np.uint8)
    times = [0] * n
    for i, rows, _ in seen:
        out[i:i + len(rows)] = rows
        for j in range(i, i + len(rows)):
            times[j] += 1
    return out, times


def test_a_parallel_read_is_shared_by_two_threads_and_each_block_is_sunk_once(warm):
    t, keys = warm
    seen, sink = recording_sink()
    before = t.stats()
    assert t.read_through(keys, sink, parallel=True) == N
    got, times = assembled(seen, N)
    assert times == [1] * N
    np.testing.assert_array_equal(got, payload_for(SPEC, keys))
    by_thread = {tid: sorted(i for i, _, t2 in seen if t2 == tid) for _, _, tid in seen}
    assert len(by_thread) == 2
    assert sorted(by_thread[threading.get_ident()]) == list(range(0, N // 2, GROUP))  # the caller's half
    after = t.stats()
    assert (after.hits - before.hits, after.bytes_out - before.bytes_out) == (N, N * SPEC.block_bytes)


def test_without_parallel_the_read_stays_on_the_calling_thread_in_key_order(warm):
    t, keys = warm
    seen, sink = recording_sink()
    assert t.read_through(keys, sink) == N
    assert {tid for _, _, tid in seen} == {threading.get_ident()}
    assert [i for i, _, _ in seen] == list(range(0, N, GROUP))


@pytest.mark.parametrize("bad", [5, 17])  # in the caller's half, in the helper's half
def test_a_block_damaged_on_disk_ends_a_split_read_there_whichever_half_it_is_in(warm, bad):
    t, keys = warm
    want = payload_for(SPEC, keys)
    flip_bytes_on_disk(t, want[bad], 1234)
    seen, sink = recording_sink()
    assert t.read_through(keys, sink, parallel=True) == bad
    got, _ = assembled(seen, N)
    np.testing.assert_array_equal(got[:bad], want[:bad])
    assert t.corrupt_seen == 1
    assert t.contains_many(keys).tolist() == [i != bad for i in range(N)]  # dropped, never served again


def test_an_exception_in_the_helpers_half_is_raised_and_frees_the_helper(warm):
    t, keys = warm

    def sink(i, rows):
        if i >= N // 2:
            raise RuntimeError(f"sink refused block {i}")

    with pytest.raises(RuntimeError, match="sink refused block"):
        t.read_through(keys, sink, parallel=True)
    seen, record = recording_sink()
    assert t.read_through(keys, record, parallel=True) == N
    assert len({tid for _, _, tid in seen}) == 2  # the helper was given back


def test_a_busy_helper_leaves_the_read_to_the_calling_thread(warm):
    t, keys = warm
    assert t._halves._free.acquire(blocking=False)  # another thread's split read holds the helper
    try:
        seen, sink = recording_sink()
        assert t.read_through(keys, sink, parallel=True) == N
        assert {tid for _, _, tid in seen} == {threading.get_ident()}
        assert [i for i, _, _ in seen] == list(range(0, N, GROUP))  # both halves, in order, here
    finally:
        t._halves._free.release()


def test_busy_cpus_leave_the_read_to_the_calling_thread(warm, monkeypatch):
    t, keys = warm
    monkeypatch.setattr(halves, "other_cpu_free", lambda: False)
    seen, sink = recording_sink()
    assert t.read_through(keys, sink, parallel=True) == N
    assert {tid for _, _, tid in seen} == {threading.get_ident()}


@pytest.mark.procs
def test_a_forked_child_reads_split_with_a_helper_thread_of_its_own(warm):
    t, keys = warm
    want = payload_for(SPEC, keys)
    seen, sink = recording_sink()
    assert t.read_through(keys, sink, parallel=True) == N  # the parent's helper thread is running now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only when a split read worked
        code = 1
        try:
            os.close(r)
            seen.clear()
            ok = t.read_through(keys, sink, parallel=True) == N and np.array_equal(assembled(seen, N)[0], want)
            code = 0 if ok and len({tid for _, _, tid in seen}) == 2 else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    try:
        import select
        ready, _, _ = select.select([r], [], [], 60)
        assert ready, "the forked child's split read did not finish within 60 s"
        assert os.read(r, 1) == bytes([0])
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("promotion", ["never", "always"])
def test_a_restore_into_host_memory_reads_split_and_promotes_the_same_bytes(tmp_path, seg_name, small_splits,
                                                                           monkeypatch, promotion):
    splits = []
    run = Halves.run

    def counted_run(self, first, second):
        splits.append(run(self, first, second))
        return splits[-1]

    monkeypatch.setattr(Halves, "run", counted_run)
    C = SPEC.chunk_tokens
    tokens = prompt(N * C + 3, seed=4)
    kv = kv_for(SPEC, tokens)
    with TieredCache(SPEC, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=32 * 4096,
                     promotion=promotion, demotion="write_through", warm_verify="always") as cache:
        assert cache.store(tokens, kv) == N
        cache.hot.remove(cache.lookup(tokens).keys)
        hit = cache.lookup(tokens)
        assert hit.warm_blocks == N
        out = np.zeros_like(kv)
        assert cache.load(hit, out) == N * C
        assert splits == ([True] if promotion == "never" else [True, True])  # the read, the promotion
        assert same_bytes(out[:, :, :, :N * C], kv[:, :, :, :N * C])
        promoted = cache.hot.contains_many(hit.keys)
        assert promoted.all() if promotion == "always" else not promoted.any()
        if promotion == "always":
            rows = np.zeros((N, SPEC.block_bytes), np.uint8)
            assert cache.hot.get_many(hit.keys, rows) == N
            want = np.empty_like(rows)
            model_to_blocks(SPEC, kv, 0, want)
            np.testing.assert_array_equal(rows, want)
