"""Operator views of hot-tier segments: list, inspect (stale or not), remove.

These read segments without registering as an owner (an ``ls`` must not change what it looks at).
"""

from __future__ import annotations

import json
import os

import numpy as np
import posix_ipc

from tieredkv import counters
from tieredkv.errors import InvalidInput, TieredKVError
from tieredkv.hot import locks
from tieredkv.hot import segment as seg


def inspect(name: str) -> dict:
    """Describe one segment: header, slot counts, live handles, per-host counters, and whether it is
    stale (``judge``: dead or unusable, never one with a live handle) or merely idle.

    Never raises for a broken segment: the problem is reported in ``"error"`` (and ``"stale"``).
    """
    doc: dict = {"name": name, "error": None, "stale": False, "idle": False, "live": False, "reason": None}
    try:
        fd = seg.open_for_admin(name)
    except (OSError, TieredKVError) as e:
        # Unreadable (another user's, without root) or not a file: nothing we may judge or remove.
        return {**doc, "error": f"cannot inspect: {e}"}
    try:
        doc["size_bytes"] = os.fstat(fd).st_size
        state, reason = seg.judge(name, fd)
    finally:
        os.close(fd)
    doc.update(live=state == seg.LIVE, stale=state == seg.STALE, idle=state == seg.IDLE, reason=reason)
    if seg.temp_owner(name) is not None or state == seg.STALE:
        if state == seg.STALE and seg.temp_owner(name) is None:
            doc["error"] = (reason or "").removeprefix("unusable: ")
        return doc
    try:
        mapping = seg.attach(None, name, writable=False, owner_check=False)
    except (TieredKVError, posix_ipc.Error, OSError, ValueError) as e:
        return {**doc, "error": str(e)}
    try:
        h = mapping.header
        owners, slots, *_ = mapping.views()
        live = [int(i) for i in np.flatnonzero(owners["token"])
                if locks.is_locked(mapping.fd, locks.REGISTRY_BASE + int(i))]
        try:
            spec = json.loads(h["spec_json"].decode())
        except ValueError:
            spec = {}
        state = slots["state"]
        stats = owners["stats"].sum(axis=0)
        tier_counters = {n: int(stats[i]) for i, n in enumerate(seg.STAT_FIELDS)}
        totals = counters.totals(owners)
        cache_counters = {n: totals[n] for n in counters.CACHE_FIELDS}
        doc.update({
            "model_id": spec.get("model_id"), "spec": spec, "fingerprint": h["fingerprint"].decode(errors="replace"),
            "policy": h["policy"].decode(), "n_slots": int(h["n_slots"]), "block_bytes": int(h["block_bytes"]),
            "ready_slots": int(np.count_nonzero(state == seg.READY)),
            "writing_slots": int(np.count_nonzero(state == seg.WRITING)),
            "live_handles": len(live), "live_pids": [int(owners["pid"][i]) for i in live],
            "hits": tier_counters["hits"], "misses": tier_counters["misses"], "counters": tier_counters,
            "cache": cache_counters,
            "prefix_hit_rate": counters.prefix_hit_rate(totals),
            "lookup_hist": totals["lookup_hist"], "load_hist": totals["load_hist"],
            "scrubs": int(h["scrubs"]), "huge_pages": seg.huge_page_policy(),
        })
        del owners, slots, h
    finally:
        mapping.close()
    return doc


def list_segments() -> list[dict]:
    """Every tieredkv segment in /dev/shm (or ``$TIEREDKV_SHM_DIR``; any name, see
    ``list_segment_names``), described by ``inspect``."""
    return [inspect(name) for name in seg.list_segment_names()]


def remove(name: str) -> None:
    """Unlink a segment by name. Processes that map it keep their mapping until they close.

    Raises:
        InvalidInput: the name is neither under tieredkv's prefix nor a file with a tieredkv header
            (another program's shared memory: remove that with ``rm`` if you mean it).
    """
    seg.unlink(check_ours(name))


def check_ours(name: str) -> str:
    """``name`` (as ``/name``) when it is tieredkv's to remove: under tieredkv's prefix (damaged or not),
    or a segment of another name whose header starts with tieredkv's magic.

    Raises:
        InvalidInput: neither (another program's shared memory), or a bad name.
        FileNotFoundError: there is no such name.
    """
    name = seg.check_name(name)
    if name.lstrip("/").startswith(seg.PREFIX):
        return name
    with open(seg._shm_path(name), "rb", buffering=0) as f:
        head = f.read(8)
    if len(head) == 8 and int.from_bytes(head, "little") == seg.MAGIC:
        return name
    raise InvalidInput(f"{name} is not a tieredkv segment (no {seg.PREFIX} prefix, no tieredkv header): "
                       f"it would not be removed (remove {seg._shm_path(name)} yourself if you mean it)")


def remove_if_stale(name: str, idle: bool = False) -> str | None:
    """Unlink ``name`` if it is stale (or idle, with ``idle``); return why, or ``None`` if it stays.
    See ``segment.remove_if_stale`` for how this stays safe against workers attaching meanwhile."""
    return seg.remove_if_stale(name, idle=idle)
