"""``tieredkv.halves.Halves``: two halves of a piece of work, on the calling thread and on a helper thread
when it is free and the host has a CPU free, else one after the other on the calling thread; errors of
either half are raised. The tests of the split itself say the host has a CPU free (``free_cpu``): the
suite runs on busy CPUs, where ``Halves`` rightly does not split; ``other_cpu_free`` is tested alone."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tieredkv import halves as halves_module
from tieredkv.halves import Halves, other_cpu_free


def recorder():
    where: dict[str, int] = {}

    def half(name: str):
        return lambda: where.__setitem__(name, threading.get_ident())

    return where, half


@pytest.fixture
def free_cpu(monkeypatch):
    """The host has a CPU free whatever its load (the suite's own tests keep both CPUs busy)."""
    monkeypatch.setattr(halves_module, "other_cpu_free", lambda: True)


@pytest.fixture
def halves(free_cpu):
    h = Halves("test-halves")
    yield h
    h.close()


def needs_two_cpus():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this machine gives the test one CPU: Halves never splits there")


def test_the_second_half_runs_on_the_helper_while_the_first_runs_here(halves):
    needs_two_cpus()
    where, half = recorder()
    both = threading.Barrier(2, timeout=10)  # passes only if the two halves run at the same time

    assert halves.run(lambda: (both.wait(), half("first")()), lambda: (both.wait(), half("second")()))
    assert where["first"] == threading.get_ident() != where["second"]


def test_a_busy_helper_or_busy_cpus_run_both_halves_here_in_order(halves, monkeypatch):
    order = []
    assert halves._free.acquire(blocking=False)
    try:
        assert not halves.run(lambda: order.append(("first", threading.get_ident())),
                              lambda: order.append(("second", threading.get_ident())))
    finally:
        halves._free.release()
    assert order == [("first", threading.get_ident()), ("second", threading.get_ident())]
    monkeypatch.setattr(halves_module, "other_cpu_free", lambda: False)
    assert not halves.run(lambda: None, lambda: None)
    assert [t for t in threading.enumerate() if t.name.startswith("test-halves")] == []  # never started


def test_a_cpu_is_free_only_when_fewer_threads_run_than_cpus_and_the_load_average_is_low(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    mask = os.sched_getaffinity(0)
    for average, runnable, free in ((0.0, 1, True), (3.4, 3, True), (3.5, 1, False), (9.0, 1, False),
                                    (0.2, 4, False), (0.2, 9, False)):
        monkeypatch.setattr(halves_module, "_host_load", lambda a=average, r=runnable: (a, r))
        assert other_cpu_free() == (free and len(mask) >= 2), (average, runnable)
    monkeypatch.setattr(halves_module, "_host_load", lambda: (0.0, 1))
    os.sched_setaffinity(0, {min(mask)})  # this thread only (Linux affinity is per thread)
    try:
        assert not other_cpu_free()
    finally:
        os.sched_setaffinity(0, mask)


def test_the_host_load_is_read_from_proc_loadavg():
    average, runnable = halves_module._host_load()
    assert average >= 0 and runnable >= 1  # this very thread is running


def test_an_error_in_either_half_is_raised_after_both_ended(halves):
    needs_two_cpus()
    ended = []

    def slow_second():
        time.sleep(0.2)
        ended.append("second")

    with pytest.raises(ZeroDivisionError):
        halves.run(lambda: 1 / 0, slow_second)
    assert ended == ["second"]  # run waited for the helper's half before raising

    with pytest.raises(KeyError):
        halves.run(lambda: None, lambda: {}["missing"])

    with pytest.raises(ZeroDivisionError):  # both fail: the first half's error wins
        halves.run(lambda: 1 / 0, lambda: {}["missing"])
    assert halves.run(lambda: None, lambda: None)  # the helper was given back every time


def test_close_stops_the_thread_and_a_later_run_starts_a_new_one(halves):
    needs_two_cpus()
    where, half = recorder()
    assert halves.run(half("first"), half("second"))
    helper = [t for t in threading.enumerate() if t.name.startswith("test-halves")]
    assert len(helper) == 1
    halves.close()
    helper[0].join(5)
    assert not helper[0].is_alive()
    assert halves.run(half("first"), half("second"))
    assert where["second"] != threading.get_ident()


def test_a_run_while_the_interpreter_shuts_down_does_both_halves_here(tmp_path):
    needs_two_cpus()
    # At exit, concurrent.futures refuses new work ("cannot schedule new futures after interpreter
    # shutdown"): a restore in an atexit handler must still work, on one thread.
    import subprocess
    import sys

    script = tmp_path / "at_exit.py"
    script.write_text(
        "import atexit, threading\n"
        "from tieredkv import halves\n"
        "halves.other_cpu_free = lambda: True\n"
        "h = halves.Halves('exit-halves')\n"
        "h.run(lambda: None, lambda: None)\n"  # the helper thread exists before shutdown begins
        "def at_exit():\n"
        "    where = []\n"
        "    split = h.run(lambda: where.append(1), lambda: where.append(2))\n"
        "    print('split' if split else 'alone', where)\n"
        "atexit.register(at_exit)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0].endswith("[1, 2]"), out.stdout


def test_a_half_queued_when_the_thread_could_not_start_never_runs_later(halves, monkeypatch):
    # A thread limit (pids cgroup, RLIMIT_NPROC): submit queues the half, then fails to start the
    # thread. That half ran on the caller; it must not run again beside a later run's work.
    needs_two_cpus()
    real_start = threading.Thread.start
    failures = [RuntimeError("can't start new thread")]

    def start(self):
        if failures:
            raise failures.pop()
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    ran: list[str] = []
    assert not halves.run(lambda: ran.append("first 1"), lambda: ran.append("second 1"))
    assert ran == ["first 1", "second 1"]
    assert halves.run(lambda: ran.append("first 2"), lambda: ran.append("second 2"))
    time.sleep(0.2)
    assert sorted(ran[2:]) == ["first 2", "second 2"]  # "second 1" did not run again


@pytest.mark.parametrize("where", ["first", "second"])
def test_close_inside_a_run_returns_at_once_and_the_run_still_ends(halves, where):
    # A signal handler closing the cache while this thread is inside a restore (first), or a sink that
    # closes it from the helper's half (second): close must not wait for the run it is part of.
    needs_two_cpus()
    done: list[str] = []

    def closing():
        halves.close()
        done.append(where)

    def other():
        time.sleep(0.1)
        done.append("other")

    # On a thread of its own, so that a close that waits for its own run fails this test, not hangs it.
    runner = threading.Thread(target=halves.run, daemon=True,
                              args=(closing if where == "first" else other, closing if where == "second" else other))
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "close() waited for the run it was called from"
    assert sorted(done) == sorted([where, "other"])
    assert halves.run(lambda: None, lambda: None)  # a new helper thread


def test_an_interruption_while_waiting_is_raised_only_once_the_helpers_half_ended(halves):
    # Ctrl-C or a signal handler's exception arriving while run waits for the helper: the helper's half
    # goes on writing the destination, so run must not return (or raise) before it ends.
    needs_two_cpus()
    import signal

    class Stop(Exception):
        pass

    def on_alarm(signum, frame):
        raise Stop

    written = []
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Stop):
            halves.run(lambda: None, lambda: (time.sleep(0.5), written.append("second")))
        assert written == ["second"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_no_free_cpu_when_the_load_cannot_be_read_or_a_cgroup_quota_allows_one(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(halves_module, "_host_load", lambda: None)
    assert not other_cpu_free()
    monkeypatch.setattr(halves_module, "_host_load", lambda: (0.0, 1))
    monkeypatch.setattr(halves_module, "_cpu_quota", lambda: 1.0)
    assert not other_cpu_free()


@pytest.mark.parametrize(("membership", "files", "quota"), [
    ("0::/job\n", {"job/cpu.max": "150000 100000\n"}, 1.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, float("inf")),
    ("4:memory:/x\n1:cpu,cpuacct:/job\n", {"cpu,cpuacct/job/cpu.cfs_quota_us": "300000\n",
                                           "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, float("inf")),
    ("0::/gone\n", {}, float("inf")),  # unreadable: no quota assumed
])
def test_the_cgroup_cpu_quota_is_read_from_v2_and_v1(tmp_path, membership, files, quota):
    (tmp_path / "cgroup").write_text(membership)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert halves_module._cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == quota


@pytest.mark.parametrize(("n", "item", "step", "parts"), [
    (3, 1 << 20, 1, [(0, 3)]),                       # 3 MiB: under SPLIT_BYTES, one call
    (8, 1 << 20, 1, [(0, 4), (4, 8)]),
    (9, 1 << 20, 1, [(0, 5), (5, 9)]),
    (24, 1 << 20, 5, [(0, 15), (15, 24)]),           # whole groups of 5: 3 of the 5 on this thread
    (5, 1 << 20, 5, [(0, 5)]),                       # one group: nothing to split
])
def test_split_cuts_at_whole_steps_from_split_bytes_on(halves, n, item, step, parts):
    got = []
    split = halves.split(n, item, lambda a, b: got.append((a, b)), step=step)
    assert sorted(got) == parts
    assert split == (len(parts) == 2)
