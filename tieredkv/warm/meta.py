"""The warm tier's ``meta.json``: format version, spec, fingerprint and slot geometry.

``meta.json`` is written last when a tier is created (temp file, fsync, rename, fsync of the
directory), so its presence means the slabs and the index exist. A copy of the same document lives in
the index (``info/meta``) so ``verify --repair`` can restore a damaged meta file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

from tieredkv.errors import FormatError, SpecMismatch
from tieredkv.spec import KVSpec

FORMAT_NAME = "tieredkv-warm"
#: Bump when the on-disk layout changes; an older tieredkv refuses a newer directory.
FORMAT_VERSION = 1
#: The version of a compact tier (slots smaller than a block, every block stored compressed:
#: ``tieredkv.warm.packed``). Only compact tiers are written with it, so a tier of full slots stays
#: version 1 and opens in every tieredkv that reads version 1, while one that predates compact tiers
#: refuses a compact one as "newer" instead of misreading its slots.
COMPACT_VERSION = 2
#: Versions this tieredkv reads.
READABLE_VERSIONS = (FORMAT_VERSION, COMPACT_VERSION)
META_NAME = "meta.json"
INDEX_NAME = "index.lmdb"
LOCK_NAME = "lock"


def make_meta(spec: KVSpec, *, n_slots: int, slots_per_slab: int, slot_bytes: int) -> dict[str, Any]:
    """The meta document of a new tier; a compact one (``slot_bytes`` below the block's bytes) is
    ``COMPACT_VERSION`` and says so in ``"compact": true``."""
    compact = slot_bytes < spec.block_bytes
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": COMPACT_VERSION if compact else FORMAT_VERSION,
        "namespace": spec.namespace,
        "fingerprint": spec.fingerprint,
        "spec": spec.to_dict(),
        "block_bytes": spec.block_bytes,
        "slot_bytes": slot_bytes,
        "slots_per_slab": slots_per_slab,
        "n_slots": n_slots,
        "capacity_bytes": n_slots * slot_bytes,
    }
    if compact:
        meta["compact"] = True
    return meta


def is_compact(meta: dict[str, Any]) -> bool:
    """Whether the tier's slots are smaller than a block (every block in it is a compressed frame)."""
    return meta.get("compact") is True


def encode_meta(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True, indent=1).encode() + b"\n"


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    """Atomically (re)write ``meta.json`` (0600), durable on return."""
    path = os.path.join(directory, META_NAME)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, encode_meta(meta))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def parse_meta(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and check a meta document (format name, version, required fields).

    Raises:
        FormatError: not a warm tier meta document, damaged, or a newer format version.
    """
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where} is damaged (not valid JSON: {exc}); run `tieredkv verify --repair` "
                          f"to restore it from the index's copy") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} is not a tieredkv warm tier meta file (format "
                          f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise FormatError(f"{where} has no integer format_version")
    if version > COMPACT_VERSION:
        raise FormatError(f"{where} has format version {version}, newer than this tieredkv reads "
                          f"({', '.join(map(str, READABLE_VERSIONS))}); upgrade tieredkv or use another directory")
    if version < FORMAT_VERSION:
        raise FormatError(f"{where} has old format version {version} (this tieredkv reads "
                          f"{FORMAT_VERSION}); delete the directory to start a new warm tier")
    for field, kind in (("spec", dict), ("fingerprint", str), ("slot_bytes", int),
                        ("slots_per_slab", int), ("n_slots", int), ("block_bytes", int)):
        if not isinstance(meta.get(field), kind):
            raise FormatError(f"{where} lacks a valid {field!r}")
    # A compact tier (version 2, "compact": true) has slots smaller than a block; any other must not.
    compact = version == COMPACT_VERSION and meta.get("compact") is True
    if (version == COMPACT_VERSION) != (meta.get("compact") is True):
        raise FormatError(f"{where} has format version {version} and compact={meta.get('compact')!r}: "
                          f"a compact tier is version {COMPACT_VERSION}, any other {FORMAT_VERSION}")
    wrong_size = meta["slot_bytes"] >= meta["block_bytes"] if compact else meta["slot_bytes"] < meta["block_bytes"]
    if meta["slot_bytes"] % 4096 or meta["slot_bytes"] <= 0 or wrong_size or meta["n_slots"] <= 0 \
            or meta["slots_per_slab"] <= 0:
        raise FormatError(f"{where} has an impossible slot geometry")
    return meta


def read_meta(directory: str) -> dict[str, Any]:
    """Read ``<directory>/meta.json``.

    Raises:
        FileNotFoundError: there is no meta file.
        FormatError: see ``parse_meta``.
    """
    path = os.path.join(directory, META_NAME)
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return parse_meta(f.read(), path)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``: never a symlink followed, and never a FIFO
    or device waited on (opened without blocking, then checked).

    Raises:
        FileNotFoundError: there is no such file.
        FormatError: ``path`` is a symbolic link or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(f"{path} is a symbolic link; tieredkv never follows one in a tier directory") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FormatError(f"{path} is not a regular file (mode {stat.filemode(mode)}); remove it")
    os.set_blocking(fd, True)
    return fd


def check_spec(meta: dict[str, Any], spec: KVSpec, where: str) -> None:
    """Raise ``SpecMismatch`` naming every field that differs between ``spec`` and the stored one."""
    if meta["fingerprint"] == spec.fingerprint and meta["block_bytes"] == spec.block_bytes:
        return
    stored = meta["spec"]
    mine = spec.to_dict()
    diffs = [f"{k}: stored {stored.get(k)!r}, given {mine.get(k)!r}"
             for k in sorted(set(stored) | set(mine)) if stored.get(k) != mine.get(k)]
    what = "; ".join(diffs) or f"fingerprint: stored {meta['fingerprint']}, given {spec.fingerprint}"
    raise SpecMismatch(f"the warm tier at {where} was made for a different KV spec ({what}); "
                       f"open it with the spec it was made for, or use another directory")
