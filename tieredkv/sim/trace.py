"""Block-access traces: a compact in-memory form and the readers/writers of the file formats.

A ``Trace`` is a list of requests, each a list of block ids in prompt order, stored CSR-style (one
flat int64 array of dense ids ``0..unique_blocks-1`` plus request offsets) so replay never builds
Python objects per block.

File formats (chosen from the file's suffix, or by ``fmt=``):

- ``jsonl``: one JSON object per request. Mooncake traces (Qin et al., FAST 2025) carry
  ``"hash_ids": [...]`` (one id per 512-token block, equal ids = equal prefix blocks); our own traces
  carry ``"blocks": [...]`` (integers, or strings such as hex keys). ``"timestamp"`` (ms) is optional.
- ``csv``: a header, then one row per block access with columns ``request`` and ``block``
  (``timestamp`` optional); consecutive rows with the same ``request`` form one request.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tieredkv.errors import FormatError, InvalidInput

__all__ = ["Trace", "read_trace", "write_trace", "TRACE_FORMATS"]


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests as block-id sequences.

    Attributes:
        name: where it came from (file name, or a generator's description).
        blocks: int64 dense block ids of all requests, concatenated.
        offsets: int64, ``n_requests + 1`` entries; request ``i`` is ``blocks[offsets[i]:offsets[i+1]]``.
        timestamps_ms: optional int64 per request.
    """

    name: str
    blocks: np.ndarray
    offsets: np.ndarray
    timestamps_ms: np.ndarray | None = field(default=None)

    @classmethod
    def from_requests(cls, requests: Iterable[Sequence], name: str = "trace",
                      timestamps_ms: Sequence[int] | None = None) -> Trace:
        """Build a trace from per-request id lists (ints or strings; remapped to dense ids).

        A block id repeated inside one request is kept once (its first place): a prompt holds each
        prefix block once, and a cache sees one access per block per request.
        """
        flat: list = []
        offsets = [0]
        for req in requests:
            req = list(dict.fromkeys(req)) if len(set(req)) != len(req) else list(req)
            flat.extend(req)
            offsets.append(len(flat))
        if flat and all(isinstance(b, (int, np.integer)) for b in flat[:1000]) and \
                all(isinstance(b, (int, np.integer)) for b in flat):
            _, dense = np.unique(np.asarray(flat, dtype=np.int64), return_inverse=True)
        else:
            ids: dict = {}
            dense = np.fromiter((ids.setdefault(b, len(ids)) for b in flat), dtype=np.int64, count=len(flat))
        ts = None if timestamps_ms is None else np.asarray(timestamps_ms, dtype=np.int64)
        return cls(name, np.asarray(dense, dtype=np.int64).reshape(-1), np.asarray(offsets, dtype=np.int64), ts)

    @property
    def n_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_accesses(self) -> int:
        return int(self.offsets[-1])

    @property
    def unique_blocks(self) -> int:
        """Distinct block ids (they are dense: the largest plus one). Computed once: it is a pass over
        every access, a sweep asks once per replay, and a Trace is frozen."""
        got = self.__dict__.get("_unique_blocks")
        if got is None:
            got = int(self.blocks.max()) + 1 if len(self.blocks) else 0
            object.__setattr__(self, "_unique_blocks", got)
        return got

    def request(self, i: int) -> np.ndarray:
        """Block ids of request ``i``."""
        return self.blocks[self.offsets[i]:self.offsets[i + 1]]

    def requests(self) -> list[list[int]]:
        """All requests as lists (for writing and tests; not for replay)."""
        return [self.request(i).tolist() for i in range(self.n_requests)]


def _read_jsonl(path: str) -> Trace:
    requests, stamps = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise FormatError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            ids = obj.get("hash_ids", obj.get("blocks")) if isinstance(obj, dict) else None
            if not isinstance(ids, list):
                raise FormatError(f"{path}:{lineno}: a request needs a 'hash_ids' (Mooncake) or "
                                  f"'blocks' list")
            stamp = obj.get("timestamp", 0)
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
                raise FormatError(f"{path}:{lineno}: 'timestamp' must be a number of milliseconds, got {stamp!r}")
            requests.append(ids)
            stamps.append(int(stamp))
    return Trace.from_requests(requests, name=os.path.basename(path), timestamps_ms=stamps)


def _read_csv(path: str) -> Trace:
    requests: list[list] = []
    stamps: list[int] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"request", "block"} <= set(reader.fieldnames):
            raise FormatError(f"{path}: a CSV trace needs a header with 'request' and 'block' columns, "
                              f"got {reader.fieldnames}")
        current = None
        for row in reader:
            if row["request"] != current:
                current = row["request"]
                requests.append([])
                stamps.append(int(float(row.get("timestamp") or 0)))
            b = row["block"]
            requests[-1].append(int(b) if b.lstrip("-").isdigit() else b)
    return Trace.from_requests(requests, name=os.path.basename(path), timestamps_ms=stamps)


def _write_jsonl(trace: Trace, path: str) -> None:
    ts = trace.timestamps_ms
    with open(path, "w", encoding="utf-8") as f:
        for i in range(trace.n_requests):
            obj = {"timestamp": int(ts[i]) if ts is not None else i, "blocks": trace.request(i).tolist()}
            f.write(json.dumps(obj) + "\n")


def _write_csv(trace: Trace, path: str) -> None:
    ts = trace.timestamps_ms
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", "request", "block"])
        for i in range(trace.n_requests):
            for b in trace.request(i).tolist():
                w.writerow([int(ts[i]) if ts is not None else i, i, b])


#: format name -> (reader, writer)
TRACE_FORMATS: dict[str, tuple[Callable[[str], Trace], Callable[[Trace, str], None]]] = {
    "jsonl": (_read_jsonl, _write_jsonl),
    "csv": (_read_csv, _write_csv),
}
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def _format_of(path: str, fmt: str | None) -> str:
    fmt = fmt or _SUFFIXES.get(os.path.splitext(path)[1].lower())
    if fmt not in TRACE_FORMATS:
        raise InvalidInput(f"unknown trace format {fmt!r} for {path!r}; valid: {', '.join(sorted(TRACE_FORMATS))} "
                           f"(pass fmt=, or name the file .jsonl / .csv)")
    return fmt


def read_trace(path: str | os.PathLike, fmt: str | None = None) -> Trace:
    """Read a trace file (Mooncake JSONL, our JSONL, or CSV; see the module docstring).

    Raises:
        InvalidInput: unknown format.
        FormatError: the file does not parse (not text, not JSON, a bad CSV field).
    """
    path = os.fspath(path)
    reader = TRACE_FORMATS[_format_of(path, fmt)][0]
    try:
        return reader(path)
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not a text trace (byte {e.start} is not UTF-8); a trace is JSONL or "
                          "CSV text") from None
    except (ValueError, TypeError) as e:  # a CSV timestamp that is not a number, ids of mixed kinds
        raise FormatError(f"{path}: {e}") from None


def write_trace(trace: Trace, path: str | os.PathLike, fmt: str | None = None) -> None:
    """Write ``trace`` as our JSONL (``"blocks"``) or CSV, by suffix or ``fmt``."""
    path = os.fspath(path)
    TRACE_FORMATS[_format_of(path, fmt)][1](trace, path)
