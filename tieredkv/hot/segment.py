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

import dataclasses
import json
import mmap
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc

from tieredkv import counters, policies
from tieredkv.errors import (
    CapacityError,
    FormatError,
    InvalidInput,
    InvalidName,
    PermissionDenied,
    SpecMismatch,
    TieredKVError,
)
from tieredkv.hot import locks
from tieredkv.hot.index import index_slots_for
from tieredkv.spec import KVSpec

MAGIC = 0x5EADBEEF_7D0C4B1E
# 2: the hash index holds (key word, slot) entries (hot/index.py);
# 3: remote-tier and write-behind counters in the owner rows.
LAYOUT_VERSION = 3
#: ``layout_digest()`` of this ``LAYOUT_VERSION``. A test holds the two together: a change to any record
#: a segment is read through (header, slot, owner rows, index hashing, region offsets, a built-in
#: policy's state) fails it until the version is bumped (so the segment's name changes, and processes
#: of the old and new release keep separate segments) and this digest is set anew.
LAYOUT_DIGEST = "c0e13bc0e61748eb"
#: Where POSIX shared memory lives on Linux. Segments go here unless ``TIEREDKV_SHM_DIR`` names
#: another tmpfs directory, e.g. one mounted with ``huge=always`` (docs/tuning.md, huge pages).
SHM_DIR = Path("/dev/shm")
SHM_DIR_ENV = "TIEREDKV_SHM_DIR"
PREFIX = "tieredkv-"
HEADER_BYTES = 4096
PAGE = 4096
MAX_OWNERS = 128
#: Blocks one owner may hold pinned at once; get_many works in batches of this size.
MAX_PINS = 512
#: Bytes of the header's policy field: the full policy spec, e.g. ``prefix_aware:s3fifo``.
POLICY_BYTES = 48
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
    ("repin", "<u8"),          # nonzero: a reader dropped its pins without the lock; recount them
    ("_spare", "<u8"),         # a spare header word (this layout version keeps it zero)
    ("scrubs", "<u8"),         # full repairs run after a holder died inside a critical section
    ("fingerprint", "S16"), ("policy", f"S{POLICY_BYTES}"), ("spec_json", "S1024"),
])
assert HEADER_DTYPE.itemsize <= HEADER_BYTES  # static layout fact, not a runtime invariant

SLOT_DTYPE = np.dtype([
    ("gen", "<u8"),            # seqlock: odd while a writer owns the slot
    ("key", "<u8", (2,)), ("parent", "<u8", (2,)),
    ("state", "<u8"), ("owner", "<u8"), ("owner_token", "<u8"), ("pins", "<u8"),
    ("position", "<u8"), ("length", "<u8"),
    ("claim", "<u8"),          # while WRITING: the claiming call's id (its slots, if it is interrupted)
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


def slot_bytes_for(spec: KVSpec | _Geometry) -> int:
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
    def compute(cls, spec: KVSpec | _Geometry, n_slots: int, policy_bytes: int) -> Layout:
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


def layout_digest() -> str:
    """A 64-bit digest (hex) of how a segment's bytes are laid out and read: the header, slot and owner
    records (dtypes with field names, byte orders and offsets), the size limits, the hot index's hash,
    the regions' offsets for a reference geometry, and every built-in policy's state layout.

    It covers structure, not meaning: a field that keeps its type but changes what it means still needs
    a ``LAYOUT_VERSION`` bump by hand.
    """
    import xxhash

    from tieredkv import hashtable

    geometry = dataclasses.asdict(Layout.compute(_Geometry(block_bytes=65_536, chunk_tokens=16), 1_000, 4_096))
    states = {}
    for name in _BUILT_IN_POLICIES:
        st = policies.StateLayout.for_policy(policies.make(name), 1_000)
        states[name] = [st.slot_fields, st.global_fields, st.ghost_slots, st.ghost_lists, st.ghost_table, st.nbytes]
    doc = {
        "records": [str(d.descr) for d in (HEADER_DTYPE, SLOT_DTYPE, OWNER_DTYPE)],
        "limits": [HEADER_BYTES, PAGE, MAX_OWNERS, MAX_PINS, POLICY_BYTES, FREE, WRITING, READY, MAGIC],
        "index_hash": [hashtable._FIB, index_slots_for(1_000)],
        "geometry": geometry,
        "policies": states,
    }
    return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True, default=str).encode())


#: The policies this package ships (their state lives in segments); third-party ones version themselves.
_BUILT_IN_POLICIES = ("lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc", "kv_aware", "cost_aware",
                      "prefix_aware:lru", "prefix_aware:s3fifo", "prefix_aware:arc")


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


def check_mode(mode: object) -> int:
    """Return ``mode`` or raise ``InvalidInput``: permission bits only, owner read/write included,
    never writable by every user (anyone on the host could then rewrite cached KV, or read prompts)."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise InvalidInput(f"mode must be permission bits between 0o600 and 0o775 (e.g. mode=0o600), got {mode!r}; "
                           "set-id and sticky bits are refused")
    if mode & 0o600 != 0o600 or mode & 0o002:
        raise InvalidInput(f"mode={mode:#o} must let the owner read and write (0o600) and must not let every "
                           "user write (0o002): other users could rewrite cached KV")
    return mode


def default_name(spec: KVSpec, numa_node: int | None = None) -> str:
    """``/tieredkv-v<layout version>-u<uid>-<namespace>[-numa<node>]``.

    The layout version lets an upgrade happen in place: workers of a release with another layout
    create a segment of their own beside the old one, which its workers keep serving from until they
    drain (then ``tieredkv rm --stale`` removes it). The uid keeps users of one host apart: another
    user's segment is never this user's default, and a name taken by another user is refused with
    ``PermissionDenied`` (pass ``hot_name=`` of your own then: docs/deploy.md).
    """
    suffix = f"-numa{numa_node}" if numa_node is not None else ""
    return f"/{PREFIX}v{LAYOUT_VERSION}-u{os.getuid()}-{spec.namespace}{suffix}"


class Mapping:
    """An open segment: its descriptor, its mapping and numpy views of every region.

    Keep a ``Mapping`` open for as long as any view of it lives (a view over a closed mmap segfaults).
    """

    def __init__(self, name: str, fd: int, size: int, writable: bool = True, lock_fd: int = -1):
        self.name = name
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self.mm = mmap.mmap(fd, size, access=access)
        # mmap keeps a dup of ``fd`` (same open file description) for its whole life. Locks are taken
        # on a second, separate open of the segment (``lock_fd``, opened here unless the caller
        # already holds one), so that dropping the lock descriptor (a forked child does, see
        # hot/handle.py) really lets go of every lock this handle holds.
        if lock_fd < 0:
            try:
                lock_fd = _reopen(fd, writable)
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


def shm_dir() -> Path:
    """The directory segments live in: ``$TIEREDKV_SHM_DIR`` if set, else /dev/shm. Every process of
    a host that shares a segment must see the same value (it is part of the segment's identity)."""
    return Path(os.environ.get(SHM_DIR_ENV) or SHM_DIR)


def _shm_path(name: str) -> Path:
    return shm_dir() / name.lstrip("/")


def _open_segment(name: str, flags: int, mode: int = 0o600) -> int:
    """``shm_open`` (on Linux: ``open`` under /dev/shm) for the segment directory (``shm_dir``).

    Raises ``posix_ipc.ExistentialError`` for a missing name (or an existing one with ``O_EXCL``),
    as ``posix_ipc.SharedMemory`` does, so callers keep one contract.
    """
    try:
        return os.open(_shm_path(name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except (FileNotFoundError, FileExistsError) as e:
        raise posix_ipc.ExistentialError(f"segment {name}: {e.strerror}") from None


def unlink(name: str) -> None:
    """Remove a segment's name (``shm_unlink``). Raises ``posix_ipc.ExistentialError`` if none."""
    try:
        os.unlink(_shm_path(name))
    except FileNotFoundError:
        raise posix_ipc.ExistentialError(f"no segment {name}") from None


def _reopen(fd: int, writable: bool) -> int:
    """A new open file description of the file behind ``fd`` (locks on it are its own)."""
    return os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)


def _check_owner(fd: int, name: str, mode: int | None = None) -> os.stat_result:
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        raise PermissionDenied(f"segment {name} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
                               "refusing to use another user's cache: pass a name of your own (hot_name=), "
                               "or have root remove it (`tieredkv rm NAME`)")
    extra = st.st_mode & 0o7777 & ~(mode if mode is not None else 0o775)
    if extra & 0o7002 or mode is not None and extra:
        # Someone widened it after creation (a creator always sets exactly its mode): what others
        # could write into it cannot be trusted, and what they could read has leaked prompts.
        raise PermissionDenied(f"segment {name} has mode {st.st_mode & 0o7777:#o}, wider than mode="
                               f"{mode if mode is not None else 0o600:#o}; remove it with `tieredkv rm {name}` "
                               "(a worker recreates it) or pass the mode it was created with")
    return st


def create_or_attach(spec: KVSpec, name: str, layout: Layout, policy_name: str, mode: int,
                     init) -> tuple[Mapping, bool]:
    """Attach to segment ``name``, creating it with ``layout`` if it does not exist.

    A segment this call creates is live from its first published instant: the creator holds owner
    registry byte 0 from (almost) the moment the temporary segment exists, so ``rm --stale`` and the
    reaper of temporaries never take it for a dead creator's leftover. ``HotTier`` registers as
    owner 0 on it (a lock its own descriptor already holds).

    Args:
        init: ``init(mapping)`` fills a fresh segment (every region but the magic) before it is published.

    Returns:
        (mapping, created)
    """
    for _ in range(8):
        try:
            return attach(spec, name, mode=mode), False
        except posix_ipc.ExistentialError:
            pass
        reap_temporaries()
        mapping = _create_private(spec, name, layout, policy_name, mode, init)
        try:
            os.link(_shm_path(mapping.name), _shm_path(name))
        except (FileExistsError, FileNotFoundError):
            # Exists: lost the race, attach to the winner's segment. Not found: our temporary was
            # removed under us (an operator's `rm`); build another.
            _discard(mapping)
            continue
        except OSError:
            _discard(mapping)
            raise
        unlink(mapping.name)
        mapping.name = name
        return mapping, True
    raise FormatError(f"segment {name} keeps appearing and vanishing; is another process removing it?")


def _discard(mapping: Mapping) -> None:
    tmp = mapping.name
    try:
        unlink(tmp)  # first: unlocked, it would look like a dead creator's
    except posix_ipc.ExistentialError:
        pass
    mapping.close()


def _create_private(spec: KVSpec, name: str, layout: Layout, policy_name: str, mode: int, init) -> Mapping:
    where = shm_dir()
    free = os.statvfs(where)
    room = free.f_bavail * free.f_frsize
    if layout.total_bytes > room:
        raise CapacityError(f"segment {name} needs {layout.total_bytes / 2**20:.1f} MiB but {where} has "
                            f"{room / 2**20:.1f} MiB free; lower hot_bytes or enlarge /dev/shm")
    tmp = temp_name()
    fd, lock_fd = _open_segment(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode), -1
    try:
        lock_fd = _reopen(fd, True)
        locks.try_lock(lock_fd, locks.REGISTRY_BASE)  # a fresh file: always ours. Live from here on
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened
        os.ftruncate(fd, layout.total_bytes)
        try:
            os.posix_fallocate(fd, 0, layout.total_bytes)
        except OSError as e:
            raise CapacityError(f"cannot reserve {layout.total_bytes / 2**20:.1f} MiB in {where} for "
                                f"segment {name}: {e.strerror or e}") from None
        mapping = Mapping(tmp, fd, layout.total_bytes, lock_fd=lock_fd)
    except BaseException:
        try:
            unlink(tmp)
        finally:
            os.close(fd)
            if lock_fd >= 0:
                os.close(lock_fd)
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
    h["policy"] = policy_name.encode()  # HotTier checked it fits
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
    for text in ("policy", "fingerprint"):
        try:
            h[text].decode("ascii")
        except UnicodeDecodeError:
            bad.append(text)
    if bad:
        raise FormatError(f"segment {mapping.name} has a damaged header ({', '.join(bad[:4])} do not fit its "
                          f"geometry); remove it with `tieredkv rm {mapping.name}` and let a worker recreate it")


def attach(spec: KVSpec | None, name: str, writable: bool = True, mode: int | None = None,
           owner_check: bool = True) -> Mapping:
    """Open an existing, published segment. Raises ``posix_ipc.ExistentialError`` if there is none.

    Args:
        mode: the permission bits the caller accepts; a segment with more is ``PermissionDenied``.
            ``None`` (operator views): refuse only world-writable and set-id bits.
        owner_check: refuse another user's segment (``False`` only for read-only operator views).
    """
    fd = _open_segment(name, os.O_RDWR if writable else os.O_RDONLY)
    try:
        st = _check_owner(fd, name, mode) if owner_check else os.fstat(fd)
        if st.st_size < HEADER_BYTES:
            raise FormatError(f"segment {name} is {st.st_size} bytes: too small to be a tieredkv segment")
        mapping = Mapping(name, fd, st.st_size, writable)
    except BaseException:
        os.close(fd)
        raise
    try:
        validate(mapping, spec)
    except BaseException:
        mapping.close()
        raise
    return mapping


def unlink_if_same(name: str, inode: int) -> None:
    """Unlink ``name`` if it is still the segment with ``inode`` (not one recreated since)."""
    try:
        if os.stat(_shm_path(name)).st_ino == inode:
            unlink(name)
    except (FileNotFoundError, posix_ipc.ExistentialError):
        pass


# ---- finding segments and judging whether they are stale ------------------------------------------
#: A temporary segment with no live creator is a leftover once this old (or once its creator's pid is
#: gone). The creator takes its registry lock microseconds after creating it; the grace covers that
#: gap for a creator in another PID namespace, whose pid means nothing here.
TMP_GRACE_S = 30.0
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: What ``judge`` says about a segment no live handle holds.
LIVE, STARTING, IDLE, STALE = "live", "starting", "idle", "stale"


def _has_magic(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except OSError:
        return False
    try:
        return os.pread(fd, 8, 0) == np.uint64(MAGIC).tobytes()
    except OSError:
        return False
    finally:
        os.close(fd)


def is_journal_file(filename: str) -> bool:
    """Whether ``filename`` is one of a segment's host journal files (``tieredkv.journal``: NAME.journal,
    its ``.lock``, and the ``.new-PID`` file a rotation renames over it): they share the segment's
    prefix but are not segments."""
    return _JOURNAL_FILE.search(filename) is not None


_JOURNAL_FILE = re.compile(r"\.journal(\.lock|\.new-\d+)?$")


def list_segment_names(*, published_only: bool = False) -> list[str]:
    """Names of every tieredkv segment in /dev/shm, sorted: regular files named ``tieredkv-*`` (not
    their journal files, ``is_journal_file``), and files of any name whose first word is our magic (a
    ``HotTier(name=...)`` segment). Anything else (a directory named like a segment, a socket) is not a
    segment.

    Args:
        published_only: leave out temporary names (segments still being built, or leftovers of a
            creator that died building one).
    """
    if not shm_dir().is_dir():
        return []
    found = []
    for entry in os.scandir(shm_dir()):
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
        except OSError:
            continue
        name = "/" + entry.name
        if not (entry.name.startswith(PREFIX) or _has_magic(Path(entry.path))):
            continue
        if is_journal_file(entry.name) and not _has_magic(Path(entry.path)):
            continue
        if published_only and temp_owner(name) is not None:
            continue
        found.append(name)
    return sorted(found)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True
    except PermissionError:
        return False


def judge(name: str, fd: int) -> tuple[str, str | None]:
    """Say whether the segment open at ``fd`` is in use: ``(LIVE | STARTING | IDLE | STALE, reason)``.

    Liveness is the owner registry locks, never pids or attach errors: a segment with any registry
    byte locked has a live handle (the kernel drops a dead holder's locks), whoever owns it and
    whatever its layout. Without one: a temporary is STALE once its creator is gone (or after
    ``TMP_GRACE_S``), else STARTING; a segment this tieredkv cannot use (another layout version,
    damaged header, foreign magic) is STALE; a good one is IDLE (between restarts: its blocks are
    still worth keeping).
    """
    if locks.is_locked(fd, locks.REGISTRY_BASE, MAX_OWNERS):
        return LIVE, None
    st = os.fstat(fd)
    creator = temp_owner(name)
    if creator is not None:
        if _pid_gone(creator) or time.time() - st.st_ctime >= TMP_GRACE_S:
            return STALE, "leftover of a creator that died"
        return STARTING, None
    if st.st_size < HEADER_BYTES:
        return STALE, f"unusable: {st.st_size} bytes, too small to be a tieredkv segment"
    dup = os.dup(fd)
    try:
        mapping = Mapping(name, dup, st.st_size, writable=False)
    except (OSError, ValueError) as e:
        os.close(dup)
        return STALE, f"unusable: {e}"
    try:
        validate(mapping, None)
    except FormatError as e:
        return STALE, f"unusable: {e}"
    finally:
        mapping.close()
    return IDLE, "no process has it open"


def open_for_admin(name: str, writable: bool = False) -> int:
    """Open a segment by name for an operator view or removal (no owner check: root may look at
    every user's segments). Raises ``OSError``, or ``FormatError`` for something not a regular file."""
    fd = os.open(_shm_path(check_name(name)), (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{_shm_path(name)} is not a regular file, so not a segment")
    return fd


def remove_if_stale(name: str, idle: bool = False, timeout_s: float = 2.0) -> str | None:
    """Unlink segment ``name`` if ``judge`` calls it STALE (or IDLE, with ``idle``); return why, or
    ``None`` when it stays.

    Judged and unlinked under the segment's metadata lock, which a handle also holds while it
    registers: a worker attaching meanwhile either registers first (the segment is live and stays)
    or finds the segment gone once registered, and attaches again (see ``HotTier._register``).

    Raises:
        OSError: it cannot be opened (another user's, without root) or unlinked.
        FormatError: not a regular file.
        LockTimeout: a live process held the metadata lock for ``timeout_s``.
    """
    fd = open_for_admin(name, writable=True)
    try:
        locks.acquire(fd, locks.META_LOCK_BYTE, timeout_s, f"segment {name} lock")
        try:
            state, reason = judge(name, fd)
            if state == STALE or (idle and state == IDLE):
                unlink_if_same(name, os.fstat(fd).st_ino)
                return reason
            return None
        finally:
            locks.unlock(fd, locks.META_LOCK_BYTE)
    finally:
        os.close(fd)


def reap_temporaries() -> int:
    """Unlink dead creators' temporary segments of this user (a crash-looping worker would otherwise
    fill /dev/shm with them). Returns how many were removed. Never raises: reaping is a courtesy."""
    reaped = 0
    for name in list_segment_names():
        if temp_owner(name) is None:
            continue
        try:
            if os.stat(_shm_path(name)).st_uid != os.getuid():
                continue
            if remove_if_stale(name, timeout_s=0.05):
                reaped += 1
        except (OSError, TieredKVError):
            continue
    return reaped


def huge_page_policy(directory: str | os.PathLike | None = None) -> str:
    """How the tmpfs holding ``directory`` (default ``shm_dir()``) backs files with huge pages.

    Returns:
        ``"always"`` / ``"within_size"`` / ``"advise"`` (a tmpfs mounted with that ``huge=``; a
        segment is reserved at creation, so ``advise`` gets none), ``"never"`` (a tmpfs without
        ``huge=``, such as a default /dev/shm; ``shmem_enabled=force`` overrides it), ``"hugetlbfs"``
        (not usable for segments: its files must be whole huge pages), or ``"unknown"``.
    """
    path = os.path.realpath(shm_dir() if directory is None else directory)
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


def huge_mapped_bytes(mapping: Mapping) -> int:
    """Bytes of ``mapping`` this process maps with huge (PMD) pages now, from /proc/self/smaps.

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
