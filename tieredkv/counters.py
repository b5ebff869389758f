"""The cache's counter schema: what ``TieredCache`` counts, and how rows of counters are summed.

A counter row is a record with three fields: ``cache`` (one uint64 per name in ``CACHE_FIELDS``),
``lookup_hist`` and ``load_hist`` (one uint64 per bucket of ``LATENCY_BUCKETS_S``). Each open cache
handle writes only its own row, so counting needs no lock; a reader sums the rows it can see. Where the
rows live is up to the tier that keeps them: the hot tier keeps one row per handle in its shared-memory
segment (so the sum is per host, and a row outlives its owner: sums only grow for the segment's life);
a cache whose tiers keep no rows counts in a private row (``private()``).

Readers (``TieredCache.stats``, ``tieredkv ls``/``stats``, the Prometheus exporter) all go through
``totals``, so the names and their order are defined here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: TieredCache counters, in row order.
CACHE_FIELDS = ("lookups", "prompt_tokens", "hit_tokens", "hot_hit_tokens", "warm_hit_tokens",
                "prefill_tokens", "loaded_tokens", "lost_blocks", "stored_blocks", "hot_bytes_read",
                "warm_bytes_read", "hot_bytes_written", "warm_bytes_written", "promotions", "demotions",
                "warm_errors", "corrupt_blocks", "lookup_ns", "load_ns",
                # remote tier: hit tokens, probes that ended in a miss, failed or skipped calls,
                # writes dropped by backpressure (blocks), refused values, bytes moved
                "remote_hit_tokens", "remote_misses", "remote_errors", "remote_drops", "remote_corrupt",
                "remote_bytes_read", "remote_bytes_written",
                # write-behind to the warm tier (blocks): queued for the writer thread, dropped when full
                "warm_queued_blocks", "warm_dropped_blocks")
#: Upper bounds (seconds) of the lookup/load latency histogram buckets; the last bucket is +inf.
LATENCY_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                     5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
#: The fields of one counter row, for embedding in a larger record dtype (the hot tier's owner rows).
ROW_FIELDS = [
    ("cache", "<u8", (len(CACHE_FIELDS),)),
    ("lookup_hist", "<u8", (len(LATENCY_BUCKETS_S),)),
    ("load_hist", "<u8", (len(LATENCY_BUCKETS_S),)),
]
ROW_DTYPE = np.dtype(ROW_FIELDS)

#: Position of each name in ``CACHE_FIELDS``.
FIELD_INDEX = {name: i for i, name in enumerate(CACHE_FIELDS)}
_BOUNDS = np.asarray(LATENCY_BUCKETS_S)


class CacheCounters:
    """One handle's counter row, and the rows to sum for the totals.

    Args:
        row: a record with the ``ROW_FIELDS`` (a row of a shared table, or a private one). Only the
            owner of the row writes it.
        rows: every row that ``totals`` sums (all handles of the host), ``row`` among them.
    """

    def __init__(self, row: Any, rows: Any):
        self.values = row["cache"]
        self.lookup_hist = row["lookup_hist"]
        self.load_hist = row["load_hist"]
        self._rows = rows

    def add(self, name: str, n: int) -> None:
        """Add ``n`` to counter ``name`` (one of ``CACHE_FIELDS``)."""
        self.values[FIELD_INDEX[name]] += n

    def observe(self, what: str, seconds: float) -> None:
        """Record a lookup or load latency (``what`` is ``"lookup"`` or ``"load"``)."""
        hist = self.lookup_hist if what == "lookup" else self.load_hist
        hist[int(np.searchsorted(_BOUNDS, seconds))] += 1
        self.values[FIELD_INDEX[what + "_ns"]] += int(seconds * 1e9)

    def totals(self) -> dict[str, Any]:
        """The sums over every row (see ``totals``)."""
        return totals(self._rows)


def private() -> CacheCounters:
    """A counter row in private memory: totals are this handle's own."""
    row = np.zeros(1, dtype=ROW_DTYPE)
    return CacheCounters(row[0], row)


def totals(rows: Any) -> dict[str, Any]:
    """Sum counter rows: ``{name: int}`` for each of ``CACHE_FIELDS``, plus ``lookup_hist``,
    ``load_hist`` (lists, one count per bucket) and ``latency_buckets_s``.

    Args:
        rows: an array of records with the ``ROW_FIELDS``.
    """
    cache = rows["cache"].sum(axis=0)
    doc: dict[str, Any] = {name: int(cache[i]) for i, name in enumerate(CACHE_FIELDS)}
    doc["lookup_hist"] = rows["lookup_hist"].sum(axis=0).tolist()
    doc["load_hist"] = rows["load_hist"].sum(axis=0).tolist()
    doc["latency_buckets_s"] = list(LATENCY_BUCKETS_S)
    return doc


def prefix_hit_rate(doc: dict[str, Any]) -> float:
    """Hit tokens over prompt tokens of a ``totals`` document (0.0 before any lookup)."""
    return doc["hit_tokens"] / doc["prompt_tokens"] if doc["prompt_tokens"] else 0.0
