"""MemoryTier: blocks in this process's own memory, evicted least recently used first.

The smallest complete ``Tier`` (``tieredkv/tier.py``): a dict from key to (parent, tokens, payload) in
LRU order under one lock. It is private to the process and gone at exit, so it is no substitute for the
hot tier; it is a level for a single-process server that cannot use /dev/shm, and the worked example of
a level added without editing the cache (docs/architecture.md, "Where new things go")::

    from tieredkv.config import CacheConfig, LevelConfig
    extra = LevelConfig("memory", lambda spec, on_evict: MemoryTier(spec, capacity_blocks=1024,
                                                                    on_evict=on_evict), write="on_evict")
    cache = TieredCache(spec, CacheConfig(levels=(extra,)), hot_bytes="64M")
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np

from tieredkv.errors import InvalidInput
from tieredkv.keys import ChunkKeys
from tieredkv.layout import as_block_bytes
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier, TierStats, check_count, check_keys, out_rows


class MemoryTier(Tier):
    """A process-private LRU store of ``capacity_blocks`` blocks.

    Args:
        spec: the KV spec of every block.
        capacity_blocks: how many blocks it holds.
        on_evict: called with the blocks it evicts to make room in ``put_many`` (payloads included).

    Raises:
        InvalidInput: a bad spec or capacity.
    """

    def __init__(self, spec: KVSpec, capacity_blocks: int,
                 on_evict: Callable[[Evicted], None] | None = None):
        if not isinstance(spec, KVSpec):
            raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
        if check_count(capacity_blocks, "capacity_blocks") == 0:
            raise InvalidInput("capacity_blocks must be at least 1")
        self.spec = spec
        self.capacity_blocks = int(capacity_blocks)
        self.on_evict = on_evict
        # key -> [parent, chunk tokens, payload, hits, position]; the first is the least recently used
        self._blocks: collections.OrderedDict[bytes, list] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stats = TierStats("memory", self.capacity_blocks, 0)
        self._closed = False

    def _check(self, keys: ChunkKeys) -> ChunkKeys:
        keys = check_keys(self.spec, keys)
        if self._closed:
            raise InvalidInput("this MemoryTier is closed")
        return keys

    def _find(self, keys: ChunkKeys, i: int) -> list | None:
        """The block of key ``i`` if it is resident and confirmed (same parent and chunk tokens)."""
        entry = self._blocks.get(keys[i])
        if entry is None or entry[0] != keys.parents[i].tobytes() or entry[1] != keys.tokens[i].tobytes():
            return None
        return entry

    def match(self, keys: ChunkKeys) -> int:
        keys = self._check(keys)
        with self._lock:
            return next((i for i in range(len(keys)) if self._find(keys, i) is None), len(keys))

    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        keys = self._check(keys)
        with self._lock:
            return np.array([self._find(keys, i) is not None for i in range(len(keys))], dtype=bool)

    def get_many(self, keys: ChunkKeys, out: np.ndarray,
                 sink: Callable[[int, np.ndarray], None] | None = None) -> int:
        keys = self._check(keys)
        rows = out_rows(self.spec, out, len(keys))
        got = 0
        with self._lock:
            for i in range(len(keys)):
                entry = self._find(keys, i)
                if entry is None:
                    break
                rows[i] = entry[2]
                entry[3] += 1
                self._blocks.move_to_end(keys[i])
                got += 1
            self._stats.hits += got
            self._stats.misses += len(keys) - got
            self._stats.bytes_out += got * self.spec.block_bytes
        if sink is not None and got:
            sink(0, rows[:got])
        return got

    def put_many(self, keys: ChunkKeys, payloads: np.ndarray) -> np.ndarray:
        keys = self._check(keys)
        data = as_block_bytes(self.spec, payloads, len(keys))
        codes = np.full(len(keys), PutResult.EXISTS, dtype=np.int8)
        victims: list[tuple[bytes, list]] = []
        positions = keys.positions
        with self._lock:
            for i in range(len(keys)):
                if keys[i] in self._blocks:
                    continue
                if len(self._blocks) >= self.capacity_blocks:
                    # Room is made from blocks stored before this call only: a batch larger than the
                    # tier keeps its leading blocks.
                    if len(self._blocks) - np.count_nonzero(codes[:i] == PutResult.STORED) <= 0:
                        codes[i] = PutResult.NO_SPACE
                        continue
                    victims.append(self._blocks.popitem(last=False))
                    self._stats.evictions += 1
                self._blocks[keys[i]] = [keys.parents[i].tobytes(), keys.tokens[i].tobytes(), data[i].copy(), 0,
                                         int(positions[i])]
                codes[i] = PutResult.STORED
            stored = int(np.count_nonzero(codes == PutResult.STORED))
            self._stats.puts += stored
            self._stats.bytes_in += stored * self.spec.block_bytes
        if victims and self.on_evict is not None:
            self.on_evict(self._evicted(victims, with_payloads=True))
        return codes

    def remove(self, keys: ChunkKeys) -> int:
        keys = self._check(keys)
        with self._lock:
            gone = [i for i in range(len(keys)) if self._find(keys, i) is not None]
            for i in gone:
                del self._blocks[keys[i]]
        return len(gone)

    def evict(self, n: int) -> Evicted:
        n = check_count(n)
        if self._closed:
            raise InvalidInput("this MemoryTier is closed")
        with self._lock:
            victims = [self._blocks.popitem(last=False) for _ in range(min(n, len(self._blocks)))]
            self._stats.evictions += len(victims)
        return self._evicted(victims, with_payloads=True)

    def _evicted(self, victims: list, *, with_payloads: bool) -> Evicted:
        C = self.spec.chunk_tokens
        keys = ChunkKeys(np.frombuffer(b"".join(k for k, _ in victims), dtype="<u8").reshape(-1, 2).copy(),
                         np.frombuffer(b"".join(e[0] for _, e in victims), dtype="<u8").reshape(-1, 2).copy(),
                         np.frombuffer(b"".join(e[1] for _, e in victims), dtype=np.uint32).reshape(-1, C).copy(),
                         positions=np.array([e[4] for _, e in victims], dtype=np.int64))
        payloads = (np.stack([e[2] for _, e in victims]) if victims
                    else np.zeros((0, self.spec.block_bytes), np.uint8)) if with_payloads else None
        return Evicted(keys, payloads, np.array([e[3] for _, e in victims], dtype=np.int64))

    def stats(self) -> TierStats:
        if self._closed:
            raise InvalidInput("this MemoryTier is closed")
        with self._lock:
            self._stats.used_blocks = len(self._blocks)
            return TierStats(**{**self._stats.__dict__, "extra": {}})

    @property
    def corrupt_seen(self) -> int:
        return 0  # nothing leaves this process's memory: no bytes to damage

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._blocks.clear()

    def __repr__(self) -> str:
        return f"MemoryTier({self.spec.namespace}, {len(self._blocks)}/{self.capacity_blocks} blocks)"
