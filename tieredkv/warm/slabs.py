"""Slab files: preallocated files of fixed, 4 KiB-aligned slots, read and written with preadv/pwritev.

Global slot ``s`` lives in slab ``s // slots_per_slab`` at byte offset ``(s % slots_per_slab) *
slot_bytes``::

    slab-0000.bin  | slot 0 | slot 1 | ... | slot P-1 |        P = slots_per_slab
    slab-0001.bin  | slot P | ...                     |        every slot: slot_bytes (multiple of 4096)
                     ^ block_bytes of payload, then zero padding up to slot_bytes

Why preadv/pwritev rather than mmap: a slab truncated or deleted underneath an mmap turns the next
copy into SIGBUS, which kills the worker; a short ``pread`` is an ordinary, detectable miss. The copy
count is the same (page cache -> caller's buffer), and the benchmark baseline is plain pread/pwrite.
Runs of consecutive slots are coalesced into one vectored call (chunks of one prompt are usually
allocated consecutively).
"""

from __future__ import annotations

import errno
import os

import numpy as np

from tieredkv.errors import CapacityError, WarmTierUnavailable

SLOT_ALIGN = 4096
#: preadv/pwritev accept at most IOV_MAX (1024 on Linux) buffers; a run uses two per slot.
_MAX_RUN = 256


def slot_bytes_for(block_bytes: int) -> int:
    return (block_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def slab_name(i: int) -> str:
    return f"slab-{i:04d}.bin"


class Slabs:
    """The slab files of one tier, opened by one process.

    Args:
        directory: the tier directory.
        n_slots: total slots; ``slots_per_slab`` per file, the last file may hold fewer.
        slot_bytes: bytes per slot (a multiple of 4096).
        block_bytes: payload bytes per block; a compact tier's blocks are larger than its slots (they
            are stored as compressed frames, ``read_parts``/``write_parts``): ``block_bytes`` is then
            the slot's size, the most a slot holds.
        readonly: open the files read-only.
    """

    def __init__(self, directory: str, n_slots: int, slots_per_slab: int, slot_bytes: int,
                 block_bytes: int, *, readonly: bool = False):
        self.directory = directory
        self.n_slots = n_slots
        self.slots_per_slab = slots_per_slab
        self.slot_bytes = slot_bytes
        self.block_bytes = min(block_bytes, slot_bytes)
        self.readonly = readonly
        self.n_slabs = (n_slots + slots_per_slab - 1) // slots_per_slab
        self._pad = bytearray(slot_bytes - self.block_bytes)  # scratch for padding between coalesced slots
        # Reads (which run beside a write, on other threads) land their padding here, never in the
        # buffer a write is sending to disk.
        self._read_pad = bytearray(slot_bytes - self.block_bytes)
        self.fds: list[int] = []

    # ---- files -----------------------------------------------------------------------------------
    def path(self, i: int) -> str:
        return os.path.join(self.directory, slab_name(i))

    def expected_size(self, i: int) -> int:
        slots = min(self.slots_per_slab, self.n_slots - i * self.slots_per_slab)
        return slots * self.slot_bytes

    def create_missing(self) -> list[int]:
        """Create (0600) and preallocate every slab file that does not exist; return their numbers.

        Raises:
            CapacityError: the disk cannot hold the preallocated size.
        """
        made = []
        try:
            for i in range(self.n_slabs):
                path = self.path(i)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                except FileExistsError:
                    continue
                made.append(i)
                try:
                    self._preallocate(fd, self.expected_size(i), path)
                finally:
                    os.close(fd)
        except BaseException:
            # All or nothing: files this call made must not hold the disk space (or stay sparse).
            for i in made:
                try:
                    os.unlink(self.path(i))
                except OSError:
                    pass
            raise
        return made

    def restore_size(self, i: int) -> None:
        """Bring a truncated or missing slab back to its full, preallocated size (contents are lost)."""
        fd = os.open(self.path(i), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._preallocate(fd, self.expected_size(i), self.path(i))
        finally:
            os.close(fd)

    @staticmethod
    def _preallocate(fd: int, size: int, path: str) -> None:
        try:
            # Reserve the blocks now: a full disk is an error at start-up, not a failed write later.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise CapacityError(f"cannot preallocate {size} bytes for {path}: the disk is full; "
                                    f"open the warm tier with a smaller capacity_bytes") from exc
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(fd, size)  # filesystem without fallocate: sparse file
            else:
                raise

    def damaged(self) -> dict[int, tuple[str, int]]:
        """Slabs missing or shorter than they must be: ``{slab: ("missing" | "truncated", size)}``."""
        bad = {}
        for i in range(self.n_slabs):
            try:
                size = os.stat(self.path(i)).st_size
            except FileNotFoundError:
                bad[i] = ("missing", 0)
                continue
            if size < self.expected_size(i):
                bad[i] = ("truncated", size)
        return bad

    def open(self) -> None:
        flags = (os.O_RDONLY if self.readonly else os.O_RDWR) | os.O_CLOEXEC
        fds = []
        try:
            for i in range(self.n_slabs):
                try:
                    fds.append(os.open(self.path(i), flags))
                except FileNotFoundError:
                    if not self.readonly:
                        raise
                    fds.append(-1)  # read-only and missing: every read of it is a short read
        except BaseException:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            raise
        self.fds = fds

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass

    # ---- I/O -------------------------------------------------------------------------------------
    def _runs(self, slots: np.ndarray):
        """Yield ``(begin, end)`` index ranges of ``slots`` that are consecutive within one slab."""
        n = len(slots)
        if n <= 1:  # a group of one big block: no run analysis
            if n:
                yield 0, 1
            return
        slab = slots // self.slots_per_slab
        breaks = np.flatnonzero((np.diff(slots) != 1) | (np.diff(slab) != 0)) + 1
        edges = np.concatenate(([0], breaks, [n]))
        for b, e in zip(edges[:-1].tolist(), edges[1:].tolist()):
            while e - b > _MAX_RUN:
                yield b, b + _MAX_RUN
                b += _MAX_RUN
            yield b, e

    def _iov(self, rows: np.ndarray, idx: np.ndarray | None, b: int, e: int, pad: bytearray) -> list:
        iov = []
        for j in range(b, e):
            iov.append(rows[j] if idx is None else rows[idx[j]])
            if pad and j + 1 < e:
                iov.append(pad)
        return iov

    def prefetch(self, slots: np.ndarray) -> None:
        """Ask the kernel to start reading ``slots`` now (``POSIX_FADV_WILLNEED`` per run), so that a
        read split into groups keeps the disk as busy as one large read would. Best effort."""
        for b, e in self._runs(slots):
            first = int(slots[b])
            fd = self.fds[first // self.slots_per_slab]
            if fd >= 0:
                try:
                    os.posix_fadvise(fd, (first % self.slots_per_slab) * self.slot_bytes,
                                     (e - b) * self.slot_bytes, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass  # only a hint

    def read(self, slots: np.ndarray, rows: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """Read ``slots[j]`` into ``rows[idx[j]]`` (``rows``: ``(m, block_bytes)`` uint8; no ``idx``:
        ``rows[j]``). Return a bool mask of blocks that were read in full (False: the slab is short or
        missing there)."""
        ok = np.ones(len(slots), dtype=bool)
        for b, e in self._runs(slots):
            first = int(slots[b])
            fd = self.fds[first // self.slots_per_slab]
            offset = (first % self.slots_per_slab) * self.slot_bytes
            want = (e - b - 1) * self.slot_bytes + self.block_bytes
            if fd < 0:
                ok[b:e] = False
                continue
            try:
                got = os.preadv(fd, self._iov(rows, idx, b, e, self._read_pad), offset)
            except OSError as exc:  # EIO and friends: a tier problem, not the caller's
                raise WarmTierUnavailable(f"reading slab {first // self.slots_per_slab}: "
                                          f"{os.strerror(exc.errno) if exc.errno else exc}") from exc
            if got < want:
                # Short only at end of file (a truncated slab): every block past ``got`` is incomplete.
                complete = np.arange(e - b) * self.slot_bytes + self.block_bytes <= got
                ok[b:e] = complete
        return ok

    def write(self, slots: np.ndarray, rows: np.ndarray, idx: np.ndarray | None = None) -> set[int]:
        """Write ``rows[idx[j]]`` (or ``rows[j]``) into ``slots[j]``; return the slab numbers written.

        Raises:
            WarmTierUnavailable: the write failed (disk full, I/O error, read-only file).
        """
        touched = set()
        for b, e in self._runs(slots):
            first = int(slots[b])
            slab = first // self.slots_per_slab
            offset = (first % self.slots_per_slab) * self.slot_bytes
            iov = self._iov(rows, idx, b, e, self._pad)
            want = (e - b - 1) * self.slot_bytes + self.block_bytes
            done = 0
            try:
                done = os.pwritev(self.fds[slab], iov, offset)
                while done < want:  # a short write: finish it block by block
                    j = b + done // self.slot_bytes
                    j_off = done % self.slot_bytes
                    if j_off >= self.block_bytes:  # inside padding: skip to the next slot
                        done = (j + 1 - b) * self.slot_bytes
                        continue
                    row = rows[j] if idx is None else rows[idx[j]]
                    n = os.pwrite(self.fds[slab], row[j_off:], offset + done)
                    if n <= 0:
                        raise OSError(errno.EIO, "pwrite wrote nothing")
                    done += n
            except OSError as exc:
                raise self._write_failed(slab, exc) from exc
            touched.add(slab)
        return touched

    def _write_failed(self, slab: int, exc: OSError) -> WarmTierUnavailable:
        return WarmTierUnavailable(f"cannot write to {self.path(slab)}: "
                                   f"{os.strerror(exc.errno) if exc.errno else exc}", errno=exc.errno)

    def sync(self, slabs: set[int]) -> None:
        """fdatasync the given slabs (their data reaches the disk before the index points at it)."""
        for i in sorted(slabs):
            try:
                os.fdatasync(self.fds[i])
            except OSError as exc:
                raise WarmTierUnavailable(f"cannot sync {self.path(i)}: {exc.strerror or exc}",
                                          errno=exc.errno) from exc

    # ---- variable-length slot contents (compressed blocks: tieredkv.warm.packed) ---------------------
    def _where(self, slot: int) -> tuple[int, int]:
        return self.fds[slot // self.slots_per_slab], (slot % self.slots_per_slab) * self.slot_bytes

    def prefetch_parts(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """``prefetch`` of only the first ``lengths[j]`` bytes of each slot (a compressed block's
        frame), so that the disk does not read the slot's unused tail. Best effort."""
        for s, n in zip(slots.tolist(), lengths.tolist()):
            fd, offset = self._where(s)
            if fd >= 0:
                try:
                    os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass  # only a hint

    def read_parts(self, slots: np.ndarray, bufs: list) -> np.ndarray:
        """Read the first ``len(bufs[j])`` bytes of ``slots[j]`` into ``bufs[j]`` (writable uint8
        arrays), one ``preadv`` per slot: only the bytes a block occupies are read. Returns a bool
        mask of the slots read in full (False: the slab is short or missing there).

        Raises:
            WarmTierUnavailable: the read failed (EIO and friends).
        """
        ok = np.ones(len(slots), dtype=bool)
        for j, s in enumerate(slots.tolist()):
            fd, offset = self._where(s)
            if fd < 0:
                ok[j] = False
                continue
            try:
                ok[j] = os.preadv(fd, [bufs[j]], offset) == len(bufs[j])
            except OSError as exc:
                raise WarmTierUnavailable(f"reading slab {s // self.slots_per_slab}: "
                                          f"{os.strerror(exc.errno) if exc.errno else exc}") from exc
        return ok

    def write_parts(self, slots: np.ndarray, parts: list) -> set[int]:
        """Write ``parts[j]`` (uint8 arrays, at most ``block_bytes`` each) at the start of ``slots[j]``;
        only those bytes are written. Returns the slab numbers written.

        Raises:
            WarmTierUnavailable: the write failed (disk full, I/O error, read-only file).
        """
        touched = set()
        for s, part in zip(slots.tolist(), parts):
            slab = s // self.slots_per_slab
            fd, offset = self._where(s)
            view = memoryview(part).cast("B")
            done = 0
            try:
                while done < len(view):
                    n = os.pwrite(fd, view[done:], offset + done)
                    if n <= 0:
                        raise OSError(errno.EIO, "pwrite wrote nothing")
                    done += n
            except OSError as exc:
                raise self._write_failed(slab, exc) from exc
            touched.add(slab)
        return touched
