"""Lookups and loads never wait for a write (issue 19, item 3).

The write-behind writer calls ``WarmTier.put_many`` on its own thread. A put waits for the tier's
writer lock (up to ``lock_timeout_s`` when a peer is stopped inside a write transaction) and copies its
batch into the slabs; neither may hold up this process's ``match`` / ``contains_many`` / ``get_many``,
which read through LMDB read transactions (MVCC: never blocked by a writer). These are liveness checks:
a reader stuck behind the write is the failure; the bounds are generous, not benchmarks.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tieredkv import KVSpec, PutResult, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS, check_index, payload_for

SPEC = KVSpec(**TEST_SPEC_ARGS)
SLOT = 4096
ROOT = Path(__file__).resolve().parent.parent
PROMPT = 2.0  # seconds: far above a lookup's cost, far below a stopped peer's lock_timeout_s


def keys(start, n):
    return chunk_keys(SPEC, np.arange(start, start + n * SPEC.chunk_tokens))


def served(tier, k) -> int:
    out = np.zeros((len(k), SPEC.block_bytes), np.uint8)
    n = tier.get_many(k, out)
    np.testing.assert_array_equal(out[:n], payload_for(k[:n], SPEC.block_bytes))
    return n


def _timed_reads(tier, k) -> tuple[float, tuple[int, int, int]]:
    """Run a lookup, a membership check and a load on a helper thread; (seconds, results).

    The helper thread lets a hang fail the test (after a bound) instead of hanging the suite.
    """
    box: dict = {}

    def go():
        t0 = time.monotonic()
        box["r"] = (tier.match(k), int(tier.contains_many(k).sum()), served(tier, k))
        box["s"] = time.monotonic() - t0

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(timeout=30)
    assert not th.is_alive(), "lookups still waiting behind the write after 30 s"
    return box["s"], box["r"]


_STOPPED_WRITER = """
import os, signal
from tieredkv import KVSpec
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS
t = WarmTier(KVSpec(**TEST_SPEC_ARGS), {root!r})
def body(txn):
    txn.put(b"x", b"y", db=t._index.info)
    print("inside", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a paused container, a debugger
t._index.write(body)
"""


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.procs
def test_reads_do_not_wait_while_our_writer_waits_for_a_stopped_peer(tmp_path):
    root = tmp_path / "warm"
    stored = keys(0, 8)
    t = WarmTier(SPEC, root, capacity_bytes=64 * SLOT, lock_timeout_s=20.0)
    assert (t.put_many(stored, payload_for(stored, SPEC.block_bytes)) == PutResult.STORED).all()
    child = subprocess.Popen([sys.executable, "-c", _STOPPED_WRITER.format(root=str(root))],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    writer = None
    try:
        assert child.stdout.readline().strip() == "inside"
        for _ in range(3000):
            if _proc_state(child.pid) == "T":
                break
            time.sleep(0.01)
        assert _proc_state(child.pid) == "T"
        # Our own writer (the write-behind thread's put) now waits for the stopped peer's lock.
        waiting = threading.Event()
        acquire = t._index.owners.acquire_writer

        def acquire_noted(timeout_s):
            waiting.set()
            return acquire(timeout_s)

        t._index.owners.acquire_writer = acquire_noted
        new = keys(1000, 4)
        result: dict = {}

        def put():
            try:
                result["codes"] = t.put_many(new, payload_for(new, SPEC.block_bytes))
            except Exception as e:  # noqa: BLE001 - reported below
                result["error"] = e

        writer = threading.Thread(target=put, daemon=True)
        writer.start()
        assert waiting.wait(timeout=30)
        time.sleep(0.2)  # well inside its wait now (20 s)
        seconds, got = _timed_reads(t, stored)
        # Before the fix these waited for the put's whole lock wait (20 s here).
        assert seconds < PROMPT, f"lookups took {seconds:.2f} s behind a waiting writer"
        assert got == (8, 8, 8)
        assert writer.is_alive(), "the put should still be waiting for the stopped peer"
        child.send_signal(signal.SIGCONT)  # the peer commits and exits; our put goes on
        assert child.wait(timeout=60) == 0
        writer.join(timeout=60)
        assert not writer.is_alive()
        assert "error" not in result, result
        assert (result["codes"] == PutResult.STORED).all()
        assert served(t, new) == 4
    finally:
        child.kill()
        child.wait(timeout=30)
        if writer is not None:
            writer.join(timeout=60)
        t.close()
    check_index(str(root / SPEC.namespace))


def test_reads_do_not_wait_while_a_large_put_copies(tmp_path):
    root = tmp_path / "warm"
    stored = keys(0, 8)
    t = WarmTier(SPEC, root, capacity_bytes=512 * SLOT)
    try:
        assert (t.put_many(stored, payload_for(stored, SPEC.block_bytes)) == PutResult.STORED).all()
        inside, release = threading.Event(), threading.Event()
        write = t._slabs.write

        def held_write(*a, **k):  # the batch copy, held half way until the readers are done
            inside.set()
            assert release.wait(timeout=60)
            return write(*a, **k)

        t._slabs.write = held_write
        big = keys(5000, 256)
        result: dict = {}

        def put():
            result["codes"] = t.put_many(big, payload_for(big, SPEC.block_bytes))

        writer = threading.Thread(target=put, daemon=True)
        writer.start()
        try:
            assert inside.wait(timeout=30)
            seconds, got = _timed_reads(t, stored)
            assert got == (8, 8, 8)
            assert seconds < PROMPT, f"lookups took {seconds:.2f} s behind a copy"
            # The batch is claimed, not committed: it is absent to readers, never half there.
            assert t.match(big) == 0 and not t.contains_many(big).any()
            assert t.get_many(big[:4], np.zeros((4, SPEC.block_bytes), np.uint8)) == 0
            assert writer.is_alive()
        finally:
            release.set()
            writer.join(timeout=60)
        assert (result["codes"] == PutResult.STORED).all()
        assert served(t, big) == 256 and served(t, stored) == 8
    finally:
        t.close()
    check_index(str(root / SPEC.namespace))


@pytest.mark.procs
def test_fork_waits_for_a_read_transaction_and_the_child_reads(tmp_path):
    # Readers take no lock now, so fork must still never copy a read transaction open on another
    # thread (the child could not close the inherited environment): the index's gate holds fork
    # until the transaction ends, and the child opens its own environment and serves the blocks.
    import os

    root = tmp_path / "warm"
    stored = keys(0, 4)
    t = WarmTier(SPEC, root, capacity_bytes=64 * SLOT)
    try:
        assert (t.put_many(stored, payload_for(stored, SPEC.block_bytes)) == PutResult.STORED).all()
        inside, release = threading.Event(), threading.Event()
        lookup = t._lookup

        def held_lookup(*a, **k):  # runs inside the read transaction
            inside.set()
            assert release.wait(timeout=60)
            return lookup(*a, **k)

        t._lookup = held_lookup
        reader = threading.Thread(target=lambda: t.match(stored), daemon=True)
        reader.start()
        assert inside.wait(timeout=30)
        t._lookup = lookup
        threading.Timer(0.3, release.set).start()  # the transaction ends while fork waits for it
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if (t.match(stored), served(t, stored)) == (4, 4) else 2
            finally:
                os._exit(code)
        assert release.is_set()  # fork went on only after the reader's transaction ended
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        assert os.waitstatus_to_exitcode(status) == 0
        reader.join(timeout=30)
        assert served(t, stored) == 4
    finally:
        t.close()


def test_threads_reading_beside_evicting_writes_and_map_growth_get_only_right_bytes(tmp_path):
    # In-process readers now run beside the writer: every slot reuse (eviction) and every remap of
    # the index (a small initial map that must grow) happens while other threads read.
    root = tmp_path / "warm"
    t = WarmTier(SPEC, root, capacity_bytes=48 * SLOT, map_size_bytes=1 << 16)
    first_map = t.stats().extra["map_size"]
    stop = threading.Event()
    errors: list = []
    served_n = [0, 0]

    def write():
        try:
            for p in range(300):
                k = keys(100 * p, 12)
                t.put_many(k, payload_for(k, SPEC.block_bytes))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    def read(r):
        rng = np.random.default_rng(r)
        try:
            while not stop.is_set():
                k = keys(100 * int(rng.integers(0, 300)), 12)
                served_n[r] += served(t, k)  # served() asserts the bytes
                t.match(k)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    try:
        assert not any(th.is_alive() for th in threads), "a thread hung"
        assert not errors, errors
        assert t.stats().extra["map_size"] > first_map  # the map grew under the readers
        assert t.stats().evictions > 0 and sum(served_n) > 0
    finally:
        t.close()
    check_index(str(root / SPEC.namespace))
