"""The shared-memory segment: layout, creation, attachment, listing.

Layout (offsets from the segment base only; every process maps it at a different address)::

    +-----------+------------------+---------------+-------------+--------------+----------+--------+
    | header    | owner table      | slot table    | chunk tokens| hash index   | policy   | data   |
    | 4 KiB     | MAX_OWNERS recs  | n_slots recs  | n x C x u32 | 2 x 2^k i64  | state    | n x    |
    |           | (+ pins, stats)  | (seqlocked)   |             | (index.py)   | (SoA)    | slot_b |
    +-----------+------------------+---------------+-------------+--------------+----------+--------+

Every region starts on a 4 KiB boundary, every slot's data on a 4 KiB boundary (memcpy speed, O_DIRECT
friendly). Every field is an aligned 8-byte word, so none straddles a cache line and a concurrent
reader never sees half a word.

Creation is atomic: the creator builds and fully initialises the segment under a private temporary
name, then ``link()``s it to the public name (``/dev/shm`` is where Linux keeps POSIX shared memory).
A loser of the race (link fails with EEXIST) drops its copy and attaches to the winner's; an attacher
therefore never sees a half-built header. The whole size is reserved with ``posix_fallocate`` first,
so a full ``/dev/shm`` is a ``CapacityError`` at start-up, never a SIGBUS in some worker later.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc

from tieredkv import counters
from tieredkv.errors import CapacityError, FormatError, InvalidName, PermissionDenied, SpecMismatch
from tieredkv.hot.index import index_slots_for
from tieredkv.spec import KVSpec

MAGIC = 0x5EADBEEF_7D0C4B1E
LAYOUT_VERSION = 2  # 2: the hash index holds (key word, slot) entries (hot/index.py)
#: Where POSIX shared memory lives on Linux; segments go here unless ``TIEREDKV_SHM_DIR`` (or a
#: tier's ``shm_dir``) names another tmpfs, e.g. one mounted with ``huge=`` (docs/tuning.md).
SHM_DIR = Path("/dev/shm")
SHM_DIR_ENV = "TIEREDKV_SHM_DIR"
PREFIX = "tieredkv-"
HEADER_BYTES = 4096
PAGE = 4096
MAX_OWNERS = 128
#: Blocks one owner may hold pinned at once; get_many works in batches of this size.
MAX_PINS = 512
_NAME_RE = re.compile(r"^/?[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

FREE, WRITING, READY = 0, 1, 2

STAT_FIELDS = ("lookups", "hits", "misses", "bytes_in", "bytes_out", "puts", "exists", "no_space",
               "evictions", "removed", "recoveries", "reclaimed", "torn_reads")

HEADER_DTYPE = np.dtype([
    ("magic", "<u8"), ("version", "<u8"), ("instance", "<u8"), ("created_ns", "<u8"),
    ("uid", "<u8"), ("total_bytes", "<u8"), ("n_slots", "<u8"), ("slot_bytes", "<u8"),
    ("block_bytes", "<u8"), ("chunk_tokens", "<u8"), ("index_slots", "<u8"),
    ("owners_off", "<u8"), ("slots_off", "<u8"), ("tokens_off", "<u8"), ("index_off", "<u8"),
    ("policy_off", "<u8"), ("policy_bytes", "<u8"), ("free_off", "<u8"), ("data_off", "<u8"),
    # mutable, under the metadata lock
    ("dirty", "<u8"),          # owner index + 1 while inside a critical section; 0 when consistent
    ("free_top", "<u8"),       # entries in the free stack
    ("_spare", "<u8", (2,)),   # spare header words (layout version 1 keeps them zero)
    ("scrubs", "<u8"),         # full repairs run after a holder died inside a critical section
    ("fingerprint", "S16"), ("policy", "S48"), ("spec_json", "S1024"),
])
assert HEADER_DTYPE.itemsize <= HEADER_BYTES  # static layout fact, not a runtime invariant

SLOT_DTYPE = np.dtype([
    ("gen", "<u8"),            # seqlock: odd while a writer owns the slot
    ("key", "<u8", (2,)), ("parent", "<u8", (2,)),
    ("state", "<u8"), ("owner", "<u8"), ("owner_token", "<u8"), ("pins", "<u8"),
    ("position", "<u8"), ("length", "<u8"), ("_pad", "<u8"),
])

# One row per open handle. Each row is written only by its owner (no lock needed for counters);
# a row outlives its owner, so sums over rows stay cumulative for the segment's life.
OWNER_DTYPE = np.dtype([
    ("token", "<u8"), ("pid", "<u8"), ("start_time", "<u8"), ("n_pins", "<u8"),
    ("stats", "<u8", (len(STAT_FIELDS),)),
    *counters.ROW_FIELDS,  # the TieredCache counters of this handle: summed over rows, per host
    ("pins", "<i8", (MAX_PINS,)),
])


def _round(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def slot_bytes_for(spec: KVSpec) -> int:
    """Slot size: 4 KiB-aligned (memcpy speed, O_DIRECT friendly); blocks under 4 KiB (test specs)
    get 64-byte alignment instead of wasting most of a page each."""
    return _round(spec.block_bytes, PAGE if spec.block_bytes >= PAGE else 64)


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every region for a given geometry."""

    n_slots: int
    slot_bytes: int
    block_bytes: int
    chunk_tokens: int
    index_slots: int
    owners_off: int
    slots_off: int
    tokens_off: int
    index_off: int
    policy_off: int
    policy_bytes: int
    free_off: int
    data_off: int
    total_bytes: int

    @classmethod
    def compute(cls, spec: KVSpec, n_slots: int, policy_bytes: int) -> "Layout":
        slot_bytes = slot_bytes_for(spec)
        index_slots = index_slots_for(n_slots)
        off = HEADER_BYTES
        owners_off = off
        off = _round(off + MAX_OWNERS * OWNER_DTYPE.itemsize)
        slots_off = off
        off = _round(off + n_slots * SLOT_DTYPE.itemsize)
        tokens_off = off
        off = _round(off + n_slots * spec.chunk_tokens * 4)
        index_off = off
        off = _round(off + index_slots * 16)  # key words, then refs
        policy_off = off
        off = _round(off + policy_bytes)
        free_off = off
        off = _round(off + n_slots * 8)
        data_off = off
        total = data_off + n_slots * slot_bytes
        return cls(n_slots, slot_bytes, spec.block_bytes, spec.chunk_tokens, index_slots, owners_off,
                   slots_off, tokens_off, index_off, policy_off, policy_bytes, free_off, data_off, total)

    @classmethod
    def slots_for(cls, spec: KVSpec, capacity_bytes: int, policy_bytes_of) -> int:
        """The most slots whose whole segment fits in ``capacity_bytes``."""
        # data, slot record, tokens, index (>= 4 entries of 16 bytes), free stack, policy state
        per_slot = slot_bytes_for(spec) + SLOT_DTYPE.itemsize + spec.chunk_tokens * 4 + 64 + 8 + 64
        n = max(1, capacity_bytes // per_slot)
        while n > 1 and cls.compute(spec, n, policy_bytes_of(n)).total_bytes > capacity_bytes:
            n = int(n * 0.98)
        return n


_TEMP_RE = re.compile(r"^/" + re.escape(PREFIX) + r"tmp-(\d+)-[0-9a-f]+$")


def temp_name() -> str:
    """A fresh private name for a segment being built: ``/tieredkv-tmp-<creator pid>-<random>``.

    The format is defined here only; ``temp_owner`` parses it back.
    """
    return f"/{PREFIX}tmp-{os.getpid()}-{secrets.token_hex(4)}"


def temp_owner(name: str) -> int | None:
    """The creator's pid if ``name`` (with or without its leading ``/``) is a temporary name, else None."""
    m = _TEMP_RE.match("/" + name.lstrip("/"))
    return int(m.group(1)) if m else None


def check_name(name: str) -> str:
    """Return ``/name`` or raise ``InvalidName``: letters, digits, ``._-``; no slashes or ``..``."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise InvalidName(f"invalid segment name {name!r}: use 1-200 of [A-Za-z0-9._-], "
                          "starting with a letter or digit, optionally with one leading '/'")
    return name if name.startswith("/") else "/" + name


def default_name(spec: KVSpec, numa_node: int | None = None) -> str:
    suffix = f"-numa{numa_node}" if numa_node is not None else ""
    return f"/{PREFIX}{spec.namespace}{suffix}"


class Mapping:
    """An open segment: its descriptor, its mapping and numpy views of every region.

    Keep a ``Mapping`` open for as long as any view of it lives (a view over a closed mmap segfaults).
    """

    def __init__(self, name: str, fd: int, size: int, writable: bool = True, directory=None):
        self.name = name
        self.directory = directory
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self.mm = mmap.mmap(fd, size, access=access)
        # mmap keeps a dup of ``fd`` (same open file description) for its whole life. Locks are taken
        # on a second, separate open of the segment, so that dropping the lock descriptor (a forked
        # child does, see hot/tier.py) really lets go of every lock this handle holds.
        try:
            lock_fd = os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except BaseException:
            self.mm.close()
            raise  # ``fd`` stays the caller's to close
        os.close(fd)
        self.fd = lock_fd
        self.size = size
        self.header = np.frombuffer(self.mm, dtype=HEADER_DTYPE, count=1)[0]

    def views(self):
        h = self.header
        n = int(h["n_slots"])
        buf = self.mm
        owners = np.frombuffer(buf, OWNER_DTYPE, MAX_OWNERS, int(h["owners_off"]))
        slots = np.frombuffer(buf, SLOT_DTYPE, n, int(h["slots_off"]))
        tokens = np.frombuffer(buf, "<u4", n * int(h["chunk_tokens"]), int(h["tokens_off"])).reshape(
            n, int(h["chunk_tokens"]))
        index = np.frombuffer(buf, "<i8", 2 * int(h["index_slots"]), int(h["index_off"])).reshape(2, -1)
        free = np.frombuffer(buf, "<i8", n, int(h["free_off"]))
        data = np.frombuffer(buf, np.uint8, n * int(h["slot_bytes"]), int(h["data_off"])).reshape(
            n, int(h["slot_bytes"]))[:, : int(h["block_bytes"])]
        return owners, slots, tokens, index, free, data

    def close(self) -> None:
        # Views must be dropped by the caller first; mmap.close raises BufferError if any remain.
        self.header = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still lives: leave the mapping to the garbage collector, never segfault
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def shm_dir(directory: str | os.PathLike | None = None) -> Path:
    """The directory segments live in: ``directory``, else ``$TIEREDKV_SHM_DIR``, else /dev/shm."""
    if directory is None:
        directory = os.environ.get(SHM_DIR_ENV) or SHM_DIR
    return Path(directory)


def _shm_path(name: str, directory: str | os.PathLike | None = None) -> Path:
    return shm_dir(directory) / name.lstrip("/")


def _open_segment(name: str, flags: int, mode: int, directory) -> int:
    """``shm_open`` (which on Linux is ``open`` under /dev/shm) for any directory.

    Raises ``posix_ipc.ExistentialError`` for a missing name (or an existing one with ``O_EXCL``),
    as ``posix_ipc.SharedMemory`` did, so callers keep one contract.
    """
    try:
        return os.open(_shm_path(name, directory), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except (FileNotFoundError, FileExistsError) as e:
        raise posix_ipc.ExistentialError(f"segment {name}: {e.strerror}") from None


def unlink(name: str, directory: str | os.PathLike | None = None) -> None:
    """Remove a segment's name. Raises ``posix_ipc.ExistentialError`` if there is none."""
    try:
        os.unlink(_shm_path(name, directory))
    except FileNotFoundError:
        raise posix_ipc.ExistentialError(f"no segment {name}") from None


def _check_owner(fd: int, name: str) -> os.stat_result:
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        raise PermissionDenied(f"segment {name} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
                               "refusing to use another user's cache")
    return st


def create_or_attach(spec: KVSpec, name: str, layout: Layout, policy_name: str, mode: int, init,
                     directory: str | os.PathLike | None = None) -> tuple[Mapping, bool]:
    """Attach to segment ``name``, creating it with ``layout`` if it does not exist.

    Args:
        init: ``init(mapping)`` fills a fresh segment (every region but the magic) before it is published.

    Returns:
        (mapping, created)
    """
    for _ in range(8):
        try:
            return attach(spec, name, directory=directory), False
        except posix_ipc.ExistentialError:
            pass
        mapping = _create_private(spec, name, layout, policy_name, mode, init, directory)
        try:
            os.link(_shm_path(mapping.name, directory), _shm_path(name, directory))
        except FileExistsError:
            _discard(mapping)
            continue  # lost the race: attach to the winner's segment
        except OSError:
            _discard(mapping)
            raise
        unlink(mapping.name, directory)
        mapping.name = name
        return mapping, True
    raise FormatError(f"segment {name} keeps appearing and vanishing; is another process removing it?")


def _discard(mapping: Mapping) -> None:
    tmp = mapping.name
    mapping.close()
    try:
        unlink(tmp, mapping.directory)
    except posix_ipc.ExistentialError:
        pass


def _create_private(spec: KVSpec, name: str, layout: Layout, policy_name: str, mode: int, init,
                    directory=None) -> Mapping:
    where = shm_dir(directory)
    free = os.statvfs(where)
    room = free.f_bavail * free.f_frsize
    if layout.total_bytes > room:
        raise CapacityError(f"segment {name} needs {layout.total_bytes / 2**20:.1f} MiB but {where} has "
                            f"{room / 2**20:.1f} MiB free; lower hot_bytes or enlarge /dev/shm")
    tmp = temp_name()
    fd = _open_segment(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode, directory)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened
        os.ftruncate(fd, layout.total_bytes)
        try:
            os.posix_fallocate(fd, 0, layout.total_bytes)
        except OSError as e:
            raise CapacityError(f"cannot reserve {layout.total_bytes / 2**20:.1f} MiB in {where} for "
                                f"segment {name}: {os.strerror(e.errno)}") from None
    except BaseException:
        os.close(fd)
        unlink(tmp, directory)
        raise
    try:
        mapping = Mapping(tmp, fd, layout.total_bytes, directory=directory)
    except BaseException:
        os.close(fd)
        unlink(tmp, directory)
        raise
    try:
        _init_header(mapping, spec, layout, policy_name, init)
    except BaseException:
        _discard(mapping)
        raise
    return mapping


def _init_header(mapping: Mapping, spec: KVSpec, layout: Layout, policy_name: str, init) -> None:
    h = mapping.header
    h["version"] = LAYOUT_VERSION
    h["instance"] = secrets.randbits(63)
    h["created_ns"] = time.time_ns()
    h["uid"] = os.getuid()
    h["total_bytes"] = layout.total_bytes
    for field in ("n_slots", "slot_bytes", "block_bytes", "chunk_tokens", "index_slots", "owners_off",
                  "slots_off", "tokens_off", "index_off", "policy_off", "policy_bytes", "free_off",
                  "data_off"):
        h[field] = getattr(layout, field)
    h["fingerprint"] = spec.fingerprint.encode()
    h["policy"] = policy_name.encode()[:48]
    h["spec_json"] = json.dumps(spec.to_dict(), sort_keys=True).encode()[:1024]
    init(mapping)
    h["magic"] = MAGIC  # last: a segment without magic was never published


def validate(mapping: Mapping, spec: KVSpec | None) -> None:
    """Raise ``FormatError`` / ``SpecMismatch`` unless the segment is ours, current and for ``spec``."""
    h = mapping.header
    if mapping.size < HEADER_BYTES:
        raise FormatError(f"segment {mapping.name} is {mapping.size} bytes: too small to be a tieredkv segment")
    if int(h["magic"]) != MAGIC:
        raise FormatError(f"segment {mapping.name} has foreign magic {int(h['magic']):#x}; "
                          "it is not a tieredkv segment (remove it with `tieredkv rm` if it is stale)")
    if int(h["version"]) != LAYOUT_VERSION:
        raise FormatError(f"segment {mapping.name} has layout version {int(h['version'])}, this tieredkv "
                          f"speaks {LAYOUT_VERSION}; remove it with `tieredkv rm --stale`")
    if int(h["total_bytes"]) != mapping.size:
        raise FormatError(f"segment {mapping.name} is {mapping.size} bytes but its header says "
                          f"{int(h['total_bytes'])}")
    n = int(h["n_slots"])
    end = int(h["data_off"]) + n * int(h["slot_bytes"])
    if n <= 0 or end != mapping.size or int(h["slot_bytes"]) < int(h["block_bytes"]):
        raise FormatError(f"segment {mapping.name} has an inconsistent header")
    _check_geometry(mapping)
    if spec is not None and h["fingerprint"].decode(errors="replace") != spec.fingerprint:
        try:
            theirs = json.loads(h["spec_json"].decode())
        except ValueError:
            theirs = {}
        ours = spec.to_dict()
        diff = {k: (theirs.get(k), ours[k]) for k in ours if theirs.get(k) != ours[k]}
        detail = ", ".join(f"{k}: segment has {a!r}, you asked for {b!r}" for k, (a, b) in diff.items())
        raise SpecMismatch(f"segment {mapping.name} was made for another KV spec ({detail or 'fingerprint differs'})")
    if spec is not None and int(h["block_bytes"]) != spec.block_bytes:
        raise SpecMismatch(f"segment {mapping.name} holds {int(h['block_bytes'])}-byte blocks")
    if spec is not None and int(h["chunk_tokens"]) != spec.chunk_tokens:
        # The fingerprint (which covers chunk_tokens) matched, so the header itself is damaged.
        raise FormatError(f"segment {mapping.name} has a damaged header (chunk_tokens "
                          f"{int(h['chunk_tokens'])}, its spec says {spec.chunk_tokens}); remove it with "
                          f"`tieredkv rm {mapping.name}`")


_GEOMETRY = ("n_slots", "slot_bytes", "block_bytes", "chunk_tokens", "index_slots", "owners_off", "slots_off",
             "tokens_off", "index_off", "policy_off", "policy_bytes", "free_off", "data_off", "total_bytes")


@dataclass(frozen=True)
class _Geometry:
    """What ``Layout.compute`` reads from a spec, taken from a header instead."""

    block_bytes: int
    chunk_tokens: int


def _check_geometry(mapping: Mapping) -> None:
    """Raise ``FormatError`` unless every offset and size in the header is exactly what ``Layout.compute``
    gives for the header's own slot count, block size, chunk size and policy size.

    A damaged field must fail here, as a clear error, and not later as a numpy view past the mapping,
    a misaligned policy state, a giant allocation, or a slot table read from the wrong place.
    """
    h = mapping.header
    size = mapping.size
    n, block, chunk, policy = (int(h[f]) for f in ("n_slots", "block_bytes", "chunk_tokens", "policy_bytes"))
    sane = 0 < n <= size // 64 and 0 < block <= size and 0 < chunk <= size // 4 and policy < size
    expected = Layout.compute(_Geometry(block, chunk), n, policy) if sane else None
    bad = [f for f in _GEOMETRY if expected is None or int(h[f]) != getattr(expected, f)]
    try:
        h["policy"].decode("ascii")
    except UnicodeDecodeError:
        bad.append("policy")
    if bad:
        raise FormatError(f"segment {mapping.name} has a damaged header ({', '.join(bad[:4])} do not fit its "
                          f"geometry); remove it with `tieredkv rm {mapping.name}` and let a worker recreate it")


def attach(spec: KVSpec | None, name: str, writable: bool = True, directory: str | os.PathLike | None = None) -> Mapping:
    """Open an existing, published segment. Raises ``posix_ipc.ExistentialError`` if there is none."""
    fd = _open_segment(name, os.O_RDWR if writable else os.O_RDONLY, 0, directory)
    try:
        st = _check_owner(fd, name)
        if st.st_size < HEADER_BYTES:
            raise FormatError(f"segment {name} is {st.st_size} bytes: too small to be a tieredkv segment")
        mapping = Mapping(name, fd, st.st_size, writable, directory=directory)
    except BaseException:
        os.close(fd)
        raise
    try:
        validate(mapping, spec)
    except BaseException:
        mapping.close()
        raise
    return mapping


_HUGETLBFS_MAGIC = 0x958458F6


def huge_page_policy(directory: str | os.PathLike | None = None) -> str:
    """How the filesystem of ``directory`` backs files with huge pages, from its mount options.

    Returns:
        ``"always"`` / ``"within_size"`` / ``"advise"`` (a tmpfs mounted ``huge=`` that; the segment is
        reserved at creation, so ``advise`` gets none), ``"never"`` (a tmpfs without ``huge=``, such as
        a default /dev/shm; ``shmem_enabled=force`` overrides it), ``"hugetlbfs"`` (not usable for
        segments: its sizes must be whole huge pages), or ``"unknown"``.
    """
    path = os.path.realpath(shm_dir(directory))
    best, opts, fstype = "", "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype, opts = point, parts[2], parts[3]
    except OSError:
        return "unknown"
    if fstype == "hugetlbfs":
        return "hugetlbfs"
    if fstype != "tmpfs":
        return "unknown"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            forced = "[force]" in f.read()
    except OSError:
        forced = False
    if forced:
        return "always"
    huge = [o.split("=", 1)[1] for o in opts.split(",") if o.startswith("huge=")]
    return huge[0] if huge else "never"


def huge_mapped_bytes(mapping: "Mapping") -> int:
    """Bytes of ``mapping`` this process maps with huge (PMD) pages right now, from /proc/self/smaps.

    Only pages this process has touched count; 0 when the kernel gives none (or smaps is unreadable).
    """
    base = np.frombuffer(mapping.mm, np.uint8, 1).__array_interface__["data"][0]
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= base < hi
                elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                    kib = int(line.split()[1])
                    if kib:
                        return kib * 1024
    except (OSError, ValueError):
        return 0
    return 0


def list_segment_names(directory: str | os.PathLike | None = None, *, published_only: bool = False) -> list[str]:
    """Names of every tieredkv segment in ``directory`` (default: see ``shm_dir``), sorted.

    Args:
        directory: where to look; default ``$TIEREDKV_SHM_DIR`` or /dev/shm.
        published_only: leave out temporary names (segments still being built, or leftovers of a
            creator that died building one).
    """
    where = shm_dir(directory)
    if not where.is_dir():
        return []
    names = sorted("/" + p.name for p in where.iterdir() if p.name.startswith(PREFIX))
    return [n for n in names if temp_owner(n) is None] if published_only else names
