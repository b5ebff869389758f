"""Offline tools for warm tiers: scrub every checksum (``verify``) and list tiers (``list_warm_tiers``).

Both are what the ``tieredkv verify`` / ``tieredkv ls`` commands call. They read the index and the slab
files directly and may run while workers use the tier: a block that changes while it is scrubbed
(evicted, recycled) is re-checked and not reported.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import xxhash

from tieredkv.errors import FormatError, TieredKVError
from tieredkv.warm import files, packed
from tieredkv.warm import index as ix
from tieredkv.warm import meta as mt
from tieredkv.warm.slabs import slab_name


def _is_tier(path: str) -> bool:
    return os.path.isfile(os.path.join(path, mt.META_NAME)) or os.path.isdir(os.path.join(path, mt.INDEX_NAME))


def _tier_dirs(root: str) -> list[str]:
    if _is_tier(root):
        return [root]
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))
            and _is_tier(os.path.join(root, n))]


def _load_meta(path: str, index: ix.Index | None) -> tuple[dict | None, str, dict | None]:
    """(meta to use, status of meta.json, the index's copy)."""
    copy = None
    if index is not None:
        raw = index.read(lambda txn: txn.get(ix.INFO_META, db=index.info))
        if raw is not None:
            try:
                copy = mt.parse_meta(bytes(raw), f"{path} (index copy)")
            except FormatError:
                copy = None
    try:
        meta = mt.read_meta(path)
    except FileNotFoundError:
        return copy, "missing", copy
    except FormatError as exc:
        return copy, f"damaged: {exc}", copy
    if copy is not None and mt.encode_meta(meta) != mt.encode_meta(copy):
        return copy, "damaged: differs from the index's copy", copy
    return meta, "ok", copy


def verify(directory: str | os.PathLike, repair: bool = False) -> dict[str, Any]:
    """Scrub every block's checksum of the warm tier(s) at ``directory`` and report the damage exactly.

    Args:
        directory: a tier directory (``<root>/<namespace>``) or a root holding tier directories.
        repair: drop the bad blocks from the index (their slots become free), free slots of claims
            whose writer died, restore missing or truncated slab files to full size, and rewrite a
            missing or damaged ``meta.json`` from the index's copy, and replace a missing, emptied or
            truncated index with an empty one made from ``meta.json`` (refused while a process has the
            tier open).

    Returns:
        For a tier directory, a dict with:

        - ``path`` (str), ``namespace`` (str or None), ``model`` (str or None)
        - ``ok`` (bool): no damage found (after ``repair``, ``ok`` still describes what was found)
        - ``meta`` (str): ``"ok"``, ``"missing"``, ``"damaged: <why>"``; ``"restored"`` after repair
        - ``index`` (str): ``"ok"``, ``"missing"``, ``"empty"``, ``"truncated: <sizes>"``,
          ``"damaged: <why>"`` (judged before LMDB maps the file); ``"rebuilt (was ...)"`` after repair
        - ``slabs`` (list of dict): ``name``, ``status`` (``"ok" | "missing" | "truncated"``),
          ``size_bytes``, ``expected_bytes``
        - ``blocks_checked`` (int), ``blocks_ok`` (int)
        - ``bad_blocks`` (list of dict): ``key`` (32 hex digits), ``slab`` (int), ``slot`` (int, global),
          ``reason`` (``"checksum" | "short read" | "missing slab" | "bad record"``)
        - ``dead_claims`` (int): slots claimed by writers that died before committing
        - ``lost_slots`` (int): slots no record owns that are neither free nor claimed (left by a
          record with a damaged slot field); ``repair`` frees them
        - ``repaired`` (bool), ``removed`` (int): blocks dropped by ``repair``
        - ``error`` (str or None): why the tier could not be checked at all

        For a root, ``{"path", "ok", "tiers": [one dict as above per tier]}``.
    """
    directory = os.fspath(directory)
    if _is_tier(directory):
        return _public(_verify_tier(directory, repair))
    tiers = [_verify_tier(p, repair) for p in _tier_dirs(directory)]
    return _public({"path": directory, "ok": all(t["ok"] for t in tiers), "tiers": tiers})


def _verify_tier(path: str, repair: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"path": path, "namespace": None, "model": None, "ok": False, "meta": "?",
                              "index": "?", "slabs": [], "blocks_checked": 0, "blocks_ok": 0,
                              "bad_blocks": [], "dead_claims": 0, "lost_slots": 0, "repaired": False,
                              "removed": 0, "error": None}
    if repair:
        try:
            files.check_access(path)  # the same refusal as opening the tier: we are about to write
        except TieredKVError as exc:
            report["error"] = str(exc)
            return report
        with files.init_lock(path):  # the lock WarmTier holds while it creates or repairs at open
            return _verify_open(path, repair, report)
    return _verify_open(path, repair, report)


def _verify_open(path: str, repair: bool, report: dict[str, Any]) -> dict[str, Any]:
    try:
        report["index"] = files.index_state(path)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: verify must describe any state
        report["index"] = f"damaged: {exc}"
    index_ok = report["index"] == "ok"
    if not index_ok and repair:
        try:
            files.rebuild_index(path, mt.read_meta(path))
            report["index"] = f"rebuilt (was {report['index']})"
        except (OSError, TieredKVError) as exc:
            report["error"] = f"cannot rebuild the index: {exc}"
            return report
    try:
        index = files.open_index(path, write=repair) if index_ok or repair else None
    except Exception as exc:  # noqa: BLE001 - reported, not raised: verify must describe any state
        index = None
        report["error"] = f"cannot open the index: {exc}"
    try:
        meta, status, copy = _load_meta(path, index)
        report["meta"] = status
        if meta is None:
            report["error"] = report["error"] or "no usable meta.json and no copy in the index"
            return report
        report["namespace"] = meta.get("namespace")
        report["model"] = meta["spec"].get("model_id")
        if index is None:
            return report
        _scrub(path, meta, index, report)
        if repair:
            _repair(path, meta, index, report)
            if status != "ok" and copy is not None:
                mt.write_meta(path, copy)
                report["meta"] = "restored"
            report["repaired"] = True
        report["ok"] = (status == "ok" and index_ok and not report["bad_blocks"] and not report["dead_claims"]
                        and not report["lost_slots"] and all(s["status"] == "ok" for s in report["slabs"]))
        return report
    finally:
        if index is not None:
            index.close()


def _scrub(path: str, meta: dict, index: ix.Index, report: dict) -> None:
    n_slots, per, slot_bytes = meta["n_slots"], meta["slots_per_slab"], meta["slot_bytes"]
    block_bytes = meta["block_bytes"]
    rec_dtype = ix.record_dtype(meta["spec"].get("chunk_tokens", 64))
    n_slabs = (n_slots + per - 1) // per
    fds: dict[int, int] = {}
    for i in range(n_slabs):
        expected = min(per, n_slots - i * per) * slot_bytes
        p = os.path.join(path, slab_name(i))
        try:
            fds[i] = mt.open_regular(p)  # a FIFO planted under a slab's name is not waited on
            size = os.fstat(fds[i]).st_size
            status = "ok" if size >= expected else "truncated"
        except FileNotFoundError:
            size, status = 0, "missing"
        report["slabs"].append({"name": slab_name(i), "status": status, "size_bytes": size,
                                "expected_bytes": expected})
    buf = bytearray(block_bytes)
    suspects = []
    try:
        txn = index.begin_read()
        try:
            for key, val in txn.cursor(db=index.blocks):
                report["blocks_checked"] += 1
                if len(val) != rec_dtype.itemsize:
                    suspects.append((key, -1, -1, "bad record"))
                    continue
                rec = np.frombuffer(val, dtype=rec_dtype)[0]
                slot, gen = int(rec["slot"]), int(rec["gen"])
                slab = slot // per
                length = int(rec["length"])  # less than block_bytes: a compressed frame (warm/packed.py)
                if slot >= n_slots or not packed.valid_length(np.int64(length), block_bytes, slot_bytes) \
                        or txn.get(ix.slot_key(slot), db=index.slots) != key:
                    suspects.append((key, slot, gen, "bad record"))
                    continue
                if slab not in fds:
                    suspects.append((key, slot, gen, "missing slab"))
                    continue
                stored = memoryview(buf)[:length]
                got = os.preadv(fds[slab], [stored], (slot % per) * slot_bytes)
                if got < length:
                    suspects.append((key, slot, gen, "short read"))
                elif xxhash.xxh3_64_intdigest(stored) != int(rec["checksum"]):
                    suspects.append((key, slot, gen, "checksum"))
                else:
                    report["blocks_ok"] += 1
            # Claims whose writer died: their slots are neither free nor used until reaped.
            report["dead_claims"] = sum(1 for _, c in txn.cursor(db=index.inflight)
                                        if not index.claim_alive(*ix.CLAIM.unpack(c)[1:3]))
            report["lost_slots"] = len(_lost_slots(txn, index, rec_dtype))
        finally:
            txn.abort()
    finally:
        for fd in fds.values():
            os.close(fd)
    # A block evicted or recycled while we read it is not damage: keep only records unchanged since.
    confirmed = index.read(lambda t: [s for s in suspects if _unchanged(t, index, rec_dtype, s)])
    report["blocks_checked"] -= len(suspects) - len(confirmed)
    report["bad_blocks"] = [{"key": key.hex(), "slab": slot // per if slot >= 0 else -1, "slot": slot,
                             "reason": reason, "_gen": gen} for key, slot, gen, reason in confirmed]


def _unchanged(txn, index: ix.Index, rec_dtype: np.dtype, suspect) -> bool:
    key, slot, gen, reason = suspect
    val = txn.get(key, db=index.blocks)
    if val is None:
        return False
    if reason == "bad record" and slot < 0:
        return len(val) != rec_dtype.itemsize
    if len(val) != rec_dtype.itemsize:
        return True
    return int(np.frombuffer(val, dtype=rec_dtype)[0]["gen"]) == gen


def _lost_slots(txn, index: ix.Index, rec_dtype: np.dtype) -> list[int]:
    """Slots below the high-water mark that no record owns and that are neither free nor claimed.

    A record whose slot field was damaged is dropped without freeing anything (it cannot say which
    slot was its own), and a reverse entry may outlive its record: such slots would stay unusable.
    """
    hwm = ix.get_u64(txn, index.info, ix.INFO_HWM)
    seen = np.zeros(hwm, dtype=bool)
    for sk, key in txn.cursor(db=index.slots):
        s = ix.SLOT_KEY.unpack(sk)[0]
        v = txn.get(key, db=index.blocks)
        if s < hwm and v is not None and len(v) == rec_dtype.itemsize \
                and int(np.frombuffer(v, dtype=rec_dtype)[0]["slot"]) == s:
            seen[s] = True
    for sk, _ in txn.cursor(db=index.free):
        s = ix.SLOT_KEY.unpack(sk)[0]
        if s < hwm:
            seen[s] = True
    for _, c in txn.cursor(db=index.inflight):
        s = ix.CLAIM.unpack(c)[0]
        if s < hwm:
            seen[s] = True
    return np.flatnonzero(~seen).tolist()


def _repair(path: str, meta: dict, index: ix.Index, report: dict) -> None:
    bad = report["bad_blocks"]
    rec_dtype = ix.record_dtype(meta["spec"].get("chunk_tokens", 64))

    def fix(txn):
        removed = 0
        for b in bad:
            key = bytes.fromhex(b["key"])
            val = txn.get(key, db=index.blocks)
            if val is None:
                continue
            if len(val) == rec_dtype.itemsize:
                rec = np.frombuffer(val, dtype=rec_dtype)[0]
                if b["_gen"] >= 0 and int(rec["gen"]) != b["_gen"]:
                    continue
                slot = int(rec["slot"])
                if 0 <= slot < meta["n_slots"] and txn.get(ix.slot_key(slot), db=index.slots) == key:
                    txn.delete(ix.slot_key(slot), db=index.slots)
                    txn.put(ix.slot_key(slot), b"", db=index.free)
            txn.delete(key, db=index.blocks)
            removed += 1
        dead = [(k, ix.CLAIM.unpack(c)[0]) for k, c in txn.cursor(db=index.inflight)
                if not index.claim_alive(*ix.CLAIM.unpack(c)[1:3])]
        for k, slot in dead:
            txn.delete(k, db=index.inflight)
            txn.put(ix.slot_key(slot), b"", db=index.free)
        for slot in _lost_slots(txn, index, rec_dtype):  # after the drops above: what nobody owns
            txn.delete(ix.slot_key(slot), db=index.slots)  # a reverse entry without its record
            txn.put(ix.slot_key(slot), b"", db=index.free)
        total = ix.get_u64(txn, index.info, ix.INFO_CORRUPT) + removed
        ix.put_u64(txn, index.info, ix.INFO_CORRUPT, total)
        return removed

    report["removed"] = index.write(fix)
    # The records of lost bytes are dropped above; the tier's own repair restores the files (and drops
    # anything the scrub did not see, e.g. a block stored into a short slab since).
    _, dropped = files.repair_slabs(index, files.slabs_of(path, meta))
    report["removed"] += dropped


def _public(report: dict) -> dict:
    for b in report.get("bad_blocks", []):
        b.pop("_gen", None)
    for t in report.get("tiers", []):
        _public(t)
    return report


def list_warm_tiers(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Describe every warm tier under ``root`` (or ``root`` itself if it is one).

    Returns:
        One dict per tier, sorted by path:

        - ``path`` (str), ``namespace`` (str), ``model`` (str): the spec's ``model_id``
        - ``format_version`` (int)
        - ``size_bytes`` (int): disk space the tier's files take (allocated blocks)
        - ``blocks`` (int): blocks stored now
        - ``capacity_blocks`` (int), ``capacity_bytes`` (int), ``block_bytes`` (int)
        - ``error`` (str or None): why some fields could not be read (they are then None)
    """
    out = []
    for path in _tier_dirs(os.fspath(root)):
        row: dict[str, Any] = {"path": path, "namespace": os.path.basename(path), "model": None,
                               "format_version": None, "size_bytes": disk_bytes(path), "blocks": None,
                               "capacity_blocks": None, "capacity_bytes": None, "block_bytes": None,
                               "error": None}
        try:
            meta = mt.read_meta(path)
            row.update(namespace=meta["namespace"], model=meta["spec"].get("model_id"),
                       format_version=meta["format_version"], capacity_blocks=meta["n_slots"],
                       capacity_bytes=meta["capacity_bytes"], block_bytes=meta["block_bytes"])
        except (OSError, TieredKVError) as exc:
            row["error"] = f"meta.json: {exc}"
        try:
            index = files.open_index(path)
            try:
                row["blocks"] = files.block_count(index)
            finally:
                index.close()
        except Exception as exc:  # noqa: BLE001 - listing must not fail on one broken tier
            row["error"] = (row["error"] + "; " if row["error"] else "") + f"index: {exc}"
        out.append(row)
    return out


def disk_bytes(path: str) -> int:
    """Bytes the files under ``path`` occupy on disk (allocated blocks, not apparent sizes)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for f in names:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
