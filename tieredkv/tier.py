"""The block interface every tier implements, and the contract each call keeps.

A tier stores fixed-size blocks (``spec.block_bytes`` bytes each) named by chained keys (``ChunkKeys``).
``TieredCache`` speaks to its tiers only through this class, and ``tests/test_tier_contract.py`` runs
one suite of cases against every tier, so a new tier (a remote store, say) is pluggable by
subclassing ``Tier`` and adding itself to that suite's list of tier factories.

The contract, call by call (batch calls are primary; a 4k-token prompt is one call, not 64):

========================  ==========================================================================
``match(keys)``           how many *leading* keys are resident and confirmed; stops at the first miss
``contains_many(keys)``   bool per key, resident and confirmed; blocks still being written are absent
``get_many(keys, out)``   copy the leading resident blocks into ``out`` (row ``i`` for key ``i``) and
                          return how many were copied *and* verified; a block removed, recycled,
                          torn or corrupt meanwhile ends the run: it is never returned
``read_into(keys, sink)`` like ``get_many``, but hand each block to ``sink(i, block_bytes)``
``read_runs(keys, sink)`` like ``read_into``, a run of blocks at a time: ``sink(i, rows)``
``read_through(keys, sink)`` ``get_many`` with a sink, for a caller that keeps no rows: a group's rows
                          are valid only during its sink call and may precede its verification
``put_many(keys, blks)``  store; one ``PutResult`` per key (``STORED`` / ``EXISTS`` / ``NO_SPACE``);
                          never waits on another writer; a full tier evicts by its policy
``remove(keys)``          drop the resident blocks among ``keys``; return how many were dropped
``evict(n)``              evict up to ``n`` blocks chosen by the policy; hand them back (``Evicted``)
``stats()``               ``TierStats``: counters and residency
``close()``               idempotent; releases handles, never deletes shared or persistent state
========================  ==========================================================================

Rules every tier keeps:

- **Confirmed hits.** A key is resident only if the stored block carries the same parent key and the
  same chunk tokens as ``keys`` says (a hash collision is a miss, never wrong KV).
- **Keys of another chunk size** (``keys.tokens.shape[1] != spec.chunk_tokens``) are a caller error:
  every call that takes keys raises ``InvalidInput``. Anything but a ``ChunkKeys`` does too.
- **Rows of ``out``.** ``out`` holds *at least* ``len(keys)`` blocks: ``(m, block_bytes)`` uint8 or the
  spec's dtype shaped ``(m, *block_shape)`` with ``m >= len(keys)``; rows past ``len(keys)`` are never
  written; rows past the returned count hold unspecified bytes. A read-only or too small ``out``, or
  one of another dtype, raises ``InvalidPayload``. ``put_many``'s ``payloads`` hold exactly one block
  per key.
- **``evict(n)``**: ``n`` is a non-negative ``int`` (numpy integers too; not ``bool``, not ``str``),
  else ``InvalidInput``. ``evict(0)`` evicts nothing.
- **``Evicted``** carries, per evicted block: its key, parent key, chunk tokens and position
  (``keys``), its payload bytes (``payloads``, ``(m, block_bytes)`` uint8, or ``None`` when the caller
  asked for keys only), and its hit count while resident (``hits``, int64).
- **``sink``s** (``get_many(keys, out, sink)``, ``read_through``, ``read_into``, ``read_runs``) are called
  in key order, each block exactly once, with rows that are valid only during the call; ``get_many``'s
  and ``read_through``'s sinks see rows as soon as they are filled, which may be before they are
  verified, so only the leading blocks the call returns are valid where the sink put them. An
  exception in a sink is raised by the call.
- **Counters** (``stats()``): ``get_many``, ``read_through``, ``read_into`` and ``read_runs`` add the
  returned count to ``hits``, the rest of ``len(keys)`` to ``misses`` and ``hits * block_bytes`` to
  ``bytes_out``; ``put_many`` adds the ``STORED`` count to ``puts`` and ``STORED * block_bytes`` to
  ``bytes_in``; every block evicted (by ``evict`` or to make room in ``put_many``) adds one to
  ``evictions``; ``match``, ``contains_many`` and ``remove`` change none of these. A tier states the
  scope of its counters in ``TierStats``'s docstring of its own ``stats`` (the hot tier's are per host,
  the warm tier's per handle).
- **Errors** are ``TieredKVError`` subclasses; running out of room is ``NO_SPACE``, not an exception.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv.counters import CacheCounters
from tieredkv.errors import InvalidInput
from tieredkv.keys import ChunkKeys
from tieredkv.layout import as_block_bytes
from tieredkv.spec import KVSpec


class PutResult(enum.IntEnum):
    """Per-key outcome of ``put_many``. ``put_many`` returns an int8 array of these codes."""

    STORED = 0      #: this call stored the block
    EXISTS = 1      #: already resident, or another process is writing it right now
    NO_SPACE = 2    #: no slot could be freed (everything pinned or being written)


@dataclasses.dataclass
class TierStats:
    """Counters of one tier (see the module docstring for which call bumps which)."""

    name: str
    capacity_blocks: int
    used_blocks: int
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    recoveries: int = 0
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        """Hits over hits + misses (0.0 before any read)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def to_dict(self) -> dict:
        """The counters as a plain dict, ``hit_ratio`` included."""
        doc = dataclasses.asdict(self)
        doc["hit_ratio"] = self.hit_ratio
        return doc


@dataclasses.dataclass(frozen=True)
class Evicted:
    """Blocks a tier evicted, handed back so the caller may demote them.

    Attributes:
        keys: key, parent key, chunk tokens and position of each evicted block.
        payloads: ``(len(keys), block_bytes)`` uint8, or ``None`` when the caller asked for keys only.
        hits: each block's hit count while it was resident (int64), for demotion rules.
    """

    keys: ChunkKeys
    payloads: np.ndarray | None
    hits: np.ndarray

    def __post_init__(self) -> None:
        if len(self.hits) != len(self.keys):
            raise InvalidInput(f"Evicted: {len(self.hits)} hit counts for {len(self.keys)} keys")


def check_keys(spec: KVSpec, keys: Any) -> ChunkKeys:
    """Return ``keys`` if it is a ``ChunkKeys`` made with ``spec``'s chunk size, else raise.

    Raises:
        InvalidInput: not a ``ChunkKeys``, or keys of another chunk size.
    """
    if not isinstance(keys, ChunkKeys):
        raise InvalidInput(f"keys must be a ChunkKeys (from tieredkv.chunk_keys), got {type(keys).__name__}")
    if keys.tokens.shape[1:] != (spec.chunk_tokens,):
        raise InvalidInput(f"keys were made with chunk_tokens={keys.tokens.shape[1]}, this tier's spec has "
                           f"{spec.chunk_tokens}; make them with tieredkv.chunk_keys(spec, tokens)")
    return keys


def check_count(n: Any, what: str = "n") -> int:
    """Return ``n`` as an int if it is a non-negative integer (not a bool), else raise ``InvalidInput``."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InvalidInput(f"{what} must be a non-negative integer, got {n!r}")
    return int(n)


def out_rows(spec: KVSpec, out: Any, n: int) -> np.ndarray:
    """The first ``n`` rows of ``out`` as an ``(n, block_bytes)`` uint8 view (see "Rows of ``out``").

    Raises:
        InvalidPayload: ``out`` is not a writable array of the spec's dtype (or uint8) with at least
            ``n`` C-contiguous blocks.
    """
    if isinstance(out, np.ndarray) and out.ndim and out.shape[0] > n:
        out = out[:n]
    return as_block_bytes(spec, out, n, what="out", writable=True)


class Tier(abc.ABC):
    """A store of blocks. See the module docstring for the contract of each call.

    Attributes:
        spec: the KV spec (geometry and namespace) of every block this tier holds.
    """

    spec: KVSpec

    @abc.abstractmethod
    def match(self, keys: ChunkKeys) -> int:
        """How many leading keys are resident and confirmed (stops at the first miss)."""

    @abc.abstractmethod
    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        """Bool array: residency per key (blocks being written count as absent)."""

    @abc.abstractmethod
    def get_many(self, keys: ChunkKeys, out: np.ndarray,
                 sink: Callable[[int, np.ndarray], None] | None = None) -> int:
        """Copy leading blocks into ``out`` (row per key); return how many were copied and verified.

        ``sink(i, rows)``, if given, is handed ``out``'s rows ``i .. i+k-1`` (uint8) as they are
        filled, so a caller can move them on (into a model layout, say) while the tier works on the
        next ones; only the leading rows the call returns are valid.
        """

    def read_through(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None],
                     staging: np.ndarray | None = None, *, parallel: bool = False) -> int:
        """``get_many(keys, staging, sink)`` for a caller that needs the blocks only where ``sink`` puts
        them (a restore into a model layout): ``sink(i, rows)`` gets each group as soon as it is read,
        possibly before it is verified, with rows valid only during the call; only the leading blocks
        the call returns are valid where the sink put them.

        ``parallel`` says that ``sink`` only writes each block's own places (no state shared between
        calls), so a tier may call it from a thread of its own and out of key order (each block still
        exactly once) to read with two threads; this default ignores it.

        This default reads into ``staging`` (``(>= len(keys), block_bytes)`` uint8 rows; a new buffer
        when None). A tier that reads in groups overrides it to reuse one small buffer for every group
        (the warm tier: each group is still in the CPU cache when the sink copies it on).

        Returns:
            How many leading blocks were read and verified (the count ``get_many`` would return).
        """
        if staging is None:
            staging = np.empty((len(check_keys(self.spec, keys)), self.spec.block_bytes), dtype=np.uint8)
        return self.get_many(keys, staging, sink)

    def read_into(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Deliver the leading resident blocks one by one: ``sink(i, block)`` for ``i`` in ``0..n-1``.

        ``block`` is a ``(block_bytes,)`` uint8 array valid only during the call: copy it where it
        belongs (a strided slice of a model's cache, say). This default reads through ``get_many``
        into a staging buffer; a tier that can hand out its own memory safely (the hot tier, while the
        block is pinned) overrides it to save that copy.

        Returns:
            How many leading blocks were delivered (the same count ``get_many`` would return).
        """
        def per_block(i: int, rows: np.ndarray) -> None:
            for j in range(len(rows)):
                sink(i + j, rows[j])

        return self.read_runs(keys, per_block)

    def read_runs(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Deliver the leading resident blocks in runs: ``sink(i, rows)`` with ``rows`` a
        ``(k, block_bytes)`` uint8 array holding blocks ``i .. i+k-1``, valid only during the call.

        One call per run, not per block: a caller copies a run into its destination with one numpy
        call. This default reads through ``get_many`` into a staging buffer and delivers the leading
        run in one call; a tier that can hand out its own memory safely (the hot tier: runs of
        adjacent slots, while pinned) overrides it to save that copy.

        Returns:
            How many leading blocks were delivered (the same count ``get_many`` would return).
        """
        keys = check_keys(self.spec, keys)
        staging = np.empty((len(keys), self.spec.block_bytes), dtype=np.uint8)
        got = self.get_many(keys, staging)
        if got:
            sink(0, staging[:got])
        return got

    @abc.abstractmethod
    def put_many(self, keys: ChunkKeys, payloads: np.ndarray) -> np.ndarray:
        """Store blocks; return one ``PutResult`` code (int8) per key. Never blocks forever."""

    @abc.abstractmethod
    def remove(self, keys: ChunkKeys) -> int:
        """Remove the given blocks if resident; return how many were removed."""

    @abc.abstractmethod
    def evict(self, n: int) -> Evicted:
        """Evict up to ``n`` blocks chosen by the eviction policy and hand them back."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """Counters and residency."""

    @property
    @abc.abstractmethod
    def corrupt_seen(self) -> int:
        """Blocks this handle found damaged and dropped instead of returning them (cheap to read:
        ``TieredCache`` reads it around every load to count corrupt blocks)."""

    def cache_counters(self) -> CacheCounters | None:
        """A row for the cache's own counters that this tier keeps where every process sees it.

        ``TieredCache`` counts lookups, hit tokens, promotions, ... in the first of its tiers that
        returns one (the hot tier keeps one row per handle in shared memory, so the totals are per
        host), and in private memory if none does. Default: ``None``.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release mappings and handles. Idempotent; never deletes shared state by itself."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
