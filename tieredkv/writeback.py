"""Writing behind from the top level: a queued write to a lower level carries keys, not bytes.

```
store()       model KV --gather--> the slots the top level claimed (shared memory): no buffer of its own
              keys --submit--> each written-behind level's BackgroundWriter
writer thread top level --copy out a group, pinned--> its staging rows --put--> the lower level
```

Once a block is in the top level the process needs no copy of its own for the levels below: their
writer threads copy it out of the top level's memory when its turn comes, a group of blocks at a
time. So no payload buffer lives on after ``store`` returns, and what a process keeps for writing is
bounded however large its stores are: one staging buffer (at most ``STAGE_BYTES``) per writer thread,
and one for levels written through in the storing thread.

The copy finds a block by its key and checks the slot's key, parent and tokens under a pin, so it never
reads another block's bytes, whatever happened to the slot meanwhile. Before a put of this process
makes the top level evict (fewer free slots than blocks to put), the queued jobs copy the blocks they
have not copied yet into memory of their own (``WriteBehind.before_put``): the eviction cannot take
them first. A block another process's put evicted before the writer reached it is not written and
is counted as dropped (for the warm tier: ``warm_dropped_blocks``), like a block a full queue refuses;
the writer lags by milliseconds, so that takes a top level that turns over in milliseconds. A block the
top level answered EXISTS for (another process stored it, or is storing it) is queued too, but its
absence is that process's business, not a drop. Jobs a closing writer drops are told (``dropped``) and
leave the cache's set of jobs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tieredkv import forksafe
from tieredkv.errors import TieredKVError
from tieredkv.keys import ChunkKeys
from tieredkv.layout import page_aligned_empty
from tieredkv.levels import Level

#: Bytes of one staging buffer (at least one block): large enough that per-call costs of a put are
#: spread over several blocks, small enough to stay in the CPU's caches between copy-out and put.
STAGE_BYTES = 4 << 20


class Staging:
    """Reused row buffers of at most ``max_rows`` rows each, for one thread at a time per buffer.

    A buffer is made on first use, as large as asked (up to ``max_rows``), and grows when a later use
    asks for more; at most ``keep`` buffers are kept between uses (a thread that finds none free gets
    a new one). Kept and reused, never allocated per call: fresh memory costs a page fault per 4 KiB
    on every store. Page-aligned, as copies into a buffer 16 bytes past a page boundary run slower.

    Args:
        block_bytes: bytes per row.
        max_bytes: the most bytes one buffer holds (at least one row).
        keep: buffers kept between uses.
    """

    def __init__(self, block_bytes: int, max_bytes: int | None = None, keep: int = 1):
        self.block_bytes = block_bytes
        self.max_rows = max(1, (STAGE_BYTES if max_bytes is None else max_bytes) // block_bytes)
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        forksafe.register(self)  # unlocked in a forked child (another thread may hold it at fork)

    @contextlib.contextmanager
    def rows(self, n: int) -> Iterator[np.ndarray]:
        """``(min(n, max_rows), block_bytes)`` uint8 rows, this caller's until the block ends."""
        n = min(max(n, 1), self.max_rows)
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or len(buf) < n:
            buf = page_aligned_empty(n * self.block_bytes).reshape(n, self.block_bytes)
        try:
            yield buf[:n]
        finally:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buf)

    def clear(self) -> None:
        """Drop the kept buffers (their memory goes back once nothing else refers to it)."""
        with self._lock:
            self._free.clear()


def copy_out(top: Level, keys: ChunkKeys, rows: np.ndarray) -> np.ndarray:
    """Copy the blocks ``top`` (the top level) holds among ``keys`` into ``rows``; return a bool per
    key: copied. Not a request's read: no hit counted, the eviction policy not told."""
    tier: Any = top.tier  # the top level is a HotTier (``touch``)
    n = len(keys)
    present = np.zeros(n, dtype=bool)
    i = 0
    while i < n:
        got = tier.get_many(keys[i:], rows[i:], touch=False)
        present[i:i + got] = True
        i += got + 1  # block i + got is not there (evicted since it was stored): skip it
    return present


class FromTop:
    """One queued write of ``keys`` to ``level``: the blocks are copied out of ``top`` (the top
    level) a group at a time through ``staging`` and put into ``level``. A block of ``ours`` the top
    level no longer holds is counted as dropped; any other one is left to the process that stores it.

    ``rescue()`` (from a thread about to make the top level evict) copies the blocks the writer has not
    copied yet into memory of the job's own at once, so an eviction cannot take them first.
    """

    def __init__(self, level: Level, top: Level, keys: ChunkKeys, staging: Staging, why: str = "stored",
                 done: Callable[[FromTop], None] | None = None, ours: np.ndarray | None = None):
        self.level, self.top, self.keys, self.staging, self.why = level, top, keys, staging, why
        #: Per key: this process stored it (its absence from the top level is a drop). Blocks another
        #: process stored or is still storing are queued too, but that process writes them itself.
        self.ours = np.ones(len(keys), dtype=bool) if ours is None else ours
        self._done = done
        self._lock = threading.Lock()  # over the copy out of the top level and the progress mark
        self._next = 0                 # keys before it are copied out (into staging, or rescued)
        self._rescued: tuple[int, np.ndarray, np.ndarray] | None = None  # (first key, rows, present)
        self._gone = 0

    def rescue(self) -> None:
        """Copy every block not copied yet out of the top level now (into a buffer of the job's own)."""
        with self._lock:
            first = self._next
            if first >= len(self.keys):
                return
            rest = self.keys[first:]
            rows = np.empty((len(rest), self.staging.block_bytes), dtype=np.uint8)
            try:
                present = copy_out(self.top, rest, rows)
            except TieredKVError:
                present = np.zeros(len(rest), dtype=bool)  # the top level's own caller sees it fail
            self._rescued = (first, rows, present)
            self._next = len(self.keys)

    def dropped(self) -> None:
        """The writer closed before running this job (``BackgroundWriter.close``): let go of the rescued
        rows and leave the cache's set of jobs."""
        with self._lock:
            self._rescued = None
            self._next = len(self.keys)
        if self._done is not None:
            self._done(self)

    def __call__(self) -> None:
        keys, n = self.keys, len(self.keys)
        try:
            with self.staging.rows(n) as buf:
                while True:
                    with self._lock:
                        i = self._next
                        if i >= n:
                            break
                        j = min(i + len(buf), n)
                        try:
                            present = copy_out(self.top, keys[i:j], buf[: j - i])
                        except TieredKVError:  # the top level failed or closed: nothing left to read
                            present = np.zeros(j - i, dtype=bool)
                        self._next = j
                    self._put(keys[i:j], buf[: j - i], present, i)
            with self._lock:
                rescued, self._rescued = self._rescued, None
            if rescued is not None:
                first, rows, present = rescued
                self._put(keys[first:], rows, present, first)
        finally:
            if self._gone:
                self.level.count(dropped=self._gone)
            if self._done is not None:
                self._done(self)

    def _put(self, keys: ChunkKeys, rows: np.ndarray, present: np.ndarray, first: int) -> None:
        if present.all():
            self.level.put(keys, rows, why=self.why)
            return
        self._gone += int(np.count_nonzero(~present & self.ours[first:first + len(keys)]))
        idx = np.flatnonzero(present)
        if len(idx):
            self.level.put(keys.take(idx), rows[idx], why=self.why)


class WriteBehind:
    """The write-behind of one cache: jobs queued with keys only (``submit``), rescued before a put that
    makes the top level evict (``before_put``); one staging buffer per written-behind level's writer."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self._staging: dict[str, Staging] = {}
        self._jobs: set[FromTop] = set()   # queued or running
        self._lock = threading.Lock()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._jobs = set()  # the parent's queued jobs stay the parent's (tieredkv.background)

    def submit(self, level: Level, top: Level, keys: ChunkKeys, why: str = "stored",
               ours: np.ndarray | None = None) -> None:
        """Queue ``keys`` (blocks the top level holds) on ``level``'s writer, in jobs of at most its
        bound, so a store larger than the whole queue is written in part rather than not at all. A job
        the full queue refuses is counted as dropped. ``ours``: per key, whether this process stored
        it (default all); see ``FromTop``."""
        writer = level.writer
        assert writer is not None, "write-behind needs a level with a background writer"
        with self._lock:
            staging = self._staging.get(level.name)
            if staging is None:
                staging = self._staging[level.name] = Staging(self.block_bytes)
        step = writer.max_blocks
        for i in range(0, len(keys), step):
            part = keys[i:i + step]
            job = FromTop(level, top, part, staging, why, self._finished,
                          None if ours is None else ours[i:i + step])
            with self._lock:
                self._jobs.add(job)
            if writer.submit(job, blocks=len(part)):
                level.count(queued=len(part))
            else:  # backpressure: the tier is behind; never an unbounded queue
                self._finished(job)
                level.count(dropped=len(part))

    def before_put(self, top: Level, n_blocks: int) -> None:
        """Call before putting ``n_blocks`` into the top level: if that may evict (fewer free slots),
        the queued jobs copy what they have not copied yet out of the top level now."""
        if self._jobs and getattr(top.tier, "free_blocks", 0) < n_blocks:
            self.rescue_all()

    def rescue_all(self) -> None:
        """Every queued job copies what it has not copied yet out of the top level now (before the top
        level evicts, or closes: ``HotTier.before_close``). Afterwards no job reads the top level."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.rescue()

    def _finished(self, job: FromTop) -> None:
        with self._lock:
            self._jobs.discard(job)

    def clear(self) -> None:
        """Drop the kept staging buffers."""
        with self._lock:
            staging = list(self._staging.values())
        for s in staging:
            s.clear()
