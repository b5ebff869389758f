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
are busy (``other_cpu_free``). In a forked child, where the parent's thread does not exist, a new one is
started. Both halves have finished, or failed, when ``run`` returns; an exception from either is raised
by ``run`` (the first half's, if both fail).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tieredkv import forksafe


def other_cpu_free() -> bool:
    """Whether this thread may run on 2+ CPUs and the host leaves one free: its 1-minute load average
    (which counts the caller itself) is below the host's CPU count less one half. On busy CPUs a split
    copy takes as long as one thread's (its halves share the cores with the other work) and spends more
    CPU time: the two threads stall on the same memory bandwidth (docs/benchmarks.md)."""
    return len(os.sched_getaffinity(0)) >= 2 and os.getloadavg()[0] < (os.cpu_count() or 1) - 0.5


class Halves:
    """One helper thread that runs the second half of a split piece of work (see the module docstring)."""

    def __init__(self, name: str):
        self._name = name
        self._free = threading.Lock()  # held by the ``run`` using the helper; never waited for
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        forksafe.register(self)  # ``_free`` unlocked in a forked child: a parent's thread may hold it

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> bool:
        """Run ``first`` and ``second``, at once when the helper is free; return whether they were split.

        The two must touch disjoint memory (and be safe to run on two threads). Raises what either raised.
        """
        if not other_cpu_free() or not self._free.acquire(blocking=False):
            first()
            second()
            return False
        try:
            try:
                if self._pool is None or self._pid != os.getpid():
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
                    self._pid = os.getpid()
                other = self._pool.submit(second)
            except RuntimeError:  # the interpreter is shutting down: it starts no thread now
                other = None
            if other is None:
                first()
                second()
                return False
            try:
                first()
            except BaseException:
                other.exception()  # the helper's half ends before this returns; the first half's error wins
                raise
            other.result()
        finally:
            self._free.release()
        return True

    def close(self) -> None:
        """Stop the helper thread (once a half it may be running ends). A later ``run`` starts a new one."""
        with self._free:  # no half in progress, and none starts meanwhile
            pool, self._pool = self._pool, None
            if pool is not None and self._pid == os.getpid():
                pool.shutdown(wait=True)
