"""Restart-safe by default: with a warm dir and no other setting, what a process stores reaches the warm
tier off the request path, so that a new process finds it after the hot segment is gone (a reboot).

Real processes: a writer exits cleanly (its queue is flushed) or is SIGKILLed (it loses at most its
queue, and nothing that reached warm is damaged); the segment is then unlinked, as a reboot does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import posix_ipc
import pytest

from helpers import kv_for, same_bytes
from tieredkv import KVSpec, TieredCache
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import check_index

SPEC_ARGS = dict(model_id="test/restart", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                 chunk_tokens=4)
SPEC = KVSpec(**SPEC_ARGS)
MiB = 1 << 20


def prompt(seed: int, n: int = 33) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n)


# The writer uses the defaults only: TieredCache(spec, hot_bytes, warm_dir, warm_bytes). The hot tier is
# large enough that nothing is evicted, so an eviction-time demotion could not explain a warm hit.
WRITER = textwrap.dedent("""
    import signal, sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from helpers import kv_for
    from tieredkv import KVSpec, TieredCache

    spec = KVSpec(**{spec!r})
    cache = TieredCache(spec, {hot_bytes}, {warm!r}, {warm_bytes}, hot_name={seg!r})
    prompts = lambda seeds: [np.random.default_rng(s).integers(0, 30_000, 33) for s in seeds]
    for tokens in prompts({first!r}):
        cache.store(tokens, kv_for(spec, tokens))
    mode = {mode!r}
    if mode == "term":                  # what a server does: SIGTERM becomes a normal exit
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("stored", flush=True)
        time.sleep(600)
    if mode == "exit":
        sys.exit(0)                     # no close(): the interpreter's exit must flush the queue
    if mode == "with":
        cache.close()
        sys.exit(0)
    assert cache.flush(60)              # "first" is now in warm, however long the disk took
    print("flushed", flush=True)
    for tokens in prompts({second!r}):
        cache.store(tokens, kv_for(spec, tokens))
    print("stored more", flush=True)
    time.sleep(600)
""")


def run_writer(tmp_path, seg_name, mode: str, first=(1, 2, 3), second=()) -> subprocess.Popen:
    code = WRITER.format(tests=os.path.dirname(__file__), spec=SPEC_ARGS, hot_bytes=8 * MiB,
                         warm=str(tmp_path / "warm"), warm_bytes=4 * MiB, seg=seg_name, first=list(first),
                         second=list(second), mode=mode)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def reboot(seg_name: str) -> None:
    """What a reboot does to the hot tier: the segment is gone."""
    posix_ipc.unlink_shared_memory(seg_name)


def assert_restored(tmp_path, seg_name, seeds) -> None:
    """A fresh process-side cache with the defaults finds every prompt of ``seeds`` in warm, byte-exact."""
    with TieredCache(SPEC, 8 * MiB, tmp_path / "warm", 4 * MiB, hot_name=seg_name) as cache:
        for seed in seeds:
            tokens = prompt(seed)
            hit = cache.lookup(tokens)
            assert (hit.tokens, hit.warm_blocks) == (32, 8), f"prompt {seed}: {hit}"
            out = np.zeros((2, 2, 2, 33, 8), np.float16)
            assert cache.load(hit, out) == 32
            assert same_bytes(out[:, :, :, :32], kv_for(SPEC, tokens)[:, :, :, :32])
        cache.hot.unlink()


@pytest.mark.procs
@pytest.mark.parametrize("mode", ["with", "exit"])
def test_clean_exit_writes_every_block_to_warm_then_a_reboot_finds_them(tmp_path, seg_name, mode):
    proc = run_writer(tmp_path, seg_name, mode)
    assert proc.wait(timeout=120) == 0
    reboot(seg_name)
    assert_restored(tmp_path, seg_name, (1, 2, 3))


@pytest.mark.procs
def test_sigterm_turned_into_an_exit_writes_the_queue(tmp_path, seg_name):
    proc = run_writer(tmp_path, seg_name, "term")
    try:
        assert proc.stdout.readline().strip() == "stored"
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    reboot(seg_name)
    assert_restored(tmp_path, seg_name, (1, 2, 3))


@pytest.mark.procs
def test_sigkill_loses_at_most_the_queue(tmp_path, seg_name):
    proc = run_writer(tmp_path, seg_name, "kill", first=(1, 2), second=range(10, 30))
    try:
        assert proc.stdout.readline().strip() == "flushed"
        assert proc.stdout.readline().strip() == "stored more"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    reboot(seg_name)
    assert_restored(tmp_path, seg_name, (1, 2))          # written before the kill: all there
    # The rest was queued when the process died: any of it may be missing, none of it may be wrong.
    tier_dir = next(p for p in (tmp_path / "warm").iterdir() if p.is_dir())
    check_index(str(tier_dir), allow_claims=True)
    with WarmTier(SPEC, tmp_path / "warm", 4 * MiB) as warm:
        from tieredkv import chunk_keys

        for seed in range(10, 30):
            tokens = prompt(seed)
            keys = chunk_keys(SPEC, tokens[:32])
            present = np.flatnonzero(warm.contains_many(keys))
            if len(present):
                out = np.zeros((len(present), SPEC.block_bytes), np.uint8)
                assert warm.get_many(keys.take(present), out) == len(present)
                expect = kv_for(SPEC, tokens)
                for row, b in enumerate(present.tolist()):
                    want = np.ascontiguousarray(expect[:, :, :, 4 * b:4 * b + 4, :]).view(np.uint8).reshape(-1)
                    assert out[row].tobytes() == want.tobytes(), f"prompt {seed} block {b}"


def _stuck_warm_put(cache, monkeypatch):
    """Make the cache's warm ``put_many`` block until ``release`` is set; ``started`` is set once it is
    entered. Returns ``(started, release, real_put)``."""
    started, release = threading.Event(), threading.Event()
    real_put = cache.warm.put_many

    def stuck_put(keys, payloads):
        started.set()
        assert release.wait(60)
        return real_put(keys, payloads)

    monkeypatch.setattr(cache.warm, "put_many", stuck_put)
    return started, release, real_put


def test_store_returns_while_the_warm_write_is_still_blocked(tmp_path, seg_name, monkeypatch):
    """The request path never waits for the warm tier: store returns while warm.put_many is stuck."""
    cache = TieredCache(SPEC, 8 * MiB, tmp_path / "warm", 4 * MiB, hot_name=seg_name)
    started, release, real_put = _stuck_warm_put(cache, monkeypatch)
    try:
        tokens = prompt(7)
        kv = kv_for(SPEC, tokens)
        assert cache.store(tokens, kv) == 8                  # returned: the warm write has not happened
        assert started.wait(60)                              # the background thread is inside put_many
        kv[:] = 0                                            # the caller reuses its buffer at once
        assert cache.stats()["warm_queued_blocks"] == 8
        assert cache.warm.stats().used_blocks == 0
        release.set()
        assert cache.flush(60)
        assert cache.warm.stats().used_blocks == 8
        # The bytes written are the ones stored, not the zeros the caller wrote afterwards.
        out = np.zeros((8, SPEC.block_bytes), np.uint8)
        from tieredkv import chunk_keys

        assert real_put.__self__.get_many(chunk_keys(SPEC, tokens[:32]), out) == 8
        want = kv_for(SPEC, tokens)
        assert out[3].tobytes() == np.ascontiguousarray(want[:, :, :, 12:16, :]).tobytes()
    finally:
        release.set()
        cache.close()


@pytest.mark.procs
def test_a_full_queue_drops_and_counts(tmp_path, seg_name, monkeypatch):
    """A queue bounded to one block: while that block's write is stuck, the rest are dropped and
    counted (per host, in the segment), never queued without bound."""
    cache = TieredCache(SPEC, 8 * MiB, tmp_path / "warm", 4 * MiB, hot_name=seg_name,
                        warm_queue_bytes=SPEC.block_bytes)
    started, release, real_put = _stuck_warm_put(cache, monkeypatch)
    try:
        tokens = prompt(8)
        assert cache.store(tokens, kv_for(SPEC, tokens)) == 8
        st = cache.stats()
        assert (st["warm_queued_blocks"], st["warm_dropped_blocks"]) == (1, 7)
        release.set()
        assert cache.flush(60)
        assert cache.warm.stats().used_blocks == 1
    finally:
        release.set()
        cache.close()
    out = subprocess.run([sys.executable, "-m", "tieredkv", "stats", seg_name, "--json", "-"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    counters = json.loads(out.stdout)["cache"]
    assert (counters["warm_queued_blocks"], counters["warm_dropped_blocks"]) == (1, 7)
    pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")
    from prometheus_client.parser import text_string_to_metric_families

    from tieredkv import metrics

    got = {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(metrics.render([seg_name]))
           for s in fam.samples if s.name == "tieredkv_warm_write_behind_blocks_total"}
    assert got == {"queued": 1, "dropped": 7}


def test_write_through_and_on_evict_stay_available(tmp_path, seg_name):
    with TieredCache(SPEC, 8 * MiB, tmp_path / "warm", 4 * MiB, hot_name=seg_name,
                     demotion="write_through") as cache:
        tokens = prompt(9)
        cache.store(tokens, kv_for(SPEC, tokens))
        assert cache.warm.stats().used_blocks == 8           # written before store returned
        assert cache.stats()["warm_queued_blocks"] == 0
    with TieredCache(SPEC, 8 * MiB, tmp_path / "warm2", 4 * MiB, hot_name=seg_name + "b",
                     demotion="on_evict") as cache:
        tokens = prompt(9)
        cache.store(tokens, kv_for(SPEC, tokens))
        assert cache.flush() and cache.warm.stats().used_blocks == 0   # written only when evicted
        cache.hot.unlink()


def test_reused_payload_buffers_never_overwrite_a_queued_write(tmp_path, seg_name, monkeypatch):
    """Write-behind copies a job's blocks out of the hot tier when its turn comes, and stores gather
    through one reused buffer: with the first write stuck, a second store reuses that buffer while
    both writes are queued; after the flush a third store reuses it again; every block in warm holds
    the bytes its own prompt stored."""
    cache = TieredCache(SPEC, 8 * MiB, tmp_path / "warm", 4 * MiB, hot_name=seg_name)
    started, release = threading.Event(), threading.Event()
    real_put = cache.warm.put_many

    def first_put_stuck(keys, payloads):
        if not started.is_set():
            started.set()
            assert release.wait(60)
        return real_put(keys, payloads)

    monkeypatch.setattr(cache.warm, "put_many", first_put_stuck)
    try:
        for seed in (21, 22):
            tokens = prompt(seed)
            assert cache.store(tokens, kv_for(SPEC, tokens)) == 8
        assert started.wait(60)
        release.set()
        assert cache.flush(60)
        tokens = prompt(23)
        assert cache.store(tokens, kv_for(SPEC, tokens)) == 8   # into a reused buffer
        assert cache.flush(60)
        from tieredkv import chunk_keys

        for seed in (21, 22, 23):
            tokens = prompt(seed)
            out = np.zeros((8, SPEC.block_bytes), np.uint8)
            assert real_put.__self__.get_many(chunk_keys(SPEC, tokens[:32]), out) == 8
            want = kv_for(SPEC, tokens)
            for b in range(8):
                block = np.ascontiguousarray(want[:, :, :, 4 * b:4 * b + 4, :]).tobytes()
                assert out[b].tobytes() == block, (seed, b)
    finally:
        release.set()
        cache.close()


def test_a_failing_warm_write_behind_is_counted_and_stores_go_on(tmp_path, seg_name, monkeypatch):
    """Every warm write fails (a full disk) on the writer thread: each store still succeeds at once, the
    failures are counted per host, the writer keeps running, and what the hot tier holds loads right."""
    import errno

    cache = TieredCache(SPEC, 8 * MiB, tmp_path / "warm", 4 * MiB, hot_name=seg_name)
    monkeypatch.setattr(os, "pwritev", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    try:
        # The operator is told once (the writer thread warns), and stores go on.
        with pytest.warns(RuntimeWarning, match="warm tier failed .*No space left on device"):
            for seed in (31, 32, 33):
                tokens = prompt(seed)
                assert cache.store(tokens, kv_for(SPEC, tokens)) == 8
                assert cache.flush(60)                    # the writer survived the previous failure
        st = cache.stats()
        assert st["warm_errors"] >= 1 and st["warm_queued_blocks"] == 24 and st["warm_bytes_written"] == 0
        assert cache.warm.stats().used_blocks == 0
        tokens = prompt(33)
        out = np.zeros((2, 2, 2, 33, 8), np.float16)
        assert cache.load(cache.lookup(tokens), out) == 32
        assert same_bytes(out[:, :, :, :32], kv_for(SPEC, tokens)[:, :, :, :32])
    finally:
        monkeypatch.undo()
        cache.close()
