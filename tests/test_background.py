"""The bounded background writer: order, backpressure, flush, errors, fork."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tieredkv.background import WRITER_NICE, BackgroundWriter
from tieredkv.errors import InvalidInput


def test_runs_jobs_in_order_and_flushes():
    seen = []
    w = BackgroundWriter("t", max_blocks=100)
    for i in range(50):
        assert w.submit(lambda i=i: seen.append(i), blocks=2)
    assert w.flush(10.0)
    assert seen == list(range(50))
    assert (w.submitted, w.done, w.dropped, w.pending_blocks) == (50, 50, 0, 0)
    assert w.close()


def test_full_queue_drops_and_counts():
    gate = threading.Event()
    w = BackgroundWriter("t", max_blocks=4)
    assert w.submit(gate.wait, blocks=3)          # occupies the writer
    assert not w.submit(lambda: None, blocks=2)   # 3 + 2 > 4: dropped
    assert w.submit(lambda: None, blocks=1)
    assert (w.dropped, w.dropped_blocks, w.pending_blocks) == (1, 2, 4)
    assert not w.flush(0.05)                      # the first job is still blocked
    gate.set()
    assert w.flush(10.0) and w.pending_blocks == 0


def test_close_bounds_the_wait_and_drops_the_rest():
    gate = threading.Event()
    w = BackgroundWriter("t", max_blocks=10)
    w.submit(gate.wait)
    w.submit(lambda: None)
    assert not w.close(timeout_s=0.05)
    assert w.dropped == 1
    assert not w.submit(lambda: None)             # closed
    gate.set()


def test_a_failing_job_is_counted_and_the_writer_goes_on():
    errors, seen = [], []
    w = BackgroundWriter("t", max_blocks=10, on_error=errors.append)
    w.submit(lambda: 1 / 0)
    w.submit(lambda: seen.append("after"))
    assert w.flush(10.0)
    assert w.failed == 1 and isinstance(errors[0], ZeroDivisionError) and seen == ["after"]


@pytest.mark.procs
def test_forked_child_gets_its_own_writer():
    w = BackgroundWriter("t", max_blocks=10)
    w.submit(lambda: None)
    w.flush(10.0)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a fresh queue and thread on first submit
        ok = w.submitted == 1 and w.submit(lambda: os.write(wfd, b"x")) and w.flush(10.0)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.read(r, 1) == b"x"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_bound(bad):
    with pytest.raises(InvalidInput, match="max_blocks"):
        BackgroundWriter("t", max_blocks=bad)


@pytest.mark.parametrize("bad", [-1, 20, 2.0, True])
def test_bad_nice(bad):
    with pytest.raises(InvalidInput, match="nice"):
        BackgroundWriter("t", max_blocks=4, nice=bad)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 10])
def test_the_writer_thread_runs_below_the_callers_priority(nice):
    """Write-behind takes what the requests leave: its thread's nice value is the caller's plus ``nice``
    (the default is WRITER_NICE); the calling thread's own priority is unchanged."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    w = BackgroundWriter("t", max_blocks=4, nice=nice)
    assert w.submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    assert w.flush(10.0) and w.close()
    assert seen == [min(19, mine + nice)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert BackgroundWriter("t", max_blocks=4).nice == WRITER_NICE > 0
