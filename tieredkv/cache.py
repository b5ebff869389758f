"""TieredCache: the object users hold. Lookup, load and store as loops over an ordered list of levels.

```
levels:  hot (shared memory) -> warm (SSD, optional) -> yours (optional) -> remote (fleet, optional)
lookup(tokens) --keys--> levels[0].contains_many --(misses)--> each next level's match --> PrefixHit
load(hit, out)  : runs of the hit read from their level: the top one straight from shared memory into
                  ``out`` (one copy), the others into a kept staging buffer, copied into ``out`` and,
                  once all is in place, promoted into the levels above
store(tokens,kv): new full chunks -> the top level (gathered straight into its claimed slots); each
                  lower level gets them at store (write-through, or write-behind: its writer copies
                  them out of the top level, tieredkv/writeback.py) or when the level above evicts them
```

A block may be hot while its parent is warm: the hit is the longest run of leading blocks each found in
*some* level. Nothing here holds a lock across calls; a block lost between ``lookup`` and ``load``
truncates the load, it never corrupts it. What a level is (admission, writer, how it fails) is in
``tieredkv/levels.py``; the options in ``tieredkv/config.py``; the array checks in ``tieredkv/tensors.py``;
the read path (staging, promotion) in ``tieredkv/loading.py``; the write path in ``tieredkv/storing.py``;
``PrefixHit`` in ``tieredkv/hit.py``.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tieredkv import counters, forksafe, tensors
from tieredkv.config import CacheConfig
from tieredkv.errors import InvalidInput
from tieredkv.hit import HOT, REMOTE, WARM, PrefixHit
from tieredkv.journal import HostJournal, journal_path
from tieredkv.keys import ChunkKeys, as_tokens, chunk_keys
from tieredkv.layout import as_block_bytes
from tieredkv.levels import Counting, Level, Observer, close_level, open_levels, warn_degraded
from tieredkv.loading import Loader
from tieredkv.policies import promotion as promotion_rules
from tieredkv.spec import KVSpec
from tieredkv.storing import Storer
from tieredkv.tier import PutResult, Tier, check_keys, out_rows

__all__ = ["HOT", "REMOTE", "WARM", "PrefixHit", "TieredCache"]  # PrefixHit and the codes live in hit.py


class TieredCache:
    """A hot (shared memory) tier in front of an optional warm (SSD) tier, further levels of your own
    and an optional remote tier, for one KV spec.

    Restart-safe by default: with a warm tier, every block ``store`` puts in the hot tier is also
    written to the warm tier by a background thread (``demotion="write_behind"``), so ``store`` returns
    as soon as the block is in shared memory and a new process finds the prefix in warm after a
    reboot removed the segment. ``close()`` (or leaving the ``with`` block, or a normal interpreter
    exit) waits up to ``warm_flush_s`` for the queued writes; a process killed with SIGKILL loses at most
    what was queued (at most ``warm_queue_bytes``). A full queue drops the warm write, counted in
    ``stats()["warm_dropped_blocks"]``. ``demotion="write_through"`` makes the warm write before ``store``
    returns; ``"on_evict"`` writes a block only when the hot tier evicts it (it does not survive a
    reboot until then).

    Args:
        spec: the model's KV geometry and namespace.
        config: every option (``tieredkv.config.CacheConfig``); the keyword arguments below, if any,
            replace its fields. One of the two is enough.
        **kwargs: the options by their keywords (``CacheConfig.from_kwargs``; sizes may be "8G"):
            ``hot_bytes`` (segment size, metadata included), ``hot_blocks``, ``hot_name``, ``numa_node``,
            ``promotion`` (``"always"``, ``"on_nth_hit:N"``, ``"never"``: lower level -> hot on load),
            ``warm_dir`` (``None``: no warm tier), ``warm_bytes``, ``demotion`` (when a block reaches
            warm: ``"write_behind"``, ``"write_through"``, ``"on_evict"``, ``"on_nth_hit:N"``),
            ``warm_sync``, ``warm_verify`` (only ``"always"`` protects against media corruption,
            docs/warm-tier.md), ``warm_queue_bytes``, ``warm_flush_s``, ``warm_compress`` (``"zstd"``,
            ``"lz4"``; off by default), ``warm_slot_fraction`` (below 1: a compact warm tier, more
            blocks in ``warm_bytes``), ``remote`` (a URL such as
            ``"valkey://host:6379"`` or a ``Tier``; the cache closes it), ``remote_write``,
            ``remote_queue_blocks`` or ``remote_queue_bytes``, ``remote_flush_s``, ``eviction``,
            ``lock_timeout_s``, ``journal`` (record stored and evicted blocks in the host journal, for
            KV events). Their meaning is documented field by field in ``tieredkv/config.py``.

    Raises:
        InvalidInput: a bad option (the message names it as the caller did) or spec.
        TieredKVError: a tier could not be opened (see ``HotTier`` and ``WarmTier``). A lower level
            whose files are damaged, unreachable or locked by a stopped writer, or that a full disk
            cannot hold, does not raise: the cache starts without it with a ``RuntimeWarning`` (and
            its ``*_errors`` counted). Another user's warm files raise ``PermissionDenied``.
    """

    def __init__(self, spec: KVSpec, config: CacheConfig | None = None, *positional: Any, **kwargs: Any):
        if not isinstance(spec, KVSpec):
            raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
        self.spec = spec
        self.config = CacheConfig.from_call(config, positional, kwargs)
        #: Called after blocks are stored in or evicted from a level (see ``tieredkv.levels``).
        self.observers: list[Observer] = []
        self.journal: HostJournal | None = None  # see attach_journal
        self._counting = Counting()
        self._levels: list[Level] = []
        self._closed = True   # until the levels are open: close() copes with a constructor that failed
        self._lock = threading.Lock()
        forksafe.register(self)  # this lock, unlocked in a forked child (held by a writer at fork)
        self._storer = Storer(spec, self._counting)
        self._placement = tensors.Placement(spec)
        self._loader = Loader(spec, self._placement, promotion_rules.make(self.config.hot.promotion))
        # A promotion into the top level may evict blocks queued for write-behind: they are copied out first.
        self._loader.before_put = self._storer.behind.before_put
        levels, failures = open_levels(spec, self.config, self._counting, self.observers)
        self._levels, self._closed = levels, False
        self._by_code = {level.code: level for level in levels}
        if any(level.at_store and level.writer is not None for level in levels[1:]) \
                and hasattr(levels[0].tier, "before_close"):
            # Whoever closes the segment (``cache.hot.unlink()`` too), queued writes keep their blocks.
            levels[0].tier.before_close = self._storer.behind.rescue_all
        self._counting.tiers = [level.tier for level in levels]
        warn_degraded(levels, failures, self._counting, self.config.warm.dir if self.config.warm else None)
        if self.config.journal:
            try:
                journal = HostJournal(journal_path(getattr(levels[0].tier, "name", "/tieredkv-" + spec.namespace)))
                if getattr(levels[0].tier, "created", False):  # a new, empty segment: older records are stale
                    journal.restart(levels[0].code)
            except BaseException:
                self.close()
                raise
            self.attach_journal(journal)
        if any(level.writer is not None for level in levels):
            # A process that exits normally without close() still gets its queues written.
            atexit.register(_flush_at_exit, weakref.ref(self))

    # ---- the levels by name (for tools and tests; the serving path loops over them) ------------------
    def level(self, name: str) -> Level | None:
        """The level named ``name`` (``"hot"``, ``"warm"``, ``"remote"`` or yours), or None."""
        return next((level for level in self._levels if level.name == name), None)

    def _tier(self, name: str) -> Tier | None:
        level = self.level(name)
        return level.tier if level is not None else None

    @property
    def hot(self) -> Tier:
        """The hot tier (the top level)."""
        if not self._levels:
            raise InvalidInput("this TieredCache did not open")
        return self._levels[0].tier

    @property
    def warm(self) -> Tier | None:
        return self._tier("warm")

    @property
    def remote(self) -> Tier | None:
        return self._tier("remote")

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels, top first."""
        return tuple(self._levels)

    # ---- host journal ------------------------------------------------------------------------------
    def attach_journal(self, journal: HostJournal) -> None:
        """Record this handle's tier changes in ``journal`` (a ``tieredkv.journal.HostJournal``; the
        cache closes it): blocks stored into a level (by a store, a promotion, a demotion) as
        ``STORED``, blocks a level evicts while this handle makes room as ``EVICTED``, each with the
        level's ``PrefixHit.where`` code. Every process of the host that journals the same segment
        adds its own; a journal that fails to append is warned about once and never fails a call.
        """
        self.journal = journal
        self.observers.append(journal.observer({level.name: level.code for level in self._levels}))

    # ---- lookup ---------------------------------------------------------------------------------
    def lookup(self, tokens: Any, salt: bytes = b"", *, extra: Sequence[bytes | None] | None = None,
               count: bool = True) -> PrefixHit:
        """Find the longest cached prefix of ``tokens`` (1-D ints) under ``salt``.

        A hit never covers the whole prompt: the model needs at least one token to compute logits.
        ``extra``: per-chunk bytes folded into the keys (``chunk_keys``). ``count=False`` leaves the
        hit counters alone: a caller that asks again for one prompt counts what it served itself
        (``count_served``).
        """
        started = time.perf_counter()
        ids = as_tokens(tokens)
        C = self.spec.chunk_tokens
        keys = chunk_keys(self.spec, ids[: (max(len(ids) - 1, 0) // C) * C], salt, extra)
        levels = self._open_levels()
        where = self.resident_run(keys)
        run = len(where)
        hit = PrefixHit(tokens=run * C, prompt_tokens=len(ids), keys=keys[:run], where=where)
        if count:
            self.count_served(len(ids), {level.code: hit.blocks_in(level.code) * C for level in levels},
                              prefill_tokens=hit.prefill_tokens)
        self._counting.observe("lookup", time.perf_counter() - started)
        return hit

    def resident_run(self, keys: ChunkKeys) -> np.ndarray:
        """The leading run of ``keys`` some level holds: per block, the code of the first level that
        holds it (``PrefixHit.where``); its length is the run."""
        levels = self._open_levels()
        where = np.full(len(keys), -1, dtype=np.int8)
        if len(keys):
            where[levels[0].contains(keys)] = levels[0].code
        for level in levels[1:]:
            # The run ends at the first block in no level: ask each next level for the leading run of
            # the blocks the levels above miss (match stops at its first miss; no lookups past it).
            missing = np.flatnonzero(where < 0)
            if not len(missing):
                break
            n = level.match(keys.take(missing))
            where[missing[:n]] = level.code
            if n < len(missing):
                level.count(misses=1)
        run = int(np.argmin(where >= 0)) if (where < 0).any() else len(where)
        return where[:run].copy()

    def count_served(self, prompt_tokens: int, served: Mapping[int, int], *, prefill_tokens: int) -> None:
        """Count one prompt's lookup: its length, the tokens each level served (by level code, as in
        ``PrefixHit.where``), and the tokens the model computes.

        ``lookup`` calls it; an engine that asks ``lookup(count=False)`` more than once per prompt, or
        whose own prefix cache supplies part of the prompt, calls it once with what the levels
        actually served (the prefix hit rate is their sum over ``prompt_tokens``).
        """
        deltas = {level.names.hit_tokens: int(served.get(level.code, 0)) for level in self._levels
                  if level.names.hit_tokens}
        self._counting.add(lookups=1, prompt_tokens=prompt_tokens, hit_tokens=sum(int(n) for n in served.values()),
                           prefill_tokens=prefill_tokens, **deltas)

    # ---- load -----------------------------------------------------------------------------------
    def load(self, hit: PrefixHit, out: Any) -> int:
        """Copy the hit's blocks into ``out[:, :, :, :n, :]``; return ``n``, the tokens loaded.

        ``out``: numpy array or torch tensor shaped ``(layers, 2, kv_heads, >= hit.tokens, head_dim)``
        in the spec's dtype (bfloat16: a torch bfloat16 tensor, or numpy uint16). A CUDA tensor is
        filled by DMA straight out of the hot segment (registered with CUDA on first use) and
        re-laid out on the GPU (``tieredkv/cuda.py``). Blocks evicted since ``lookup`` truncate the
        result.
        """
        if not isinstance(hit, PrefixHit):
            raise InvalidInput("load() takes the PrefixHit returned by lookup()")
        return self._counted_load(hit, lambda: self._loader.load(hit, out, self._open_levels(), self._by_code))

    def load_runs(self, hit: PrefixHit, sink: Callable[[int, np.ndarray], None]) -> int | None:
        """``load`` for a caller that copies the blocks where they go itself (the vLLM connector, into
        its paged cache): ``sink(first_token, rows)`` gets each run of the hit's blocks as the top
        level's own memory, ``(k, block_bytes)`` uint8 rows holding tokens ``first_token ..
        first_token + k * chunk_tokens`` (the hot tier's slots, pinned), valid only during the call.
        Counted as ``load``. Returns the tokens handed over, the leading ones (blocks evicted since
        ``lookup`` end the run; whatever ``sink`` put from a run not counted in the result must not be
        used), or None, with nothing done, when some of the hit's blocks are in a lower level: ``load``
        them."""
        if not isinstance(hit, PrefixHit):
            raise InvalidInput("load_runs() takes the PrefixHit returned by lookup()")
        top = self._open_levels()[0]
        if hit.blocks_in(top.code) != hit.blocks:
            return None
        C = self.spec.chunk_tokens
        return self._counted_load(hit, lambda: top.read_shared(hit.keys, lambda i, rows: sink(i * C, rows)))

    def _counted_load(self, hit: PrefixHit, read: Callable[[], int]) -> int:
        """``read()`` the hit's blocks (it returns how many), counted: loaded tokens, lost blocks (all of
        them when ``read`` raises), the time; returns the tokens loaded."""
        if hit.blocks == 0:
            return 0
        started = time.perf_counter()
        loaded = 0
        try:
            loaded = read()
        finally:
            self._counting.add(loaded_tokens=loaded * self.spec.chunk_tokens, lost_blocks=hit.blocks - loaded)
            self._counting.observe("load", time.perf_counter() - started)
        return loaded * self.spec.chunk_tokens

    # ---- store ----------------------------------------------------------------------------------
    def store(self, tokens: Any, kv: Any, salt: bytes = b"", *, from_token: int = 0,
              extra: Sequence[bytes | None] | None = None) -> int:
        """Cache the full chunks among the first ``n_tokens`` tokens, ``n_tokens = kv.shape[3]``.

        Blocks the top level holds (or another process is writing) are skipped; blocks held only by a
        lower level are stored again on top, and a lower level that already holds one keeps its own
        copy (each tier keeps the first bytes stored under a key). The same tokens give the same KV
        under one model, so the copies agree; a producer whose KV varies from run to run (batch-variant
        kernels) may leave slightly different, equally valid bytes in two tiers.
        ``from_token`` (a multiple of ``chunk_tokens``): chunks before it are not stored and ``kv``'s
        positions before it are never read (the caller just restored them, e.g. into a GPU cache).
        ``extra``: per-chunk bytes folded into the keys, as given to ``lookup``.
        Returns the number of blocks newly stored in the hot tier.
        """
        ids = as_tokens(tokens)
        src = tensors.host_source(self.spec, kv)
        n_tokens = src.shape[3]
        if n_tokens > len(ids):
            raise InvalidInput(f"kv holds {n_tokens} tokens but only {len(ids)} token ids were given")
        C = self.spec.chunk_tokens
        if isinstance(from_token, bool) or not isinstance(from_token, (int, np.integer)) or from_token < 0 \
                or from_token % C:
            raise InvalidInput(f"from_token must be a non-negative multiple of chunk_tokens={C}, got {from_token!r}")
        keys = chunk_keys(self.spec, ids[: (n_tokens // C) * C], salt, extra)
        levels = self._open_levels()
        todo = self._storer.new_blocks(levels, keys, min(int(from_token) // C, len(keys)))
        if not len(todo):
            return 0
        codes = self._storer.store_model(levels, keys, todo, src)
        return int(np.count_nonzero(codes == PutResult.STORED))

    # ---- blocks: callers that hold block rows, not model-layout arrays (vLLM's offloading tier) ----
    def put_blocks(self, keys: ChunkKeys, payloads: np.ndarray, *, owned: bool = False) -> np.ndarray:
        """Store blocks given as rows, through the same levels, writers and counters as ``store``.

        Args:
            keys: the blocks' keys (``ChunkKeys`` of this spec).
            payloads: one block per key: ``(n, block_bytes)`` uint8 or the spec's dtype.
            owned: accepted for callers of earlier versions; no longer matters: ``payloads`` is
                read only during the call (queued writes copy the blocks out of the top level).

        Returns:
            One ``PutResult`` per key: ``STORED`` (new in the top level), ``EXISTS`` (a level that
            ``store`` checks holds it already) or ``NO_SPACE`` (the top level had no room; a level
            below it that admits evicted blocks got it).

        Raises:
            InvalidInput, InvalidPayload: keys of another spec, payloads of another size or dtype.
        """
        keys = check_keys(self.spec, keys)
        rows = as_block_bytes(self.spec, payloads, len(keys))
        codes = np.full(len(keys), PutResult.EXISTS, dtype=np.int8)
        levels = self._open_levels()
        todo = self._storer.new_blocks(levels, keys, 0)
        if not len(todo):
            return codes
        # Read only during the call (queued writes copy from the top level): no copy of our own.
        new = keys.take(todo)
        mine = rows if len(todo) == len(keys) else rows[todo]

        def gather(idx: np.ndarray, out: np.ndarray) -> None:
            out[:] = mine[idx]

        codes[todo] = self._storer.put(levels, new, mine, gather)
        return codes

    def locate(self, keys: ChunkKeys) -> np.ndarray:
        """Where each block is: the code of the first level holding it (see ``PrefixHit.where``), or
        -1. Unlike ``lookup`` the blocks need not be a prefix run: every level is asked for the
        blocks the levels above miss. Counted like a lookup of ``len(keys)`` chunks.
        """
        started = time.perf_counter()
        keys = check_keys(self.spec, keys)
        where = np.full(len(keys), -1, dtype=np.int8)
        levels = self._open_levels()
        for level in levels:
            missing = np.flatnonzero(where < 0)
            if not len(missing):
                break
            where[missing[level.contains(keys.take(missing))]] = level.code
        C = self.spec.chunk_tokens
        found = int(np.count_nonzero(where >= 0))
        deltas = {lv.names.hit_tokens: int(np.count_nonzero(where == lv.code)) * C for lv in levels
                  if lv.names.hit_tokens}
        self._counting.add(lookups=1, prompt_tokens=len(keys) * C, hit_tokens=found * C,
                           prefill_tokens=(len(keys) - found) * C, **deltas)
        self._counting.observe("lookup", time.perf_counter() - started)
        return where

    def get_blocks(self, keys: ChunkKeys, out: np.ndarray) -> np.ndarray:
        """Read blocks wherever they are into ``out`` (row ``i`` for key ``i``): each level, top first,
        reads the blocks the levels above miss, in runs of adjacent keys. Blocks read from a lower
        level are promoted like ``load``'s. Returns a bool per key: read (and verified).

        Raises:
            InvalidInput, InvalidPayload: keys of another spec; ``out`` too small, read-only or of
                another dtype (see ``Tier.get_many``).
        """
        started = time.perf_counter()
        keys = check_keys(self.spec, keys)
        rows = out_rows(self.spec, out, len(keys))
        got = np.zeros(len(keys), dtype=bool)
        levels = self._open_levels()
        promote: list[tuple[Level, np.ndarray]] = []
        for level in levels:
            missing = np.flatnonzero(~got)
            if not len(missing):
                break
            present = missing[level.contains(keys if len(missing) == len(keys) else keys.take(missing))]
            read = []
            edges = (np.flatnonzero(np.diff(present) != 1) + 1).tolist()
            for i, j in zip([0, *edges], [*edges, len(present)]) if len(present) else ():
                a, b = int(present[i]), int(present[j - 1]) + 1  # one run of adjacent keys
                n = level.read(keys[a:b], rows[a:b], None)
                got[a:a + n] = True
                read.append(present[i:i + n])
            if read and level is not levels[0]:
                promote.append((level, np.concatenate(read)))
        for level, idx in promote:
            if len(idx):
                self._loader.promote(levels, level, keys.take(idx), rows[idx])
        n = int(np.count_nonzero(got))
        self._counting.add(loaded_tokens=n * self.spec.chunk_tokens, lost_blocks=len(keys) - n)
        self._counting.observe("load", time.perf_counter() - started)
        return got

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every level's queued writes are done (each at most ``timeout_s``, default its
        own ``*_flush_s``). Returns whether no queue holds anything (always True without writers)."""
        return all([level.flush(timeout_s) for level in self._levels])

    def flush_remote(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued remote writes are done (at most ``timeout_s``); True when none is left."""
        level = self.level("remote")
        return level.flush(timeout_s) if level is not None else True

    # ---- introspection ------------------------------------------------------------------------------
    def _open_levels(self) -> list[Level]:
        if self._closed:
            raise InvalidInput("this TieredCache is closed")
        return self._levels

    def stats(self) -> dict:
        """Per-host counters of every process using this cache (they live in the hot segment), the
        prefix hit rate (hit tokens / prompt tokens), each level's ``TierStats`` under its name (None
        for a standard level that is not there; with a background writer, its ``queue``), and
        ``warm_queue_blocks``: blocks this process has queued for the warm tier and not written yet
        (``warm_queued_blocks`` / ``warm_dropped_blocks`` are the per-host totals)."""
        levels = self._open_levels()
        doc = self._counting.row().totals()
        doc["prefix_hit_rate"] = counters.prefix_hit_rate(doc)
        doc.update(hot=None, warm=None, warm_queue_blocks=0, remote=None)
        for level in levels:
            doc[level.name] = level.stats()
        warm = self.level("warm")
        doc["warm_queue_blocks"] = warm.writer.pending_blocks if warm is not None and warm.writer is not None else 0
        return doc

    def unlink_hot(self) -> None:
        """Remove the hot segment's name (as a node restart would) and close this cache.

        Processes that still map the segment keep using it until they close; the next TieredCache
        creates a fresh, empty segment. The warm tier is untouched.
        """
        if not self._closed and hasattr(self._levels[0].tier, "unlink"):
            self._levels[0].tier.unlink()
        self.close()

    def close(self) -> None:
        """Close every level (idempotent). Shared state stays for other processes and restarts.

        Queued writes are flushed first, top level first (a block the warm writer evicts may still
        reach the remote queue): each level's for at most its ``*_flush_s``; what is left then is
        dropped and counted."""
        levels = getattr(self, "_levels", [])
        self._closed = True
        for level in levels:
            level.close_writer()
        placement = getattr(self, "_placement", None)
        if placement is not None:
            placement.close()  # before the segment it registered is unmapped
        for level in levels:
            close_level(level)
        journal, self.journal = getattr(self, "journal", None), None
        if journal is not None:
            journal.close()
        loader = getattr(self, "_loader", None)
        if loader is not None:
            loader.release()
        storer = getattr(self, "_storer", None)
        if storer is not None:
            storer.release()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        inner = ", ".join(f"{level.name}={level.tier!r}" for level in getattr(self, "_levels", []))
        return f"TieredCache({self.spec.namespace}, {inner})"




def _flush_at_exit(ref: weakref.ref[TieredCache]) -> None:
    cache = ref()
    if cache is not None and not cache._closed:
        cache.flush()
