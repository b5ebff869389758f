"""The block interface both tiers implement (design.md section 5). Batch calls are primary.

A tier stores fixed-size blocks named by chained keys (``ChunkKeys``). Every call that reads confirms a
block by its stored parent key and chunk tokens; a mismatch is a miss.
"""

from __future__ import annotations

import abc
import dataclasses
import enum

import numpy as np

from tieredkv.keys import ChunkKeys


class PutResult(enum.IntEnum):
    """Per-key outcome of ``put_many``. ``put_many`` returns an int8 array of these codes."""

    STORED = 0      #: this call stored the block
    EXISTS = 1      #: already resident, or another process is writing it right now
    NO_SPACE = 2    #: no slot could be freed (everything pinned or being written)


@dataclasses.dataclass
class TierStats:
    """Counters of one tier. For the hot tier they are per host (they live in shared memory)."""

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
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def to_dict(self) -> dict:
        doc = dataclasses.asdict(self)
        doc["hit_ratio"] = self.hit_ratio
        return doc


@dataclasses.dataclass(frozen=True)
class Evicted:
    """Blocks a tier evicted, handed back so the caller may demote them.

    ``payloads`` is ``None`` when the tier could not keep the bytes (the caller then only learns keys);
    ``hits`` (when the tier tracks them) is each block's hit count while it was resident.
    """

    keys: ChunkKeys
    payloads: np.ndarray | None
    hits: np.ndarray | None = None


class Tier(abc.ABC):
    """A store of blocks. See design.md section 5 for the contract of each call."""

    @abc.abstractmethod
    def match(self, keys: ChunkKeys) -> int:
        """How many leading keys are resident (stops at the first miss)."""

    @abc.abstractmethod
    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        """Bool array: residency per key (blocks being written count as absent)."""

    @abc.abstractmethod
    def get_many(self, keys: ChunkKeys, out: np.ndarray) -> int:
        """Copy leading blocks into ``out`` (row per key); return how many were copied and verified."""

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

    @abc.abstractmethod
    def close(self) -> None:
        """Release mappings and handles. Idempotent; never deletes shared state by itself."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
