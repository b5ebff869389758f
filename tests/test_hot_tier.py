"""HotTier: the block interface, eviction, bad input, and real processes (concurrency, SIGKILL)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import time

import numpy as np
import posix_ipc
import pytest

from helpers import payload_for
from tieredkv import (
    CapacityError,
    FormatError,
    HotTier,
    InvalidInput,
    InvalidName,
    KVSpec,
    PutResult,
    SpecMismatch,
    chunk_keys,
)
from tieredkv.hot import segment as seg
from tieredkv.hot import tier as hot_tier_module

FORK = mp.get_context("fork")


def prompt(spec, seed, n_chunks):
    rng = np.random.default_rng(seed)
    return chunk_keys(spec, rng.integers(0, 30_000, n_chunks * spec.chunk_tokens))


# ---- single process ---------------------------------------------------------------------------
def test_lru_eviction_order_and_on_evict_gets_the_bytes(tiny_spec, seg_name):
    evicted = []
    with HotTier(tiny_spec, n_slots=4, name=seg_name, on_evict=evicted.append) as tier:
        keys = prompt(tiny_spec, 5, 6)
        data = payload_for(tiny_spec, keys)
        for i in range(4):
            tier.put_many(keys[i:i + 1], data[i:i + 1])
        out = np.zeros_like(data[:1])
        assert tier.get_many(keys[0:1], out) == 1  # block 0 becomes most recent: block 1 is LRU
        assert (tier.put_many(keys[4:6], data[4:6]) == PutResult.STORED).all()
        assert tier.contains_many(keys).tolist() == [True, False, False, True, True, True]
        victims = [k for e in evicted for k in e.keys]
        assert victims == [keys[1], keys[2]]
        payloads = np.concatenate([e.payloads for e in evicted])
        assert np.array_equal(payloads, data[1:3])
        assert np.array_equal(np.concatenate([e.keys.tokens for e in evicted]), keys.tokens[1:3])
        assert tier.stats().evictions == 2


def test_many_inserts_and_removals_keep_the_index_consistent(tiny_spec, seg_name):
    """Tombstones pile up and the index is rebuilt; every resident key stays findable."""
    with HotTier(tiny_spec, n_slots=32, name=seg_name) as tier:
        resident = {}
        rng = np.random.default_rng(0)
        for round_ in range(300):
            keys = prompt(tiny_spec, 1000 + round_, 3)
            tier.put_many(keys, payload_for(tiny_spec, keys))
            for k in range(3):
                resident[keys[k]] = keys[k:k + 1]
            if rng.random() < 0.5:
                tier.remove(keys[:1])
                resident.pop(keys[0])
        alive = [ck for ck in resident.values() if tier.contains_many(ck)[0]]
        census = tier.slot_census()
        assert census["ready"] == len(alive) <= 32
        out = np.zeros((1, tiny_spec.block_bytes), np.uint8)
        for ck in alive:
            assert tier.get_many(ck, out) == 1 and np.array_equal(out, payload_for(tiny_spec, ck))


# ---- bad input, foreign and mismatching segments --------------------------------------------------
def test_attach_with_another_spec_is_a_spec_mismatch(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=8, name=seg_name):
        other = KVSpec(model_id="test/tiny", num_layers=3, num_kv_heads=1, head_dim=8, dtype="float32",
                       chunk_tokens=4)
        with pytest.raises(SpecMismatch, match="num_layers: segment has 2, you asked for 3"):
            HotTier(other, n_slots=8, name=seg_name)


def test_attach_with_another_policy_is_refused(tiny_spec, seg_name, monkeypatch):
    with HotTier(tiny_spec, n_slots=8, name=seg_name):
        h = HotTier(tiny_spec, name=seg_name, policy=None, create=False)
        assert h.stats().extra["policy"] == "lru"
        h.close()
        h.close()  # idempotent


def test_foreign_magic_and_version_are_format_errors(tiny_spec, seg_name):
    shm = posix_ipc.SharedMemory(seg_name, posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    os.write(shm.fd, b"\x01" * 64)
    os.close(shm.fd)
    with pytest.raises(FormatError, match="foreign magic"):
        HotTier(tiny_spec, n_slots=8, name=seg_name)
    posix_ipc.unlink_shared_memory(seg_name)
    tier = HotTier(tiny_spec, n_slots=8, name=seg_name)
    tier._map.header["version"] = 99
    tier.close()
    with pytest.raises(FormatError, match="layout version 99"):
        HotTier(tiny_spec, n_slots=8, name=seg_name)


def test_segment_larger_than_dev_shm_is_a_capacity_error(tiny_spec, seg_name):
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize * 2 + (1 << 30)
    with pytest.raises(CapacityError, match="/dev/shm"):
        HotTier(tiny_spec, capacity_bytes=too_big, name=seg_name)
    assert not os.path.exists("/dev/shm" + seg_name)
    assert not [p for p in os.listdir("/dev/shm") if seg.temp_owner(p) == os.getpid()]


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "", "-x", "x" * 300, "bad name", "/x/../y"])
def test_invalid_names(tiny_spec, name):
    with pytest.raises(InvalidName):
        HotTier(tiny_spec, n_slots=4, name=name)


def test_invalid_sizes(tiny_spec, seg_name):
    with pytest.raises(InvalidInput):
        HotTier(tiny_spec, name=seg_name)
    with pytest.raises(InvalidInput):
        HotTier(tiny_spec, capacity_bytes=-5, name=seg_name)
    with pytest.raises(InvalidInput):
        HotTier(tiny_spec, n_slots=0, name=seg_name)
    with pytest.raises(InvalidInput, match="does not exist; create=False only attaches"):
        HotTier(tiny_spec, name=seg_name, create=False)


def test_segment_is_private_to_its_user(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=4, name=seg_name):
        assert stat.S_IMODE(os.stat("/dev/shm" + seg_name).st_mode) == 0o600


def test_capacity_bytes_is_respected(tiny_spec, seg_name):
    with HotTier(tiny_spec, capacity_bytes=4 << 20, name=seg_name) as tier:
        assert tier._map.size <= 4 << 20
        assert tier.n_slots > 1000


def test_closed_handle_refuses_calls(tiny_spec, seg_name):
    tier = HotTier(tiny_spec, n_slots=4, name=seg_name)
    tier.close()
    with pytest.raises(InvalidInput, match="closed"):
        tier.match(prompt(tiny_spec, 1, 1))


# ---- real processes ---------------------------------------------------------------------------
def _hammer(spec, name, worker, rounds, n_prompts, results):
    """Random puts and gets over a shared pool of prompts; every byte read is checked."""
    rng = np.random.default_rng(worker)
    wrong = hits = reads = 0
    with HotTier(spec, name=name, policy=None, create=False) as tier:
        for _ in range(rounds):
            keys = prompt(spec, int(rng.integers(n_prompts)), 8)
            tier.put_many(keys, payload_for(spec, keys))
            out = np.zeros((len(keys), spec.block_bytes), np.uint8)
            n = tier.get_many(keys, out)
            expect = payload_for(spec, keys)
            wrong += int(np.count_nonzero(out[:n] != expect[:n]))
            hits += n
            reads += len(keys)
    results.put((worker, wrong, hits, reads))


@pytest.mark.procs
def test_eight_processes_share_blocks_with_zero_wrong_bytes(tiny_spec, seg_name):
    # 40 slots for 24 prompts x 8 chunks = 192 distinct blocks: constant eviction under contention.
    with HotTier(tiny_spec, n_slots=40, name=seg_name) as tier:
        results = FORK.Queue()
        procs = [FORK.Process(target=_hammer, args=(tiny_spec, seg_name, w, 150, 24, results))
                 for w in range(8)]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        assert sum(g[1] for g in got) == 0, "wrong bytes served"
        assert sum(g[2] for g in got) > 0
        census = tier.slot_census()
        assert census["writing_live"] == census["writing_dead"] == census["pinned"] == 0
        assert census["free"] + census["ready"] == census["capacity"]
        assert tier.stats().evictions > 0


def _arm(tier, point, fn, monkeypatch=None):
    """Make ``tier`` call ``fn()`` at ``point`` of its protocol, patched in from the test side:

    - ``"critical"``: inside the metadata lock (header dirty), as ``put_many`` takes free slots;
    - ``"write"``: slots claimed (WRITING, generation odd), as ``put_many`` copies a payload in;
    - ``"copy"``: blocks pinned, as ``get_many`` copies one out.

    In a child process the module attribute is simply replaced; in the test's own process pass
    ``monkeypatch`` so that it is restored.
    """
    if point == "critical":
        take_free = tier._take_free

        def take(n):
            fn()
            return take_free(n)

        tier._take_free = take
        return
    real_copy = hot_tier_module.copy_rows  # every data copy of get_many and put_many goes through it

    def copy(dst, src, skewed):
        fn()
        return real_copy(dst, src, skewed)

    if monkeypatch is not None:
        monkeypatch.setattr(hot_tier_module, "copy_rows", copy)
    else:
        hot_tier_module.copy_rows = copy


def _stop_at(spec, name, hook, ready, seed):
    """Attach, arm ``hook`` to signal ``ready`` and hang there, then store (or read) a prompt."""
    tier = HotTier(spec, name=name, policy=None, create=False)
    keys = prompt(spec, seed, 4)

    def hang():
        ready.set()
        time.sleep(3600)

    if hook == "copy":
        tier.put_many(keys, payload_for(spec, keys))
        _arm(tier, hook, hang)
        tier.get_many(keys, np.zeros((4, spec.block_bytes), np.uint8))
    else:
        _arm(tier, hook, hang)
        tier.put_many(keys, payload_for(spec, keys))


def _kill_at(spec, name, hook, seed=99):
    ready = FORK.Event()
    p = FORK.Process(target=_stop_at, args=(spec, name, hook, ready, seed))
    p.start()
    assert ready.wait(30), "child never reached the hook"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL


def _fill_and_check(spec, tier, seed):
    """After recovery, the whole capacity must hold fresh blocks, every one readable."""
    keys = prompt(spec, seed, tier.n_slots)
    data = payload_for(spec, keys)
    codes = tier.put_many(keys, data)
    assert (codes == PutResult.STORED).all(), codes
    out = np.zeros_like(data)
    assert tier.get_many(keys, out) == tier.n_slots
    assert np.array_equal(out, data)
    assert tier.slot_census()["ready"] == tier.n_slots


@pytest.mark.procs
@pytest.mark.parametrize("hook", ["critical", "write", "copy"])
def test_sigkill_inside_lock_write_or_read_leaks_nothing(tiny_spec, seg_name, hook):
    """Killed holding the lock (mid critical section), mid-write (WRITING slots) or mid-read (pins):
    the survivors go on within bounded waits and recovery returns the full capacity."""
    with HotTier(tiny_spec, n_slots=12, name=seg_name, lock_timeout_s=5) as tier:
        base = prompt(tiny_spec, 1, 8)
        tier.put_many(base, payload_for(tiny_spec, base))
        _kill_at(tiny_spec, seg_name, hook)
        census = tier.slot_census()
        if hook == "write":
            assert census["writing_dead"] == 4
        if hook == "copy":
            assert census["pinned"] == 4
        # Survivors: a reader and a writer in other processes finish promptly.
        started = time.monotonic()
        out = np.zeros((8, tiny_spec.block_bytes), np.uint8)
        n = tier.get_many(base, out)
        assert np.array_equal(out[:n], payload_for(tiny_spec, base)[:n])
        assert time.monotonic() - started < 5
        _fill_and_check(tiny_spec, tier, seed=7)
        census = tier.slot_census()
        assert census["writing_dead"] == census["pinned"] == 0
        if hook == "critical":
            assert tier.stats().extra["scrubs"] >= 1


@pytest.mark.procs
def test_killed_lock_holder_does_not_block_a_concurrent_worker(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=64, name=seg_name):
        ready = FORK.Event()
        holder = FORK.Process(target=_stop_at, args=(tiny_spec, seg_name, "critical", ready, 5))
        holder.start()
        assert ready.wait(30)
        results = FORK.Queue()
        worker = FORK.Process(target=_hammer, args=(tiny_spec, seg_name, 1, 20, 4, results))
        worker.start()
        time.sleep(0.3)  # the worker is now waiting on the lock
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        _, wrong, hits, _ = results.get(timeout=30)
        worker.join(10)
        assert worker.exitcode == 0 and wrong == 0 and hits > 0


@pytest.mark.procs
def test_random_sigkills_never_serve_wrong_bytes(tiny_spec, seg_name):
    """Kill writers and readers at random moments, repeatedly; then every invariant holds."""
    rng = np.random.default_rng(0)
    with HotTier(tiny_spec, n_slots=24, name=seg_name) as tier:
        for round_ in range(6):
            results = FORK.Queue()
            procs = [FORK.Process(target=_hammer, args=(tiny_spec, seg_name, 10 * round_ + w, 10_000, 12, results))
                     for w in range(3)]
            for p in procs:
                p.start()
            time.sleep(float(rng.uniform(0.2, 0.6)))
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
        tier.recover()
        census = tier.slot_census()
        assert census["writing_live"] == census["writing_dead"] == census["pinned"] == 0
        assert census["free"] + census["ready"] == census["capacity"]
        # Every block still resident is the right one.
        for seed in range(12):
            keys = prompt(tiny_spec, seed, 8)
            out = np.zeros((8, tiny_spec.block_bytes), np.uint8)
            n = tier.get_many(keys, out)
            assert np.array_equal(out[:n], payload_for(tiny_spec, keys)[:n])
        _fill_and_check(tiny_spec, tier, seed=1234)


@pytest.mark.procs
def test_create_race_gives_one_segment(tiny_spec, seg_name):
    """Eight processes open the same new segment at once: all attach to one, none sees it half-made."""
    results = FORK.Queue()
    barrier = FORK.Barrier(8)

    def opener(i):
        barrier.wait()
        with HotTier(tiny_spec, n_slots=16, name=seg_name) as t:
            keys = prompt(tiny_spec, i, 1)
            t.put_many(keys, payload_for(tiny_spec, keys))
            results.put((t.created, t._instance))

    procs = [FORK.Process(target=opener, args=(i,)) for i in range(8)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    assert sum(c for c, _ in got) == 1
    assert len({inst for _, inst in got}) == 1
    with HotTier(tiny_spec, name=seg_name, create=False) as t:
        assert t.slot_census()["ready"] == 8
    ours = {p.pid for p in procs}  # /dev/shm is shared with other test runs
    assert not [p for p in os.listdir("/dev/shm") if seg.temp_owner(p) in ours]


@pytest.mark.procs
def test_fork_reattaches(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=8, name=seg_name) as tier:
        keys = prompt(tiny_spec, 3, 2)
        tier.put_many(keys, payload_for(tiny_spec, keys))
        results = FORK.Queue()

        def child():
            out = np.zeros((2, tiny_spec.block_bytes), np.uint8)
            results.put((tier.get_many(keys, out), tier._owner, os.getpid() == tier._pid))

        p = FORK.Process(target=child)
        p.start()
        n, owner, repid = results.get(timeout=30)
        p.join(10)
        assert n == 2 and repid and owner != tier._owner
        assert tier.match(keys) == 2


def test_unlinked_segment_is_noticed(tiny_spec, seg_name, monkeypatch):
    with HotTier(tiny_spec, n_slots=8, name=seg_name) as tier:
        keys = prompt(tiny_spec, 3, 2)
        tier.put_many(keys, payload_for(tiny_spec, keys))
        posix_ipc.unlink_shared_memory(seg_name)
        tier._last_check = -1e9
        with pytest.warns(RuntimeWarning, match="removed or replaced"):
            assert tier.match(keys) == 0  # reattached to a fresh, empty segment
        assert os.path.exists("/dev/shm" + seg_name)


def test_threads_sharing_one_handle_read_correct_bytes(tiny_spec, seg_name):
    """A handle has one pin list in the segment: threads reading through it must not clobber it."""
    import threading

    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        prompts = [prompt(tiny_spec, s, 8) for s in range(6)]
        for keys in prompts:
            tier.put_many(keys, payload_for(tiny_spec, keys))
        wrong = []

        def reader(seed):
            out = np.zeros((8, tiny_spec.block_bytes), np.uint8)
            for i in range(300):
                keys = prompts[(seed + i) % 6]
                n = tier.get_many(keys, out)
                wrong.append(n != 8 or not np.array_equal(out, payload_for(tiny_spec, keys)))

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(wrong) == 1200 and not any(wrong)
        assert tier.slot_census()["pinned"] == 0


def test_a_refused_extra_handle_leaves_the_others_registered(tiny_spec, seg_name):
    import gc

    handles = [HotTier(tiny_spec, n_slots=4, name=seg_name)]
    try:
        handles += [HotTier(tiny_spec, name=seg_name) for _ in range(seg.MAX_OWNERS - 1)]
        with pytest.raises(InvalidInput, match="open handles"):
            HotTier(tiny_spec, name=seg_name)
        gc.collect()  # the refused handle's __del__ must not deregister anybody
        assert handles[0].live_handles() == seg.MAX_OWNERS
        assert all(h._owners[h._owner]["token"] == h._token for h in handles)
    finally:
        for h in handles:
            h.close()


def test_an_interrupted_put_gives_its_slots_back(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=4, name=seg_name) as tier:
        keys = prompt(tiny_spec, 1, 4)

        def interrupt():
            raise KeyboardInterrupt

        with pytest.MonkeyPatch.context() as mp_:
            _arm(tier, "write", interrupt, mp_)
            with pytest.raises(KeyboardInterrupt):
                tier.put_many(keys, payload_for(tiny_spec, keys))
        assert tier.slot_census()["free"] == 4
        assert (tier.put_many(keys, payload_for(tiny_spec, keys)) == PutResult.STORED).all()


def test_close_unmaps_and_a_too_small_capacity_is_refused(tiny_spec, seg_name):
    tier = HotTier(tiny_spec, n_slots=4, name=seg_name)
    mapping = tier._map
    tier.close()
    assert mapping.mm.closed
    with pytest.raises(InvalidInput, match="cannot hold one"):
        HotTier(tiny_spec, capacity_bytes=4096, name=seg_name + "-small")
    assert not os.path.exists("/dev/shm" + seg_name + "-small")


def _fork_a_bystander_then_hang(spec, name, ready, child_pid):
    tier = HotTier(spec, name=name, policy=None, create=False)
    keys = prompt(spec, 42, 4)

    def hang():
        pid = os.fork()
        if pid == 0:  # a child that never touches the tier (a worker pool's helper, say)
            time.sleep(3600)
            os._exit(0)
        child_pid.value = pid
        ready.set()
        time.sleep(3600)

    _arm(tier, "write", hang)
    tier.put_many(keys, payload_for(spec, keys))


@pytest.mark.procs
def test_a_forked_bystander_does_not_keep_a_dead_writer_alive(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=8, name=seg_name) as tier:
        ready, child_pid = FORK.Event(), FORK.Value("i", 0)
        p = FORK.Process(target=_fork_a_bystander_then_hang, args=(tiny_spec, seg_name, ready, child_pid))
        p.start()
        assert ready.wait(30)
        try:
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            census = tier.slot_census()
            assert census["writing_dead"] == 4 and census["writing_live"] == 0
            _fill_and_check(tiny_spec, tier, seed=3)
        finally:
            os.kill(child_pid.value, signal.SIGKILL)
