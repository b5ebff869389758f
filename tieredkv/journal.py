"""A host-level journal of tier changes: which blocks were stored into, or evicted from, which tier.

Every process using one namespace on a host appends to the same journal; any process can read it.
This is what lets an engine announce to a KV-aware router the blocks *another* engine of the host
stored (they are equally local: one copy in shared memory), and lets a separate exporter publish
the host's tiers to routers (``tieredkv.integrations.kv_events``).

```
/dev/shm/<hot segment>.journal        append-only records, rotated past max_bytes
/dev/shm/<hot segment>.journal.lock   flock'ed around each append (released by the kernel on death)

record = | magic "TKJ1" | length u32 | time f64 | pid i32 | op u8 | tier u8 | flags u16 | n u32 |
         | n keys x 16 bytes | n note lengths u32 | notes ... | crc32 u32 |
```

- Appends hold the lock for one ``write`` of a whole record, so records never interleave; a reader
  parses only complete records whose CRC holds (a record still being written is read on the next
  poll).
- Rotation: past ``max_bytes`` the appender starts a new file (its header carries the next epoch)
  and renames it over the journal's name. A reader keeps its open file to the end, then follows the
  name; a reader that missed a whole file counts the gap (``JournalReader.lost_files``).
- ``NOTED`` records carry one opaque note per key: what an integration needs to describe a block to
  its consumers (for vLLM: the block hashes, tokens and parent of the chunk). The journal never
  interprets them.
- A journal is an announcement channel, not a source of truth: a block listed STORED may be gone
  already; readers that need residency ask the tier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tieredkv.errors import InvalidInput, TieredKVError

#: Operations. ``CLEARED`` applies to the whole tier (no keys).
STORED, EVICTED, CLEARED, NOTED = 1, 2, 3, 4
OPS = {STORED: "stored", EVICTED: "evicted", CLEARED: "cleared", NOTED: "noted"}

_MAGIC = b"TKJ1"
_FILE_MAGIC = b"TKJF"
_HEAD = struct.Struct("<4sIdiBBHI")    # magic, length, time, pid, op, tier, flags (1: notes), n
_FILE_HEAD = struct.Struct("<4sIQ")    # magic, version, epoch
_CRC = struct.Struct("<I")
_VERSION = 1
DEFAULT_DIR = "/dev/shm"


def journal_path(segment_name: str, directory: str | os.PathLike | None = None) -> str:
    """The journal of the hot segment ``segment_name`` (``/tieredkv-...``): ``/dev/shm/tieredkv-....journal``.

    A journal is shared by exactly the processes that share the segment (same namespace, same host).
    """
    return os.path.join(os.fspath(directory or DEFAULT_DIR), segment_name.lstrip("/") + ".journal")


@dataclasses.dataclass(frozen=True)
class Record:
    """One journal record.

    Attributes:
        op: ``STORED``, ``EVICTED``, ``CLEARED`` or ``NOTED``.
        tier: the tier code of the writer (``TieredCache``'s HOT=0, WARM=1, REMOTE=2).
        keys: ``(n, 16)`` uint8, the blocks' keys (``ChunkKeys`` rows as bytes).
        notes: per key, the opaque note (``NOTED`` records), else empty.
        pid: the writing process.
        time: the writer's ``time.time()``.
    """

    op: int
    tier: int
    keys: np.ndarray
    notes: tuple[bytes, ...]
    pid: int
    time: float

    def key_bytes(self) -> list[bytes]:
        return [bytes(k) for k in self.keys]


def _key_rows(keys) -> np.ndarray:
    """``(n, 16)`` uint8 rows from ``ChunkKeys``, an ``(n, 2)`` uint64 array or a list of 16-byte keys."""
    raw = getattr(keys, "keys", keys)
    if isinstance(raw, np.ndarray):
        arr = np.ascontiguousarray(raw)
        return arr.view(np.uint8).reshape(len(arr), -1) if len(arr) else np.zeros((0, 16), np.uint8)
    arr = np.frombuffer(b"".join(bytes(k) for k in raw), dtype=np.uint8)
    return arr.reshape(-1, 16)


class HostJournal:
    """The appending side of a namespace's journal (one per process and namespace is enough).

    Args:
        path: the journal file (``journal_path(segment_name)``); created if missing.
        max_bytes: size past which the file is rotated.

    Raises:
        InvalidInput: ``max_bytes`` is not a positive int.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = 64 << 20):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidInput(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self._lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._fd = -1
        self._ino = -1
        with self._locked():
            self._ensure_file()

    # ---- appending ----------------------------------------------------------------------------------
    def append(self, op: int, tier: int, keys=(), notes: Sequence[bytes] | None = None) -> None:
        """Append one record (one ``write`` under the lock).

        Raises:
            InvalidInput: an unknown op, or notes whose count differs from the keys'.
        """
        if op not in OPS:
            raise InvalidInput(f"unknown journal op {op!r}; expected one of {sorted(OPS)}")
        rows = _key_rows(keys)
        n = len(rows)
        if op != CLEARED and n == 0:
            return
        notes = list(notes or ())
        if notes and len(notes) != n:
            raise InvalidInput(f"{len(notes)} notes for {n} keys")
        lengths = np.asarray([len(x) for x in notes], dtype="<u4") if notes else np.zeros(0, "<u4")
        body = rows.tobytes() + lengths.tobytes() + b"".join(notes)
        length = _HEAD.size + len(body) + _CRC.size
        head = _HEAD.pack(_MAGIC, length, time.time(), os.getpid(), op, tier, 1 if notes else 0, n)
        record = head + body
        record += _CRC.pack(zlib.crc32(record))
        with self._locked():
            self._ensure_file()
            size = os.fstat(self._fd).st_size
            if size + len(record) > self.max_bytes and size > _FILE_HEAD.size:
                self._rotate()
                size = _FILE_HEAD.size
            written = os.write(self._fd, record)
            if written != len(record):  # a full /dev/shm: never leave half a record behind
                os.ftruncate(self._fd, size)

    def restart(self, tier: int) -> None:
        """Start a fresh file whose first record is ``CLEARED(tier)``: for a tier that is new and empty
        (a hot segment just created after a reboot or a removal), whose old records are stale. Readers
        holding the old file read it to its end, then the ``CLEARED``."""
        with self._locked():
            self._ensure_file()
            self._rotate()
        self.append(CLEARED, tier)

    def observer(self, codes: dict[str, int]) -> Callable[[str, str, Any], None]:
        """An observer of a cache's levels (``tieredkv.levels.Observer``) that records their changes:
        ``"stored"`` as ``STORED``, ``"evicted"`` as ``EVICTED``, with the level's code (``codes``, by
        level name). An append that fails is warned about once and never raised: the journal announces
        changes, it must never fail the store that made them."""
        warned = threading.Event()

        def observe(event: str, level_name: str, keys: Any) -> None:
            try:
                self.append(STORED if event == "stored" else EVICTED, codes[level_name], keys)
            except (OSError, TieredKVError) as e:
                if not warned.is_set():
                    warned.set()
                    warnings.warn(f"tieredkv: the host journal failed ({e}); tier changes are not announced",
                                  RuntimeWarning, stacklevel=2)

        return observe

    def close(self) -> None:
        """Close the files (idempotent); the journal stays for the other processes."""
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> HostJournal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _ensure_file(self) -> None:
        """Under the lock: (re)open the file the journal's name points at, creating it if missing."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            self._install(epoch=0)
            ino = os.stat(self.path).st_ino
        if ino != self._ino:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            self._ino = ino

    def _install(self, epoch: int) -> None:
        """Write a fresh file with its header and rename it over the journal's name (atomic)."""
        tmp = f"{self.path}.new-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _FILE_HEAD.pack(_FILE_MAGIC, _VERSION, epoch))
        finally:
            os.close(fd)
        os.rename(tmp, self.path)

    def _rotate(self) -> None:
        epoch = _read_epoch(self._fd)
        self._install(epoch + 1)
        self._ensure_file()


def _read_epoch(fd: int) -> int:
    head = os.pread(fd, _FILE_HEAD.size, 0) if fd >= 0 else b""
    if len(head) < _FILE_HEAD.size:
        return 0
    magic, _, epoch = _FILE_HEAD.unpack(head)
    return int(epoch) if magic == _FILE_MAGIC else 0


class JournalReader:
    """Reads a journal's records in order, from where the reader started.

    Args:
        path: the journal file.
        from_start: read what is already there (default), or only what is appended from now on.
    """

    def __init__(self, path: str | os.PathLike, *, from_start: bool = True):
        self.path = os.fspath(path)
        self._fd = -1
        self._ino = -1
        self._epoch = -1
        self._offset = 0
        self._buf = b""
        #: whole files this reader never saw (rotated away between two polls)
        self.lost_files = 0
        #: records whose checksum failed (skipped)
        self.corrupt = 0
        if self._open() and not from_start:
            self._offset = os.fstat(self._fd).st_size

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        ino = os.fstat(fd).st_ino
        epoch = _read_epoch(fd)
        if self._epoch >= 0 and epoch > self._epoch + 1:
            self.lost_files += epoch - self._epoch - 1
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._ino, self._epoch = fd, ino, epoch
        self._offset, self._buf = _FILE_HEAD.size, b""
        return True

    def poll(self, max_bytes: int = 16 << 20) -> list[Record]:
        """The complete records appended since the last poll (at most about ``max_bytes`` of them)."""
        out: list[Record] = []
        if self._fd < 0 and not self._open():
            return out
        while True:
            chunk = os.pread(self._fd, max_bytes, self._offset)
            self._offset += len(chunk)
            self._buf += chunk
            self._parse(out)
            if chunk:
                if len(chunk) == max_bytes:
                    return out  # more to read: next poll
                continue
            # At the end of this file: follow the name if it was rotated.
            try:
                ino = os.stat(self.path).st_ino
            except FileNotFoundError:
                return out
            if ino == self._ino or not self._open():
                return out

    def _parse(self, out: list[Record]) -> None:
        buf, pos = self._buf, 0
        while len(buf) - pos >= _HEAD.size:
            magic, length, t, pid, op, tier, has_notes, n = _HEAD.unpack_from(buf, pos)
            if magic != _MAGIC or length < _HEAD.size + _CRC.size:
                # Not a record start (a torn tail left by a writer that died): skip the rest of what
                # was read; the writer side truncates torn records, so this is rare.
                self.corrupt += 1
                pos = len(buf)
                break
            if len(buf) - pos < length:
                break  # still being written
            record = buf[pos:pos + length]
            (crc,) = _CRC.unpack_from(record, length - _CRC.size)
            pos += length
            if zlib.crc32(record[:-_CRC.size]) != crc:
                self.corrupt += 1
                continue
            at = _HEAD.size
            keys = np.frombuffer(record, dtype=np.uint8, count=16 * n, offset=at).reshape(n, 16)
            at += 16 * n
            notes: tuple[bytes, ...] = ()
            if has_notes:
                lengths = np.frombuffer(record, dtype="<u4", count=n, offset=at)
                at += 4 * n
                parts = []
                for ln in lengths.tolist():
                    parts.append(record[at:at + ln])
                    at += ln
                notes = tuple(parts)
            out.append(Record(op=op, tier=tier, keys=keys, notes=notes, pid=pid, time=t))
        self._buf = buf[pos:]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JournalReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove(path: str | os.PathLike) -> None:
    """Remove a journal and its lock file (an operator's clean-up; readers keep what they opened)."""
    for p in (os.fspath(path), os.fspath(path) + ".lock"):
        try:
            os.unlink(p)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
