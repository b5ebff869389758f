"""A bounded background writer: work that must not sit on a request's path (writing blocks to the warm or
remote tier) runs on one daemon thread, from a queue bounded in blocks.

```
store() ──submit(job, blocks)──► [ queue, at most max_blocks pending ] ──► worker thread runs job()
            │ full: job dropped, counted (backpressure, never an unbounded queue)
close() ──flush(timeout_s)──► waits until the queue is empty or the bound passes, then stops the thread
```

The thread runs at a lower CPU priority than the requests (``nice``, default ``WRITER_NICE``; Linux,
where each thread has its own nice value): on a host whose cores the model's forwards keep busy, the
copies and checksums of write-behind take what the forwards leave instead of slowing them down. The
writer still gets a share of a busy core (about 10% at nice 10 against 0), and a full queue drops and
counts, as always.

A job is a callable with no arguments; it owns its data (the caller hands it copies, never views of
buffers it will reuse). An exception raised by a job is caught, counted and handed to ``on_error``: the
writer keeps running. After ``fork`` the child starts with an unlocked condition (``tieredkv.forksafe``:
the parent's writer may have held it at that instant), an empty queue and a thread of its own on the
first ``submit`` (threads do not survive fork; the parent's pending jobs stay the parent's).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Callable

from tieredkv import forksafe
from tieredkv.errors import InvalidInput

#: How much lower than the process the writer threads run (added to the thread's nice value; 0 keeps
#: it). Only where threads have nice values of their own (Linux).
WRITER_NICE = 10


class BackgroundWriter:
    """Runs submitted jobs in order on one daemon thread; at most ``max_blocks`` blocks pending.

    Args:
        name: the thread's name (shows in stack dumps and ``py-spy``).
        max_blocks: bound on the blocks held by queued jobs; a job that would exceed it is dropped.
        on_error: called with the exception of a job that raised (on the writer thread).
        nice: added to the writer thread's nice value when it starts (Linux; ignored elsewhere, and
            where the process may not change it).

    Attributes:
        submitted, done, dropped, failed: counts of jobs (``done``: finished, failed ones included;
            ``dropped``: refused because the queue was full or the writer closed; ``failed``: raised).
        dropped_blocks: blocks in dropped jobs.
    """

    def __init__(self, name: str, max_blocks: int, on_error: Callable[[BaseException], None] | None = None,
                 nice: int = WRITER_NICE):
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise InvalidInput(f"max_blocks must be a positive int, got {max_blocks!r}")
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise InvalidInput(f"nice must be an int in [0, 19], got {nice!r}")
        self.name = name
        self.nice = nice
        self.max_blocks = max_blocks
        self._on_error = on_error
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[Callable[[], None], int]] = collections.deque()
        self._pending_blocks = 0
        self._running = 0        # jobs taken off the queue and not finished yet (0 or 1)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.submitted = self.done = self.dropped = self.failed = self.dropped_blocks = 0
        forksafe.register(self)  # a child gets an unlocked condition, an empty queue and no thread

    def _after_fork_in_child(self) -> None:
        # Nothing queued here is this process's to run, and no thread of the parent survived. The
        # counters are reset on the child's first submit (_after_fork), as before.
        self._queue.clear()
        self._pending_blocks = self._running = 0
        self._thread = None

    @property
    def pending_blocks(self) -> int:
        """Blocks in jobs queued or running."""
        with self._cond:
            return self._pending_blocks

    def submit(self, job: Callable[[], None], blocks: int = 1) -> bool:
        """Queue ``job``; return False (and count a drop) when the queue is full or the writer is closed."""
        with self._cond:
            self._after_fork()
            if self._closed or self._pending_blocks + blocks > self.max_blocks:
                self.dropped += 1
                self.dropped_blocks += blocks
                return False
            self._queue.append((job, blocks))
            self._pending_blocks += blocks
            self.submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued job has run, at most ``timeout_s``; return whether the queue is empty."""
        with self._cond:
            if self._pid != os.getpid():
                return True  # nothing of ours is queued in a forked child that never submitted
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Flush within ``timeout_s``, then stop the thread; jobs still queued are dropped and counted,
        and a dropped job that has a ``dropped()`` method is told (it never runs).

        Idempotent. Returns whether everything queued was written.
        """
        flushed = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            left = list(self._queue)
            for _, blocks in left:
                self.dropped += 1
                self.dropped_blocks += blocks
                self._pending_blocks -= blocks
            self._queue.clear()
            self._cond.notify_all()
        for job, _ in left:  # outside the lock: a job's hook may take locks of its own
            dropped = getattr(job, "dropped", None)
            if callable(dropped):
                try:
                    dropped()
                except Exception:  # noqa: BLE001 - one job's hook must not keep the others' from running
                    pass
        return flushed

    def _after_fork(self) -> None:
        # Called with the lock held. A forked child inherits the deque but not the thread.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._queue.clear()
            self._pending_blocks = self._running = 0
            self._thread = None
            self.submitted = self.done = self.dropped = self.failed = self.dropped_blocks = 0

    def _lower_priority(self) -> None:
        if not self.nice or not sys.platform.startswith("linux"):
            return
        tid = threading.get_native_id()  # on Linux a thread is a task: its own nice value
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))
        except OSError:
            pass  # not allowed here (a sandbox): the writer runs at the process's priority

    def _run(self) -> None:
        self._lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                job, blocks = self._queue.popleft()
                self._running += 1
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - a failing job must not kill the writer
                with self._cond:
                    self.failed += 1
                if self._on_error is not None:
                    try:
                        self._on_error(e)
                    except Exception:  # noqa: BLE001 - the error hook is best effort
                        pass
            finally:
                with self._cond:
                    self._running -= 1
                    self._pending_blocks -= blocks
                    self.done += 1
                    self._cond.notify_all()
