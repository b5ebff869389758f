"""Work split in two halves, one on the calling thread and one on a second thread, for copies large enough
to pay for the hand-over (a warm restore of a long prefix, its promotion into the hot tier).

```
run(first, second) ── helper free, a CPU free ──► second() on the helper thread, first() here, then wait
                   └─ helper busy, CPUs busy ───► first(), then second(), both here
```

A restore on one thread is bound by one core: reading a group from the page cache, hashing it and
copying it into place all wait for each other. Split in two halves, each half keeps that one-pass shape
on its own core (docs/benchmarks.md has the figures). Each ``Halves`` owns one helper thread, started on
first use. ``run`` never waits for it: a caller that finds it busy (another thread of the process is
using it) does both halves itself, and so does a thread pinned to one CPU, or one on a host whose CPUs
are busy (``other_cpu_free``: runnable threads and load average). In a forked child, where the parent's
thread does not exist, a new one is started. Both halves have finished, or failed, when ``run`` returns;
an exception from either is raised by ``run`` (the first half's, if both fail).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from tieredkv import forksafe

#: Work on fewer bytes than this runs on the calling thread alone (``Halves.split``): handing half of it
#: over costs about 0.1 ms, what copying a few MiB saves.
SPLIT_BYTES = 4 << 20


def other_cpu_free() -> bool:
    """Whether this thread may use 2+ CPUs (its affinity and the process's cgroup CPU quota) and the host
    leaves one free: fewer threads runnable right now than it has CPUs (the caller counts), and a
    1-minute load average below the CPU count less one half (the instant count alone may catch a lull
    in a busy host; the average alone lags a burst by tens of seconds). On busy CPUs a split copy takes
    as long as one thread's (its halves share the cores with the other work) and spends more CPU time:
    the two threads stall on the same memory bandwidth (docs/benchmarks.md). False where the load
    cannot be read."""
    if len(os.sched_getaffinity(0)) < 2 or _cpu_quota() < 2:
        return False
    load = _host_load()
    if load is None:
        return False
    average, runnable = load
    cpus = os.cpu_count() or 1
    return average < cpus - 0.5 and runnable < cpus


def _host_load() -> tuple[float, int] | None:
    """The host's 1-minute load average and its threads runnable now (``/proc/loadavg``), or None."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return float(fields[0]), int(fields[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _cpu_quota(membership: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float:
    """The CPUs this process's cgroup may use at once (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``);
    infinity without a quota, or where it cannot be read."""
    try:
        with open(membership) as f:
            groups = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
    except OSError:
        return math.inf
    try:
        if "" in groups:  # v2: one hierarchy
            with open(f"{root}{groups[''].rstrip('/')}/cpu.max") as f:
                quota, period = f.read().split()[:2]
            return math.inf if quota == "max" else int(quota) / int(period)
        controller = next(c for c in groups if "cpu" in c.split(","))
        base = f"{root}/{controller}{groups[controller].rstrip('/')}"
        with open(f"{base}/cpu.cfs_quota_us") as f, open(f"{base}/cpu.cfs_period_us") as g:
            quota_us, period_us = int(f.read()), int(g.read())
        return math.inf if quota_us < 0 else quota_us / period_us
    except (OSError, ValueError, StopIteration, ZeroDivisionError):
        return math.inf


def _settle(future: Future) -> BaseException | None:
    """Wait until ``future`` is done, even through an interruption (Ctrl-C, a signal handler's exception):
    the helper's half must not go on writing after ``run`` returned or raised. Returns the interruption,
    to be raised once the half ended."""
    interrupted: BaseException | None = None
    while True:
        try:
            futures_wait([future])
            return interrupted
        except BaseException as e:  # re-raised by the caller once the half ended
            interrupted = interrupted or e


class Halves:
    """One helper thread that runs the second half of a split piece of work (see the module docstring)."""

    def __init__(self, name: str):
        self._name = name
        self._free = threading.Lock()  # held by the ``run`` using the helper; never waited for
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        forksafe.register(self)  # ``_free`` unlocked in a forked child: a parent's thread may hold it

    def split(self, n: int, item_bytes: int, part: Callable[[int, int], None], step: int = 1) -> bool:
        """``part(0, n)`` over ``n`` items of ``item_bytes`` each, as ``part(0, h)`` and ``part(h, n)``
        through ``run`` when they hold ``SPLIT_BYTES`` or more (``h`` a multiple of ``step``: whole
        groups); return whether they were split. The parts must touch disjoint memory."""
        h = -(-n // step // 2) * step
        if n * item_bytes < SPLIT_BYTES or not 0 < h < n:
            part(0, n)
            return False
        return self.run(lambda: part(0, h), lambda: part(h, n))

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> bool:
        """Run ``first`` and ``second``, at once when the helper is free; return whether they were split.

        The two must touch disjoint memory (and be safe to run on two threads). Raises what either raised,
        once both ended.
        """
        if not other_cpu_free() or not self._free.acquire(blocking=False):
            first()
            second()
            return False
        try:
            other = self._submit(second)
            if other is None:
                first()
                second()
                return False
            try:
                first()
            except BaseException:
                _settle(other)  # the helper's half ends before this raises; the first half's error wins
                raise
            interrupted = _settle(other)
            if interrupted is not None:
                raise interrupted
            other.result()
        finally:
            self._free.release()
        return True

    def _submit(self, second: Callable[[], None]) -> Future | None:
        """``second`` queued for the helper thread (started here if need be), or None when no thread can
        run it now (call with ``_free`` held)."""
        pool = self._pool
        if pool is None or self._pid != os.getpid():
            pool = self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
            self._pid = os.getpid()
        try:
            return pool.submit(second)
        except RuntimeError:
            # The interpreter is shutting down, ``close`` shut this pool down meanwhile, or the thread
            # could not start (a thread limit): then ``second`` may already sit in the pool's queue, and
            # must never run later, beside other work. Drop the pool, cancelling what it holds.
            self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            return None

    def close(self) -> None:
        """Stop the helper thread. Never waits for a ``run`` in progress (this very thread may be inside one,
        in a signal handler, say, or be the helper itself, running a finalizer): the thread then ends after
        the half it runs, and ``run`` still waits for that half. A later ``run`` starts a new thread."""
        pool, self._pool = self._pool, None
        if pool is None or self._pid != os.getpid():
            return
        idle = self._free.acquire(blocking=False)
        try:
            on_helper = threading.current_thread().name.startswith(self._name)
            pool.shutdown(wait=idle and not on_helper)
        finally:
            if idle:
                self._free.release()
