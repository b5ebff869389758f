"""Hot tier under attack: dead writers, damaged derived structures, interrupts, hostile segments.

Each test reproduces one way the hot tier was broken (issue 11 of the tracker) on real processes,
real signals and real shared-memory bytes, and checks the outcome the fix promises.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from helpers import payload_for
from tieredkv import CorruptState, HotTier, InvalidInput, InvalidPayload, PermissionDenied, PutResult, chunk_keys
from tieredkv.hot import segment as seg

FORK = mp.get_context("fork")


def prompt(spec, seed, n_chunks):
    rng = np.random.default_rng(seed)
    return chunk_keys(spec, rng.integers(0, 30_000, n_chunks * spec.chunk_tokens))


def _write_then_hang(spec, name, keys, ready):
    tier = HotTier(spec, name=name, policy=None, create=False)

    from tieredkv.hot import tier as hot_tier

    def hang(dst, src, skewed):  # the slots are claimed (WRITING) when the payload copy starts
        ready.set()
        time.sleep(3600)

    hot_tier.copy_rows = hang  # patched in the child only: every data copy of put_many goes through it
    tier.put_many(keys, payload_for(spec, keys))


def _kill_mid_write(spec, name, keys):
    ready = FORK.Event()
    p = FORK.Process(target=_write_then_hang, args=(spec, name, keys, ready))
    p.start()
    assert ready.wait(30), "child never reached the write"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL


# ---- item 11: a dead writer's WRITING slot --------------------------------------------------------
@pytest.mark.procs
def test_a_prefix_whose_writer_died_mid_copy_can_be_stored_again(tiny_spec, seg_name):
    """Plenty of free room (no eviction pass would ever reclaim the dead claim): the next store of
    the same prefix must reclaim the dead writer's slots and store, not answer EXISTS forever."""
    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        keys = prompt(tiny_spec, 11, 4)
        _kill_mid_write(tiny_spec, seg_name, keys)
        assert tier.slot_census()["writing_dead"] == 4
        assert tier.match(keys) == 0
        codes = tier.put_many(keys, payload_for(tiny_spec, keys))
        assert (codes == PutResult.STORED).all(), codes
        out = np.zeros((4, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(keys, out) == 4
        assert np.array_equal(out, payload_for(tiny_spec, keys))
        assert tier.slot_census()["writing_dead"] == 0


# ---- item 13: the full policy spec is recorded and compared ----------------------------------------
@pytest.mark.parametrize("base", ["arc", "s3fifo", "sieve", "clock", "lfu", "fifo"])
def test_prefix_aware_over_any_base_opens_and_is_compared_on_attach(tiny_spec, seg_name, base):
    spec = f"prefix_aware:{base}"
    with HotTier(tiny_spec, n_slots=16, name=seg_name, policy=spec) as tier:
        assert tier.stats().extra["policy"] == "prefix_aware"
        assert tier._policy.full_name() == spec
        keys = prompt(tiny_spec, 1, 4)
        assert (tier.put_many(keys, payload_for(tiny_spec, keys)) == PutResult.STORED).all()
        with HotTier(tiny_spec, name=seg_name, policy=spec, create=False) as again:
            assert again.match(keys) == 4
        with HotTier(tiny_spec, name=seg_name, policy=None, create=False) as again:
            assert again._policy.full_name() == spec
        with pytest.raises(InvalidInput, match="prefix_aware:lru"):
            HotTier(tiny_spec, name=seg_name, policy="prefix_aware", create=False)
        with pytest.raises(InvalidInput, match=f"uses eviction policy '{spec}'"):
            HotTier(tiny_spec, n_slots=16, name=seg_name, policy=base)


def test_a_segment_this_call_created_but_cannot_open_is_unlinked(tiny_spec, seg_name, monkeypatch):
    from tieredkv.hot import tier as hot_tier

    def broken_register(self):
        raise CorruptState("injected: registration fails")

    monkeypatch.setattr(hot_tier.HotTier, "_register", broken_register)
    with pytest.raises(CorruptState, match="injected"):
        HotTier(tiny_spec, n_slots=8, name=seg_name)
    assert not os.path.exists("/dev/shm" + seg_name)
    leftovers = [p for p in os.listdir("/dev/shm") if p.startswith(f"tieredkv-tmp-{os.getpid()}-")]
    assert not leftovers


# ---- items 16 and 17 (hot part): modes and arguments -------------------------------------------------
def test_a_widened_segment_is_refused_and_set_id_modes_are_bad_input(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=8, name=seg_name):
        os.chmod("/dev/shm" + seg_name, 0o666)
        with pytest.raises(PermissionDenied, match="mode 0o666"):
            HotTier(tiny_spec, name=seg_name, create=False)
    for bad in (0o4777, 0o2700, 0o1600, 0o666, 0o400, -1, "rw", 0o600 + 0.5, True):
        with pytest.raises(InvalidInput, match="mode"):
            HotTier(tiny_spec, n_slots=8, name=seg_name + "x", mode=bad)
    assert not os.path.exists("/dev/shm" + seg_name + "x")


@pytest.mark.parametrize("kwargs, msg", [
    (dict(capacity_bytes="8M"), "capacity_bytes must be a positive integer"),
    (dict(capacity_bytes=8.0e6), "capacity_bytes must be a positive integer"),
    (dict(n_slots="8"), "n_slots must be a positive integer"),
    (dict(n_slots=8, lock_timeout_s="x"), "lock_timeout_s must be a positive"),
    (dict(n_slots=8, lock_timeout_s=float("nan")), "lock_timeout_s must be a positive"),
    (dict(n_slots=8, lock_timeout_s=-1), "lock_timeout_s must be a positive"),
    (dict(n_slots=8, mode="rw"), "mode must be permission bits"),
])
def test_bad_hot_tier_arguments_are_invalid_input_naming_them(tiny_spec, seg_name, kwargs, msg):
    with pytest.raises(InvalidInput, match=msg):
        HotTier(tiny_spec, name=seg_name, **kwargs)
    assert not os.path.exists("/dev/shm" + seg_name)


def test_attach_only_to_a_missing_segment_is_invalid_input(tiny_spec, seg_name):
    with pytest.raises(InvalidInput, match="does not exist; create=False only attaches"):
        HotTier(tiny_spec, name=seg_name, create=False)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(hot_bytes="8 lots"), "hot_bytes must be a byte count or a size like '512M'"),  # "8M" is a size
    (dict(hot_bytes=1 << 20, lock_timeout_s="x"), "lock_timeout_s must be a positive"),
    (dict(hot_blocks=True), "hot_blocks must be a positive integer"),
])
def test_bad_tiered_cache_arguments_are_invalid_input_naming_them(tiny_spec, seg_name, kwargs, msg):
    from tieredkv import TieredCache

    with pytest.raises(InvalidInput, match=msg):
        TieredCache(tiny_spec, hot_name=seg_name, **kwargs)


def test_meta_requires_grad_and_overlapping_outputs_are_invalid_payloads(tiny_spec, seg_name):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from tieredkv import TieredCache

    tokens = np.arange(17)
    kv = np.random.default_rng(0).standard_normal((2, 2, 1, 16, 8)).astype(np.float32)
    with TieredCache(tiny_spec, hot_bytes=1 << 20, hot_name=seg_name) as cache:
        cache.store(tokens, kv)
        hit = cache.lookup(tokens)
        assert hit.tokens == 16
        with pytest.raises(InvalidPayload, match="meta device"):
            cache.store(tokens, torch.zeros(2, 2, 1, 16, 8, device="meta"))
        with pytest.raises(InvalidPayload, match="meta device"):
            cache.load(hit, torch.zeros(2, 2, 1, 16, 8, device="meta"))
        with pytest.raises(InvalidPayload, match="requires grad"):
            cache.load(hit, torch.zeros(2, 2, 1, 16, 8, requires_grad=True))
        base = torch.zeros(2 * 2 * 16 * 8)
        overlapping = torch.as_strided(base, (2, 2, 1, 16, 8), (128, 64, 0, 4, 1))  # tokens overlap
        with pytest.raises(InvalidPayload, match="overlapping strides"):
            cache.load(hit, overlapping)
        np_base = np.zeros(2 * 2 * 16 * 8, np.float32)
        np_overlapping = np.lib.stride_tricks.as_strided(np_base, (2, 2, 1, 16, 8), (512, 256, 0, 16, 4))
        with pytest.raises(InvalidPayload, match="overlapping strides"):
            cache.load(hit, np_overlapping)
        # What is fine still works: a transposed (non-contiguous, non-overlapping) tensor, and a
        # tensor that requires grad given as a detached view.
        out = torch.zeros(2, 2, 16, 1, 8).transpose(2, 3)
        assert cache.load(hit, out) == 16
        assert np.array_equal(out.numpy(), kv)
        grad = torch.zeros(2, 2, 1, 16, 8, requires_grad=True)
        assert cache.load(hit, grad.detach()) == 16


# ---- items 3, 4, 14, 15, 18 and issue 14's rm edges: segment lifecycle -------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (setuid)")
OTHER_UID = 65534  # nobody


def rm(capsys, *argv):
    from tieredkv import cli

    status = cli.main(["rm", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def _hold_as_other_user(spec, name, ready, done):
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)
    with HotTier(spec, n_slots=8, name=name):
        ready.set()
        done.wait(60)


@pytest.mark.procs
@needs_root
def test_rm_stale_as_root_never_removes_another_users_live_segment(tiny_spec, seg_name, capsys):
    from tieredkv.hot import admin

    ready, done = FORK.Event(), FORK.Event()
    p = FORK.Process(target=_hold_as_other_user, args=(tiny_spec, seg_name, ready, done))
    p.start()
    try:
        assert ready.wait(30)
        assert os.stat("/dev/shm" + seg_name).st_uid == OTHER_UID
        [doc] = [d for d in admin.list_segments() if d["name"] == seg_name]
        assert doc["live"] and not doc["stale"] and doc["live_handles"] == 1
        for args in (["--stale"], ["--stale", "--idle"]):
            status, out, _ = rm(capsys, *args, "--match", seg_name)
            assert status == 0 and out.strip() == "no stale segments"
            assert os.path.exists("/dev/shm" + seg_name)
    finally:
        done.set()
        p.join(30)
    assert p.exitcode == 0
    status, out, _ = rm(capsys, "--stale", "--match", seg_name)  # idle now: kept without --idle
    assert status == 0 and os.path.exists("/dev/shm" + seg_name)
    status, out, _ = rm(capsys, "--stale", "--idle", "--match", seg_name)
    assert status == 0 and out.strip() == f"removed {seg_name}: no process has it open"


def test_a_live_segment_that_looks_unusable_is_not_stale(tiny_spec, seg_name, capsys):
    """Liveness is the registry locks, not whether this tieredkv can attach: a worker of another
    layout version (here: a header version bumped under a live handle) keeps its segment."""
    with HotTier(tiny_spec, n_slots=8, name=seg_name) as tier:
        tier._map.header["version"] = 99
        status, out, _ = rm(capsys, "--stale", "--idle", "--match", seg_name)
        assert status == 0 and out.strip() == "no stale segments"
        assert os.path.exists("/dev/shm" + seg_name)
        tier._map.header["version"] = seg.LAYOUT_VERSION
    tier_version_99 = HotTier(tiny_spec, n_slots=8, name=seg_name)
    tier_version_99._map.header["version"] = 99
    tier_version_99.close()
    status, out, _ = rm(capsys, "--stale", "--match", seg_name)  # dead and unusable: stale
    assert status == 0 and out.startswith(f"removed {seg_name}: unusable") and "layout version 99" in out


def _open_slowly(spec, name, published, go, result):
    """Open a HotTier whose registration waits, after the segment is published, until ``go``."""
    from tieredkv.hot import tier as hot_tier

    real = hot_tier.HotTier._register

    def slow(self):
        published.set()
        go.wait(60)
        real(self)

    hot_tier.HotTier._register = slow
    with HotTier(spec, n_slots=8, name=name) as tier:
        result.put((tier.created, tier._still_published(), os.fstat(tier._fd).st_ino))


@pytest.mark.procs
def test_a_segment_is_live_from_its_first_published_instant(tiny_spec, seg_name, capsys):
    published, go, result = FORK.Event(), FORK.Event(), FORK.Queue()
    p = FORK.Process(target=_open_slowly, args=(tiny_spec, seg_name, published, go, result))
    p.start()
    try:
        assert published.wait(30)
        assert os.path.exists("/dev/shm" + seg_name)  # published, creator not yet registered
        status, out, _ = rm(capsys, "--stale", "--idle", "--match", seg_name)
        assert status == 0 and out.strip() == "no stale segments"
        assert os.path.exists("/dev/shm" + seg_name)
    finally:
        go.set()
    created, still_published, _ = result.get(timeout=30)
    p.join(30)
    assert created and still_published


@pytest.mark.procs
def test_an_attacher_that_loses_its_idle_segment_to_rm_attaches_again(tiny_spec, seg_name, capsys):
    HotTier(tiny_spec, n_slots=8, name=seg_name).close()  # idle
    old_inode = os.stat("/dev/shm" + seg_name).st_ino
    published, go, result = FORK.Event(), FORK.Event(), FORK.Queue()
    p = FORK.Process(target=_open_slowly, args=(tiny_spec, seg_name, published, go, result))
    p.start()
    try:
        assert published.wait(30)  # attached to the idle segment, not registered yet
        status, out, _ = rm(capsys, "--stale", "--idle", "--match", seg_name)
        assert out.strip() == f"removed {seg_name}: no process has it open"
    finally:
        go.set()
    created, still_published, inode = result.get(timeout=30)
    p.join(30)
    assert p.exitcode == 0
    assert created and still_published and inode != old_inode  # a handle on the segment in /dev/shm


def _hang_while_building(spec, name, ready):
    from tieredkv.hot import tier as hot_tier

    def hang(mapping, engine):
        ready.set()
        time.sleep(3600)

    hot_tier.HotTier._init_segment = staticmethod(hang)
    HotTier(spec, n_slots=8, name=name)


@pytest.mark.procs
def test_dead_creators_temporaries_are_reaped_and_live_ones_kept(tiny_spec, seg_name):
    def temporaries(pid):
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"tieredkv-tmp-{pid}-")]

    dead = []
    for i in range(3):  # a crash-looping worker, killed mid-build three times
        ready = FORK.Event()
        p = FORK.Process(target=_hang_while_building, args=(tiny_spec, f"{seg_name}-{i}", ready))
        p.start()
        assert ready.wait(30)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        dead.append(p.pid)
        # Each new attempt reaped the previous attempt's leftover: they never pile up.
        assert [len(temporaries(pid)) for pid in dead] == [0] * i + [1]
    ready = FORK.Event()
    live = FORK.Process(target=_hang_while_building, args=(tiny_spec, seg_name + "-live", ready))
    live.start()
    try:
        assert ready.wait(30)
        with HotTier(tiny_spec, n_slots=8, name=seg_name):  # a creation reaps
            pass
        assert [temporaries(pid) for pid in dead] == [[], [], []]
        assert len(temporaries(live.pid)) == 1  # a creator still building keeps its temporary
    finally:
        os.kill(live.pid, signal.SIGKILL)
        live.join(10)
    from tieredkv.hot import segment as seg

    assert seg.reap_temporaries() >= 1 and temporaries(live.pid) == []


@pytest.fixture
def custom_name():
    name = f"/kvtest-custom-{os.getpid()}-{os.urandom(3).hex()}"
    yield name
    if os.path.exists("/dev/shm" + name):
        os.unlink("/dev/shm" + name)


def test_segments_with_a_custom_name_are_listed_and_handled_by_rm(tiny_spec, custom_name, capsys):
    from tieredkv import cli

    with HotTier(tiny_spec, n_slots=8, name=custom_name):
        assert cli.main(["ls", "--json", "-"]) == 0
        listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)["hot"]}
        assert custom_name in listed and listed[custom_name]["live_handles"] == 1
        status, out, _ = rm(capsys, "--stale", "--idle", "--match", custom_name)
        assert out.strip() == "no stale segments" and os.path.exists("/dev/shm" + custom_name)
    status, out, _ = rm(capsys, "--stale", "--idle", "--match", custom_name.lstrip("/"))  # no leading '/'
    assert status == 0 and out.strip() == f"removed {custom_name}: no process has it open"
    assert not os.path.exists("/dev/shm" + custom_name)


def test_rm_idle_without_stale_is_bad_usage(capsys):
    status, _, err = rm(capsys, "--idle", "/tieredkv-x")
    assert status == 2 and "--idle goes with --stale" in err


def test_rm_stale_goes_on_past_odd_dev_shm_entries(tiny_spec, seg_name, capsys):
    odd = ["/dev/shm" + seg_name + "-a-dir", "/dev/shm" + seg_name + "-b-fifo", "/dev/shm" + seg_name + "-c-link"]
    stale = seg_name + "-d-stale"
    os.mkdir(odd[0])
    os.mkfifo(odd[1])
    os.symlink("/etc/passwd", odd[2])
    try:
        with open("/dev/shm" + stale, "wb") as f:
            f.write(b"\x01" * 8192)  # named like ours, not ours: unusable
        status, out, err = rm(capsys, "--stale", "--match", seg_name + "*")
        assert status == 0, err
        assert out.strip().startswith(f"removed {stale}: unusable")
        assert not os.path.exists("/dev/shm" + stale)
        assert all(os.path.lexists(p) for p in odd)
    finally:
        os.rmdir(odd[0])
        os.unlink(odd[1])
        os.unlink(odd[2])


# ---- item 8: interrupts (KeyboardInterrupt, exceptions from signal handlers) leave nothing behind ----
class _HandlerError(Exception):
    """What a user's signal handler raises (any exception, not only KeyboardInterrupt)."""


def _busy_under_interrupts(spec, name, stop, idle, counts, signum=signal.SIGINT):
    """Store, read, evict and recover in a loop while SIGINTs land at random points; then go idle
    (alive, holding its handle) so that the parent can check what the interrupts left behind."""
    import faulthandler

    faulthandler.dump_traceback_later(50, exit=True)  # a hang shows where it hangs
    armed = [False]  # set just before each tier call: interrupts land in the tier, not in this loop

    def interrupt(sig, frame):
        if armed[0]:
            armed[0] = False  # one per call, so the handling below is never interrupted itself
            raise KeyboardInterrupt if sig == signal.SIGINT else _HandlerError("from a signal handler")

    signal.signal(signum, interrupt)
    tier = HotTier(spec, name=name, policy=None, create=False)
    rng = np.random.default_rng(os.getpid())
    out = np.zeros((8, spec.block_bytes), np.uint8)
    interrupted = done = wrong = 0
    while True:
        try:
            if stop.is_set():
                break
            keys = prompt(spec, int(rng.integers(0, 40)), 8)
            expected = payload_for(spec, keys)
            op = int(rng.integers(0, 10))
            n = -1
            armed[0] = True  # interrupts land inside the tier call only, never in the checking below
            if op < 4:
                tier.put_many(keys, expected)
            elif op < 8:
                n = tier.get_many(keys, out)
            elif op < 9:
                tier.evict(2)
            else:
                tier.recover()
            armed[0] = False
            # (numpy's array_equal swallows an ordinary exception raised inside it and answers False)
            wrong += n > 0 and out[:n].tobytes() != expected[:n].tobytes()
            done += 1
        except KeyboardInterrupt:
            interrupted += 1
        except Exception:
            # numpy turns an exception raised inside some of its calls (a comparison, say) into a
            # TypeError: still an interrupt, as far as the tier is concerned.
            armed[0] = False
            interrupted += 1
    faulthandler.cancel_dump_traceback_later()
    counts.put(("done", interrupted, done, wrong))
    idle.set()
    time.sleep(3600)


def _index_agrees_with_slots(tier) -> bool:
    from tieredkv.hot.segment import FREE, READY

    rec = tier._slots
    ready = np.flatnonzero(rec["state"] == READY)
    found = tier._find(rec["key"][ready])
    free = np.sort(tier._free[: int(tier._h["free_top"])])
    return bool((found == ready).all()) and np.array_equal(free, np.flatnonzero(rec["state"] == FREE))


@pytest.mark.procs
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1], ids=["SIGINT", "SIGUSR1-handler-raises"])
def test_interrupts_at_random_points_leave_no_lock_pin_or_broken_index(tiny_spec, seg_name, signum):
    with HotTier(tiny_spec, n_slots=24, name=seg_name, lock_timeout_s=3) as tier:
        stop, idle, counts = FORK.Event(), FORK.Event(), FORK.Queue()
        workers = [FORK.Process(target=_busy_under_interrupts,
                                args=(tiny_spec, seg_name, stop, idle, counts, signum))]
        for w in workers:
            w.start()
        rng = np.random.default_rng(0)
        try:
            time.sleep(0.5)
            for _ in range(3000):
                for w in workers:
                    os.kill(w.pid, signum)
                time.sleep(float(rng.uniform(0, 1e-3)))
            stop.set()
            assert idle.wait(60), "the worker never finished its loop"
            msgs = [counts.get(timeout=10)]
            print(f"\ninterrupts: {msgs[0][1]} landed in tier calls, {msgs[0][2]} calls completed, "
                  f"{msgs[0][3]} wrong reads")
            assert msgs[0][0] == "done" and msgs[0][1] > 100 and msgs[0][3] == 0, msgs  # they really landed
            # The worker is alive and idle. Nothing it was doing may still hold anything:
            started = time.monotonic()
            keys = prompt(tiny_spec, 999, 4)
            assert (tier.put_many(keys, payload_for(tiny_spec, keys)) == PutResult.STORED).all()  # lock is free
            assert time.monotonic() - started < 3
            # No pin or live claim of the idle worker is left (claims it abandoned read as a dead
            # writer's: reclaimed when space runs short, below), and the index agrees with the slots.
            census = tier.slot_census()
            assert census["pinned"] == 0 and census["writing_live"] == 0, census
            assert _index_agrees_with_slots(tier)
            _fill = prompt(tiny_spec, 1234, tier.n_slots)
            assert (tier.put_many(_fill, payload_for(tiny_spec, _fill)) == PutResult.STORED).all()
        finally:
            for w in workers:
                os.kill(w.pid, signal.SIGKILL)
                w.join(10)


# ---- item 9: damaged derived structures are a miss plus a scrub, never an exception ----------------
def _damage(name, offset, words):
    """Write int64 ``words`` at ``offset`` of the segment file itself (real shared-memory bytes)."""
    fd = os.open("/dev/shm" + name, os.O_RDWR)
    try:
        os.pwrite(fd, np.asarray(words, dtype="<i8").tobytes(), offset)
    finally:
        os.close(fd)


def _open_and_die(spec, name):
    tier = HotTier(spec, name=name, policy=None, create=False)  # noqa: F841 - kept open until death
    os._exit(0)  # no close: a dead owner whose row stays


def _reader(spec, name, seeds, results):
    """Another process: every call must answer (misses allowed, wrong bytes and exceptions not)."""
    import warnings

    warnings.simplefilter("ignore")
    try:
        with HotTier(spec, name=name, policy=None, create=False) as tier:
            wrong = 0
            for seed in seeds:
                keys = prompt(spec, seed, 8)
                tier.match(keys)
                tier.contains_many(keys)
                out = np.zeros((8, spec.block_bytes), np.uint8)
                n = tier.get_many(keys, out)
                wrong += not np.array_equal(out[:n], payload_for(spec, keys)[:n])
                tier.put_many(keys, payload_for(spec, keys))
            tier.evict(2)
            results.put(("ok", wrong, tier.stats().extra["scrubs"]))
    except BaseException as e:  # noqa: BLE001 - the point is that nothing escapes
        results.put(("raised", repr(e), 0))


@pytest.mark.procs
@pytest.mark.filterwarnings("ignore:.*damaged metadata:RuntimeWarning")  # the repair says so, as it should
@pytest.mark.parametrize("policy", ["lru", "arc", "prefix_aware:s3fifo"])
@pytest.mark.parametrize("where", ["index", "free stack", "free top", "policy state", "policy state, holder died",
                                   "pin list"])
def test_one_damaged_word_is_a_miss_and_a_scrub_never_an_exception(tiny_spec, seg_name, where, policy):
    with HotTier(tiny_spec, n_slots=24, name=seg_name, policy=policy) as tier:
        for seed in range(3):
            keys = prompt(tiny_spec, seed, 8)
            tier.put_many(keys, payload_for(tiny_spec, keys))
        tier.evict(4)  # some free slots on the stack
        h = tier._map.header
        scrubs = int(h["scrubs"])
        if where == "index":  # every used entry's slot reference -> far past the slot table
            refs_off = int(h["index_off"]) + 8 * int(h["index_slots"])
            refs = np.frombuffer(tier._map.mm, "<i8", int(h["index_slots"]), refs_off)
            used = np.flatnonzero(refs)
            for i in used.tolist():
                _damage(seg_name, refs_off + 8 * i, [1 << 40])
        elif where == "free stack":
            _damage(seg_name, int(h["free_off"]), [1 << 40, -5, 3])
        elif where == "free top":
            _damage(seg_name, h.dtype.fields["free_top"][1], [1 << 50])
        elif where.startswith("policy state"):
            rng = np.random.default_rng(5)
            n_words = int(h["policy_bytes"]) // 8
            _damage(seg_name, int(h["policy_off"]), rng.integers(-(1 << 40), 1 << 40, n_words))
            if where.endswith("holder died"):  # and the next lock holder must scrub first
                _damage(seg_name, h.dtype.fields["dirty"][1], [seg.MAX_OWNERS])
        else:  # a dead reader's pin list names slots that do not exist
            p = FORK.Process(target=_open_and_die, args=(tiny_spec, seg_name))
            p.start()
            p.join(30)
            assert p.exitcode == 0
            [dead] = [i for i in np.flatnonzero(tier._owners["token"]) if i != tier._owner]
            off = int(h["owners_off"]) + int(dead) * seg.OWNER_DTYPE.itemsize
            _damage(seg_name, off + seg.OWNER_DTYPE.fields["pins"][1], [1 << 40, -3])
            _damage(seg_name, off + seg.OWNER_DTYPE.fields["n_pins"][1], [2])
        results = FORK.Queue()
        p = FORK.Process(target=_reader, args=(tiny_spec, seg_name, range(6), results))
        p.start()
        status, wrong, _ = results.get(timeout=60)
        p.join(30)
        assert status == "ok", wrong
        assert wrong == 0
        if where in ("index", "free stack", "free top"):
            assert int(h["scrubs"]) > scrubs  # the reader found the damage and scrubbed
        # Repaired for everyone: the whole segment works again, with every block readable.
        fill = prompt(tiny_spec, 4321, tier.n_slots)
        assert (tier.put_many(fill, payload_for(tiny_spec, fill)) == PutResult.STORED).all()
        out = np.zeros((tier.n_slots, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(fill, out) == tier.n_slots
        assert np.array_equal(out, payload_for(tiny_spec, fill))


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "sieve", "clock", "fifo", "cost_aware",
                                    "prefix_aware:arc", "prefix_aware:s3fifo"])
def test_random_policy_state_damage_never_raises_or_refuses_stores(tiny_spec, seg_name, policy):
    """8 random rewrites of the whole policy state per policy (huge words, or small plausible ones;
    half of them with a holder that died inside the lock): reads stay right, nothing raises, and the
    whole capacity can still be stored."""
    import warnings

    for seed in range(8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "damaged metadata ... rebuilding"
            with HotTier(tiny_spec, n_slots=24, name=f"{seg_name}-{seed}", policy=policy) as tier:
                try:
                    for s in range(3):
                        keys = prompt(tiny_spec, s, 8)
                        tier.put_many(keys, payload_for(tiny_spec, keys))
                    h = tier._map.header
                    rng = np.random.default_rng(seed)
                    n_words = int(h["policy_bytes"]) // 8
                    words = rng.integers(-(1 << 40), 1 << 40, n_words) if seed % 2 else rng.integers(-3, 30, n_words)
                    _damage(tier.name, int(h["policy_off"]), words)
                    if seed % 4 >= 2:
                        _damage(tier.name, h.dtype.fields["dirty"][1], [seg.MAX_OWNERS])
                    for s in range(6):
                        keys = prompt(tiny_spec, 100 + s, 8)
                        out = np.zeros((8, tiny_spec.block_bytes), np.uint8)
                        n = tier.get_many(keys, out)
                        assert np.array_equal(out[:n], payload_for(tiny_spec, keys)[:n])
                        tier.put_many(keys, payload_for(tiny_spec, keys))
                        tier.match(keys)
                    tier.evict(3)
                    fill = prompt(tiny_spec, 999, 24)
                    assert (tier.put_many(fill, payload_for(tiny_spec, fill)) == PutResult.STORED).all(), seed
                finally:
                    tier.unlink()


def test_an_interrupted_close_still_lets_go_of_the_handle(tiny_spec, seg_name, monkeypatch):
    """An exception raised inside close (here: from the registry unlock) still closes the handle's
    descriptor, so its registry byte is free and its claims read as a dead owner's."""
    from tieredkv.hot import locks

    with HotTier(tiny_spec, n_slots=8, name=seg_name) as survivor:
        tier = HotTier(tiny_spec, name=seg_name, policy=None, create=False)
        owner = tier._owner
        real_unlock = locks.unlock

        def interrupted(fd, start, length=1):
            if start == locks.REGISTRY_BASE + owner:
                raise KeyboardInterrupt
            return real_unlock(fd, start, length)

        monkeypatch.setattr(locks, "unlock", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.close()
        monkeypatch.setattr(locks, "unlock", real_unlock)
        assert tier._closed
        assert not locks.is_locked(survivor._fd, locks.REGISTRY_BASE + owner)
        assert survivor.live_handles() == 1


_EXITS_WITHOUT_CLOSE = """
import sys, numpy as np, torch  # torch first, a tensor stored: the teardown order that showed it
from tieredkv import KVSpec, TieredCache
from tieredkv.config import CacheConfig, HotConfig
spec = KVSpec(model_id="test/tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
cache = TieredCache(spec, CacheConfig(hot=HotConfig(bytes=1 << 20, name=sys.argv[1])))
cache.store(np.arange(8), torch.ones((2, 2, 1, 8, 8)))
print(cache.hot._owner, flush=True)
"""


def test_a_process_that_exits_without_close_lets_go_of_its_row_without_a_warning(tiny_spec, seg_name):
    """A script that ends without ``close()``: at exit its handle closes cleanly (its owner row is free
    at once, not left for a reclaim) and nothing is printed. At interpreter teardown, which closed it
    before, the close found the modules half gone and warned ("'NoneType' object cannot be interpreted
    as an integer")."""
    import subprocess
    import sys

    with HotTier(tiny_spec, n_slots=8, name=seg_name) as tier:
        done = subprocess.run([sys.executable, "-W", "default", "-c", _EXITS_WITHOUT_CLOSE, seg_name],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        child = int(done.stdout)
        assert child != tier._owner
        assert int(tier._owners[child]["token"]) == 0  # released by the child itself, not reclaimed
        assert tier.live_handles() == 1
        assert tier.contains_many(chunk_keys(tiny_spec, np.arange(8), b"")).all()


# ---- threads sharing a handle, a reattach, re-entry (an audit of the hot tier's handle) --------------
def _block_first_copy(monkeypatch):
    """Patch the hot tier's row copy so that the first call (a put's payload copy, its slots claimed)
    waits for ``go``; ``claimed`` is set when it starts waiting."""
    import threading

    from tieredkv.hot import tier as hot_tier

    claimed, go, first = threading.Event(), threading.Event(), [True]
    real = hot_tier.copy_rows

    def copy(dst, src, skewed):
        if first[0]:
            first[0] = False
            claimed.set()
            assert go.wait(30)
        return real(dst, src, skewed)

    monkeypatch.setattr(hot_tier, "copy_rows", copy)
    return claimed, go


def test_a_reattach_waits_for_another_threads_put_in_flight(tiny_spec, seg_name, monkeypatch):
    """One thread's put has claimed slots and is filling them when the segment is unlinked; another
    thread's call on the same handle must not reattach then: its close would free those claims, a
    worker still on the old segment would take the slots and store its own blocks there, and the
    put would then copy its bytes over them (that worker read the other prompt's KV under its own
    keys). The handle reattaches on the first call after the put ends."""
    import threading
    import warnings

    tier = HotTier(tiny_spec, n_slots=16, name=seg_name)
    other = HotTier(tiny_spec, name=seg_name, policy=None, create=False)  # a worker on the same segment
    try:
        claimed, go = _block_first_copy(monkeypatch)
        ours, theirs = prompt(tiny_spec, 1, 8), prompt(tiny_spec, 2, 8)
        codes = []
        writer = threading.Thread(target=lambda: codes.append(tier.put_many(ours, payload_for(tiny_spec, ours))))
        writer.start()
        assert claimed.wait(30)
        inode = tier._inode
        seg.unlink(seg_name)
        tier._last_check = -1e9
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a reattach warns: there must be none while the put runs
            assert not tier.contains_many(theirs).any()
        assert tier._inode == inode and tier.slot_census()["writing_live"] == 8
        assert (other.put_many(theirs, payload_for(tiny_spec, theirs)) == PutResult.STORED).all()
        go.set()
        writer.join(30)
        assert (codes[0] == PutResult.STORED).all()
        for keys in (theirs, ours):
            out = np.zeros((8, tiny_spec.block_bytes), np.uint8)
            assert other.get_many(keys, out) == 8
            assert np.array_equal(out, payload_for(tiny_spec, keys))
        tier._last_check = -1e9
        with pytest.warns(RuntimeWarning, match="removed or replaced"):
            assert tier.match(ours) == 0  # no call in flight now: reattached to a fresh segment
        assert tier._inode != inode
    finally:
        other.close()
        tier.close()


def test_a_reattach_keeps_before_close_and_does_not_run_it(tiny_spec, seg_name):
    """``before_close`` (a cache's write-behind rescue) is for closing for good. Run by a reattach it
    was dropped afterwards (queued blocks then never rescued at close), and when the write-behind
    writer's own read noticed the unlink, the rescue waited for the job that writer was inside."""
    ran = []
    tier = HotTier(tiny_spec, n_slots=8, name=seg_name)
    try:
        tier.before_close = lambda: ran.append("rescued")
        seg.unlink(seg_name)
        tier._last_check = -1e9
        with pytest.warns(RuntimeWarning, match="removed or replaced"):
            tier.match(prompt(tiny_spec, 1, 2))
        assert ran == [] and tier.before_close is not None
    finally:
        tier.close()
    assert ran == ["rescued"]


@pytest.mark.filterwarnings("ignore:.*removed or replaced:RuntimeWarning")  # the writer's thread reattaches
def test_the_write_behind_writer_noticing_an_unlink_does_not_hang(tiny_spec, seg_name, tmp_path, monkeypatch):
    """End to end: the warm writer is the first caller to notice that the hot segment was removed (a
    slow warm put kept it inside a job past the once-a-second check). It reattaches and goes on;
    later stores are written behind and close flushes at once."""
    import time

    from tieredkv import TieredCache
    from tieredkv.config import CacheConfig, HotConfig, WarmConfig

    cache = TieredCache(tiny_spec, CacheConfig(hot=HotConfig(bytes=1 << 20, name=seg_name),
                                               warm=WarmConfig(str(tmp_path), 16 << 20, write="write_behind")))
    try:
        rng = np.random.default_rng(5)
        first, second, third = (rng.integers(0, 30_000, 32) for _ in range(3))
        kv = torch_kv(tiny_spec, 32)
        # The first job's blocks are on disk already: its write counts nothing, so the writer's next
        # call on the hot tier is the second job's read, from inside that job.
        cache.store(first, kv)
        assert cache.flush(10)
        cache.hot.remove(chunk_keys(tiny_spec, first))
        warm = cache.warm
        real_put, slow = warm.put_many, [True]

        def busy_disk(keys, payloads):
            if slow[0]:
                slow[0] = False
                time.sleep(1.5)
            return real_put(keys, payloads)

        monkeypatch.setattr(warm, "put_many", busy_disk)
        inode = cache.hot._inode
        cache.store(first, kv)
        cache.store(second, kv)  # queued behind the slow job: its read comes after the check is due
        time.sleep(0.2)
        seg.unlink(seg_name)
        time.sleep(3)  # this thread idle: the writer's read of the second job is the first to check
        assert cache.hot._inode != inode, "the writer did not reattach"
        assert cache.stats().get("warm_queue_blocks", 0) == 0, "the writer is stuck"
        cache.store(third, kv)
        started = time.monotonic()
        cache.close()
        assert time.monotonic() - started < 5
    finally:
        cache.close()
    reopened = TieredCache(tiny_spec, CacheConfig(hot=HotConfig(bytes=1 << 20, name=seg_name),
                                                  warm=WarmConfig(str(tmp_path), 16 << 20)))
    try:
        assert reopened.lookup(np.concatenate([third, [0]])).tokens == 32  # written behind, then found on disk
    finally:
        reopened.close()


def torch_kv(spec, n_tokens):
    import torch

    return torch.randn(spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim)


def _close_from_a_signal_handler(spec, name, inside):
    tier = HotTier(spec, n_slots=16, name=name, lock_timeout_s=60)

    def on_term(signum, frame):
        tier.close()  # flush and close on SIGTERM, as a server's handler does
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    real = tier._take_slots

    def slow_take(*args, **kwargs):  # inside the put's critical section: the handler runs in it
        inside.set()
        time.sleep(30)
        return real(*args, **kwargs)

    tier._take_slots = slow_take
    keys = prompt(spec, 1, 4)
    tier.put_many(keys, payload_for(spec, keys))
    os._exit(3)


@pytest.mark.procs
def test_a_signal_handler_that_closes_the_tier_inside_a_critical_section_does_not_hang(tiny_spec, seg_name):
    """The handler runs on the thread that holds the handle's critical section: waiting for it would be
    waiting for itself. The close gives up on the section at once, warns and drops the mapping."""
    with HotTier(tiny_spec, n_slots=16, name=seg_name) as survivor:
        inside = FORK.Event()
        p = FORK.Process(target=_close_from_a_signal_handler, args=(tiny_spec, seg_name, inside))
        p.start()
        assert inside.wait(60), "the child never reached the put's critical section"
        assert survivor._h["dirty"]  # the child is inside, its handler installed
        os.kill(p.pid, signal.SIGTERM)
        p.join(10)
        alive = p.is_alive()
        if alive:
            p.kill()
            p.join(5)
        assert not alive and p.exitcode == 0
        keys = prompt(tiny_spec, 1, 4)  # the segment serves on (the next holder scrubs)
        assert (survivor.put_many(keys, payload_for(tiny_spec, keys)) == PutResult.STORED).all()
        assert survivor.live_handles() == 1


def test_an_index_error_of_the_callers_sink_passes_through_get_many(tiny_spec, seg_name):
    """The caller's bug is not damage to the segment: no warning, no scrub (which resets every
    process's eviction history), the sink called once."""
    import warnings

    with HotTier(tiny_spec, n_slots=16, name=seg_name) as tier:
        keys = prompt(tiny_spec, 1, 4)
        tier.put_many(keys, payload_for(tiny_spec, keys))
        calls = []

        def sink(i, rows):
            calls.append(i)
            raise IndexError("the caller's own")

        scrubs = int(tier._h["scrubs"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(IndexError, match="the caller's own"):
                tier.get_many(keys, np.zeros((4, tiny_spec.block_bytes), np.uint8), sink)
        assert calls == [0] and int(tier._h["scrubs"]) == scrubs
        out = np.zeros((4, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(keys, out) == 4 and np.array_equal(out, payload_for(tiny_spec, keys))
        assert tier.slot_census()["pinned"] == 0  # the dropped pins were recounted by the next holder


def test_a_handle_stores_again_what_its_own_interrupted_put_abandoned(tiny_spec, seg_name, monkeypatch):
    """A put whose publish could not take the lock abandons its claims (token zeroed, no lock). The
    next store of that prefix through the same handle frees them and stores, as any other handle's
    does, instead of answering EXISTS with nothing readable."""
    from tieredkv.errors import LockTimeout

    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        keys = prompt(tiny_spec, 1, 4)
        real_enter, entries = tier._enter, []

        def enter():
            entries.append(1)
            if len(entries) == 2:  # 1: the claim, 2: the publish
                raise LockTimeout("held by a live process")
            return real_enter()

        monkeypatch.setattr(tier, "_enter", enter)
        with pytest.raises(LockTimeout):
            tier.put_many(keys, payload_for(tiny_spec, keys))
        monkeypatch.setattr(tier, "_enter", real_enter)
        assert tier.slot_census()["writing_dead"] == 4
        assert (tier.put_many(keys, payload_for(tiny_spec, keys)) == PutResult.STORED).all()
        out = np.zeros((4, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(keys, out) == 4 and np.array_equal(out, payload_for(tiny_spec, keys))


def test_the_segment_layout_is_the_one_its_version_names():
    """Processes of two releases with the same ``LAYOUT_VERSION`` share a segment (its name carries the
    version), so a release that changes how segment bytes are read must bump it. The digest of every
    record, limit, offset and built-in policy state holds the two together."""
    from tieredkv import policies
    shipped = {n for n in policies.names() if type(policies.make(n)).__module__.startswith("tieredkv.policies.")}
    in_digest = {name.split(":")[0] for name in seg._BUILT_IN_POLICIES}
    assert shipped <= in_digest, f"{sorted(shipped - in_digest)}: state not in the digest (_BUILT_IN_POLICIES)"
    assert seg.layout_digest() == seg.LAYOUT_DIGEST, (
        "the hot segment's layout changed: bump LAYOUT_VERSION in tieredkv/hot/segment.py and set "
        f"LAYOUT_DIGEST = {seg.layout_digest()!r}")


@pytest.mark.parametrize("change", ["owner row", "slot record", "policy state"])
def test_the_layout_digest_sees_a_same_size_change(monkeypatch, change):
    """What the geometry check at attach cannot see, the digest does: an owner-row field or a slot field
    that keeps its size but not its type, or a policy that gains a state field."""
    if change == "owner row":
        descr = [(n, "<i8" if n == "n_pins" else t, *rest) for n, t, *rest in seg.OWNER_DTYPE.descr]
        monkeypatch.setattr(seg, "OWNER_DTYPE", np.dtype(descr))
    elif change == "slot record":
        descr = [(n, "<i8" if n == "length" else t, *rest) for n, t, *rest in seg.SLOT_DTYPE.descr]
        monkeypatch.setattr(seg, "SLOT_DTYPE", np.dtype(descr))
    else:
        from tieredkv import policies
        lru = type(policies.make("lru"))
        monkeypatch.setattr(lru, "slot_fields", (*lru.slot_fields, "a_new_field"), raising=False)
    assert seg.layout_digest() != seg.LAYOUT_DIGEST
