"""TieredCache: the object users hold. Lookup across tiers, load, store, promotion and demotion.

```
lookup(tokens) --keys--> hot.contains_many --(misses)--> warm.contains_many --> PrefixHit
load(hit, out)  : hot blocks copied straight from shared memory into ``out`` (one copy, pinned);
                  warm blocks read into a kept staging buffer, copied into ``out``, promoted from there
store(tokens,kv): new full chunks -> hot (evictions demoted to warm)
                  [+ warm: write-behind (default, background thread) or write-through (before returning)]
remote (optional): lookup asks it for the run after the local hit (one call, with a deadline); load
                  promotes its blocks into hot; store queues blocks for it on a background writer
```

A block may be hot while its parent is warm: the hit is the longest run of leading blocks each found
in *some* tier. Nothing here holds a lock across calls; a block lost between ``lookup`` and ``load``
truncates the load, it never corrupts it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv import counters, forksafe, policies
from tieredkv.background import BackgroundWriter
from tieredkv.errors import (
    CapacityError,
    CorruptState,
    FormatError,
    InvalidInput,
    InvalidPayload,
    LockTimeout,
    PermissionDenied,
    TieredKVError,
    WarmTierUnavailable,
    require_positive_int,
    require_positive_seconds,
)
from tieredkv.hot import HotTier
from tieredkv.keys import ChunkKeys, as_tokens, chunk_keys
from tieredkv.layout import blocks_to_model, model_to_blocks, overlaps_itself, page_aligned_empty
from tieredkv.policies import demotion as demotion_rules
from tieredkv.policies import promotion as promotion_rules
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier

HOT, WARM, REMOTE = 0, 1, 2
#: ``place(rows, at_token, from_hot)``: copy ``(k, block_bytes)`` uint8 rows of blocks into the load's
#: destination at ``at_token``, in the model layout; ``from_hot``: the rows are hot-tier shared memory.
Placer = Callable[[np.ndarray, int, bool], None]
#: Payload buffers a write-behind cache keeps for reuse (one for the store in flight, one spare).
_SPARE_BUFFERS = 2

#: Failures of the warm tier's state (damaged or unreachable files, a stuck writer, a disk too full to
#: create it) after which a TieredCache starts hot-only instead of not at all.
_WARM_STATE_ERRORS = (CorruptState, FormatError, WarmTierUnavailable, LockTimeout, CapacityError, OSError)


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The result of ``lookup``: how much of a prompt's prefix the tiers hold, and where.

    Attributes:
        tokens: cached prefix length in tokens (a multiple of ``chunk_tokens``, always < the prompt).
        prompt_tokens: the prompt's length.
        keys: the keys of the hit blocks.
        where: per hit block, ``HOT`` (0), ``WARM`` (1) or ``REMOTE`` (2).
    """

    tokens: int
    prompt_tokens: int
    keys: ChunkKeys
    where: np.ndarray

    @property
    def blocks(self) -> int:
        return len(self.keys)

    @property
    def hot_blocks(self) -> int:
        return int(np.count_nonzero(self.where == HOT))

    @property
    def warm_blocks(self) -> int:
        return int(np.count_nonzero(self.where == WARM))

    @property
    def remote_blocks(self) -> int:
        return int(np.count_nonzero(self.where == REMOTE))

    @property
    def prefill_tokens(self) -> int:
        """Tokens the model still has to compute."""
        return self.prompt_tokens - self.tokens


class TieredCache:
    """A hot (shared memory) tier in front of an optional warm (SSD) tier, for one KV spec.

    Restart-safe by default: with a ``warm_dir``, every block ``store`` puts in the hot tier is also
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
        hot_bytes: size of the shared-memory segment to create, metadata included (attaching processes
            may pass the same, or nothing).
        hot_blocks: create the segment with exactly this many block slots instead of ``hot_bytes``.
        warm_dir: directory of the warm tier; ``None``: hot tier only.
        warm_bytes: warm tier capacity (required with ``warm_dir``).
        eviction: eviction policy name for both tiers (see ``tieredkv.policies.names()``).
        promotion: ``"always"``, ``"on_nth_hit:N"`` or ``"never"`` (warm -> hot on load).
        demotion: when a block reaches warm: ``"write_behind"`` (default: at store, on a background
            thread), ``"write_through"`` (at store, before returning), ``"on_evict"`` or
            ``"on_nth_hit:N"`` (when the hot tier evicts it).
        hot_name: segment name (default derived from the spec).
        warm_sync: the warm tier's durability, ``"none" | "data" | "full"``.
        warm_verify: checksum verification on warm reads, ``"always" | "sampled" | "never"``. Only
            ``"always"`` (the default) protects against media corruption: the others serve blocks
            damaged on disk unless sampled (docs/warm-tier.md).
        numa_node: one hot segment per NUMA node (see docs/tuning.md).
        lock_timeout_s: longest wait for a lock held by another live process (the hot tier's metadata
            lock, the warm tier's writer lock) before ``LockTimeout``.
        warm_queue_bytes: with write-behind, the most block bytes queued for the warm tier (the
            queue holds copies); at least one block is always allowed.
        warm_flush_s: with write-behind, how long ``close()`` waits for the queued warm writes.
        remote: a store shared by the fleet: a URL (``"valkey://host:port"``, ``"mooncake://host:port"``,
            options in the query string, see ``RemoteTier``) or a ``RemoteTier``. The cache closes it.
        remote_write: which blocks go to the remote tier: ``"write_through"`` (every stored block),
            ``"on_evict"`` (blocks leaving the host: evicted from warm, or from hot without a warm
            tier) or ``"on_nth_hit:N"`` (those of them hit at least N times); see docs/fleet.md.
        remote_queue_blocks: bound on blocks waiting to be written to the remote tier; beyond it writes
            are dropped and counted (``remote_drops``).
        remote_flush_s: how long ``close()`` waits for queued remote writes.

    Raises:
        InvalidInput: a bad argument (the message says which and how to fix it).
        TieredKVError: a tier could not be opened (see ``HotTier`` and ``WarmTier``). A warm tier
            whose files are damaged, unreachable or locked by a stopped writer, or that a full disk
            cannot hold, does not raise: the cache starts hot-only with a ``RuntimeWarning`` (and
            ``warm_errors`` counted). Another user's warm files raise ``PermissionDenied``.
    """

    def __init__(self, spec: KVSpec, hot_bytes: int | None = None, warm_dir=None, warm_bytes: int | None = None,
                 eviction: str = "lru", promotion: str = "always", demotion: str = "write_behind", *,
                 hot_blocks: int | None = None, hot_name: str | None = None, warm_sync: str = "none",
                 warm_verify: str = "always",
                 numa_node: int | None = None, lock_timeout_s: float = 10.0, warm_queue_bytes: int = 256 << 20,
                 warm_flush_s: float = 10.0, remote=None, remote_write: str = "write_through",
                 remote_queue_blocks: int = 256, remote_flush_s: float = 5.0):
        if not isinstance(spec, KVSpec):
            raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
        self.spec = spec
        # Checked here, under the names the caller used, before any tier is made.
        if hot_bytes is not None:
            hot_bytes = require_positive_int("hot_bytes", hot_bytes, "256 << 20")
        if hot_blocks is not None:
            hot_blocks = require_positive_int("hot_blocks", hot_blocks, "4096")
        lock_timeout_s = require_positive_seconds("lock_timeout_s", lock_timeout_s)
        try:
            policies.make(eviction)
            self.promotion = promotion_rules.make(promotion)
            self.demotion = demotion_rules.make(demotion)
            self.remote_write = demotion_rules.make(remote_write)
        except (KeyError, ValueError, TypeError) as e:
            raise InvalidInput(str(e.args[0]) if e.args else str(e)) from None
        if warm_dir is not None and (isinstance(warm_dir, bytes) or not isinstance(warm_dir, (str, os.PathLike))
                                     or not os.fspath(warm_dir)):
            # "" would silently put the warm tier in whatever directory the worker started in.
            raise InvalidInput(f"warm_dir must be a non-empty path (str or os.PathLike) or None, got {warm_dir!r}")
        if warm_dir is not None and not warm_bytes:
            raise InvalidInput("warm_bytes is required with warm_dir (e.g. warm_bytes=64 << 30)")
        if isinstance(warm_queue_bytes, bool) or not isinstance(warm_queue_bytes, int) or warm_queue_bytes < 0:
            raise InvalidInput(f"warm_queue_bytes must be an int >= 0 (bytes), got {warm_queue_bytes!r}")
        if isinstance(warm_flush_s, bool) or not isinstance(warm_flush_s, (int, float)) or not warm_flush_s >= 0:
            raise InvalidInput(f"warm_flush_s must be a number of seconds >= 0, got {warm_flush_s!r}")
        self._flush_s = float(warm_flush_s)
        self._writer: BackgroundWriter | None = None
        self._spare: list[np.ndarray] = []       # write-behind payload buffers, back from their jobs
        self._spare_lock = threading.Lock()
        self._lock = threading.Lock()
        self._staging_lock = threading.Lock()
        self._warm_lock = threading.Lock()
        forksafe.register(self)  # these locks, unlocked in a forked child (held by a writer at fork)
        self._staging: np.ndarray | None = None
        self._host_registry: Any = None   # tieredkv.cuda.HostRegistry, on the first load into CUDA
        self._device_stage: Any = None    # kept device staging buffer of those loads
        self._warned = False
        self._warm_hits: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._private_counters = counters.private()
        self.warm: Tier | None = None
        self.hot: Tier  # set below; close() copes with a constructor that failed before it
        self.remote: Tier | None = None
        self._remote_writer: BackgroundWriter | None = None
        warm_failed = False
        try:
            if remote is not None:
                self._open_remote(remote, remote_queue_blocks, remote_flush_s)
            if warm_dir is not None:
                from tieredkv.warm import WarmTier

                try:
                    self.warm = WarmTier(spec, warm_dir, warm_bytes, sync=warm_sync, verify=warm_verify,
                                         policy=eviction, lock_timeout_s=lock_timeout_s,
                                         on_evict=self._remote_demote if self._remote_on_evict else None)
                except _WARM_STATE_ERRORS as e:
                    if isinstance(e, PermissionDenied):
                        raise  # another user's files: an operator decision, never silently worked around
                    # The warm tier's files are damaged or unusable right now. That must not keep the
                    # worker (and with it the hot tier every worker shares) from starting: serve hot-only
                    # and say so. Misuse (bad arguments, another spec, another user's files) still raises.
                    warnings.warn(f"tieredkv: the warm tier at {warm_dir} cannot open ({e}); running "
                                  f"hot-only until restart (`tieredkv verify --repair` checks and "
                                  f"rebuilds it)", RuntimeWarning, stacklevel=2)
                    warm_failed = True
            self.hot = HotTier(spec, hot_bytes, n_slots=hot_blocks, name=hot_name, policy=eviction, numa_node=numa_node,
                               lock_timeout_s=lock_timeout_s,
                               # Rules that write to warm at store time have every block there already:
                               # no hook for them, so the hot tier does not copy out what it evicts. Without
                               # a warm tier, blocks leaving hot leave the host (the remote on_evict rules).
                               on_evict=self._demote if ((self.warm is not None and not self.demotion.at_store)
                                                         or (self.warm is None and self._remote_on_evict))
                               else None)
            if warm_failed:
                self._count(warm_errors=1)
        except BaseException:
            self.close()
            raise
        if self.warm is not None and self.demotion.at_store and self.demotion.background:
            self._writer = BackgroundWriter(f"tieredkv-warm-writer-{self.hot.name}",
                                            max_blocks=max(warm_queue_bytes // spec.block_bytes, 1),
                                            on_error=self._write_behind_failed)
            # A process that exits normally without close() still gets its queue written.
            atexit.register(_flush_at_exit, weakref.ref(self))

    # ---- lookup ---------------------------------------------------------------------------------
    def lookup(self, tokens: Any, salt: bytes = b"") -> PrefixHit:
        """Find the longest cached prefix of ``tokens`` (1-D ints) under ``salt``.

        A hit never covers the whole prompt: the model needs at least one token to compute logits.
        """
        started = time.perf_counter()
        ids = as_tokens(tokens)
        usable = max(len(ids) - 1, 0) // self.spec.chunk_tokens
        keys = chunk_keys(self.spec, ids[: usable * self.spec.chunk_tokens], salt)
        where = np.full(len(keys), -1, dtype=np.int8)
        if len(keys):
            where[self.hot.contains_many(keys)] = HOT
            missing = np.flatnonzero(where < 0)
            if len(missing) and self.warm is not None:
                # The run ends at the first block in neither tier: ask warm for the leading run of
                # hot misses only (match stops at its first miss; no lookups past it).
                warm = self.warm
                n = self._warm_call(lambda: warm.match(keys.take(missing)), default=0)
                where[missing[:n]] = WARM
        run = int(np.argmin(where >= 0)) if (where < 0).any() else len(where)
        if self.remote is not None and run < len(where):
            run = self._remote_lookup(keys, where, run)
        hit = PrefixHit(tokens=run * self.spec.chunk_tokens, prompt_tokens=len(ids), keys=keys[:run],
                        where=where[:run].copy())
        C = self.spec.chunk_tokens
        self._count(lookups=1, prompt_tokens=len(ids), hit_tokens=hit.tokens, hot_hit_tokens=hit.hot_blocks * C,
                    warm_hit_tokens=hit.warm_blocks * C, remote_hit_tokens=hit.remote_blocks * C,
                    prefill_tokens=hit.prefill_tokens)
        self._observe("lookup", time.perf_counter() - started)
        return hit

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
        if hit.blocks == 0:
            return 0
        started = time.perf_counter()
        on_device = _torch_or_none(out) is not None and out.device.type != "cpu"
        with self._staging_lock if on_device else contextlib.nullcontext():  # one device staging buffer
            loaded = self._load(hit, out)
        self._observe("load", time.perf_counter() - started)
        return loaded

    def _load(self, hit: PrefixHit, out: Any) -> int:
        place, finish = self._placer(out, hit.tokens)
        C = self.spec.chunk_tokens
        loaded = 0  # leading blocks in place
        promote: list[tuple[ChunkKeys, np.ndarray, int]] = []
        n_warm = hit.warm_blocks
        with self._warm_lock if n_warm else contextlib.nullcontext():  # one kept staging buffer
            staging = self._warm_staging(n_warm)  # (0, block_bytes) when no block is warm
            staged = 0  # warm runs take consecutive staging rows: promotion reads them after the loop
            edges = np.flatnonzero(np.diff(hit.where)) + 1
            for i, j in zip([0, *edges.tolist()], [*edges.tolist(), hit.blocks]):
                run = hit.keys[i:j]
                tier = hit.where[i]
                if tier == HOT:
                    got = self._load_hot(run, place, i)
                elif tier == WARM:
                    got = self._load_warm(run, place, i, staging[staged:staged + j - i], promote)
                    staged += j - i
                else:
                    got = self._load_remote(run, place, i, promote)
                loaded += got
                if got < j - i:
                    break
            finish(loaded * C)
            # Promote only now: promoting mid-load could evict this very hit's hot blocks before they
            # were read (a full hot tier), cutting the restore short.
            for keys, payloads, src in promote:
                if src == WARM:
                    self._promote(keys, payloads)
                else:
                    self._promote_remote(keys, payloads)
        self._count(loaded_tokens=loaded * C, lost_blocks=hit.blocks - loaded)
        return loaded * C

    def _load_hot(self, keys: ChunkKeys, place: Placer, first: int) -> int:
        C = self.spec.chunk_tokens

        def sink(i: int, rows: np.ndarray) -> None:  # one copy per run of adjacent slots
            place(rows, (first + i) * C, True)

        got = self.hot.read_runs(keys, sink)
        self._count(hot_bytes_read=got * self.spec.block_bytes)
        return got

    def _load_warm(self, keys: ChunkKeys, place: Placer, first: int, staging: np.ndarray,
                   promote: list[tuple[ChunkKeys, np.ndarray, int]]) -> int:
        """Read warm blocks into ``staging`` rows (checksummed there); each group read is copied into
        place while the next one is read. The staged bytes are kept for promotion."""
        C = self.spec.chunk_tokens

        def sink(i: int, rows: np.ndarray) -> None:  # runs while the warm tier reads the next group
            place(rows, (first + i) * C, False)

        warm = self._warm_tier()
        corrupt_before = warm.corrupt_seen
        got = self._warm_call(lambda: warm.get_many(keys, staging, sink), default=0)
        self._count(corrupt_blocks=warm.corrupt_seen - corrupt_before)
        if got:
            promote.append((keys[:got], staging[:got], WARM))
        self._count(warm_bytes_read=got * self.spec.block_bytes)
        return got

    def _warm_staging(self, n_blocks: int) -> np.ndarray:
        """``(n_blocks, block_bytes)`` rows of the kept staging buffer (call under ``_warm_lock``).

        Kept and reused, never allocated per call: a fresh buffer costs a page fault per 4 KiB on
        every load. Page-aligned: the kernel's copy into a buffer 16 bytes off (where malloc puts
        large ones) runs at half speed on some CPUs (docs/benchmarks.md). It grows to the largest warm
        part of a hit and is released at ``close``.
        """
        need = n_blocks * self.spec.block_bytes
        if not need:
            return np.empty((0, self.spec.block_bytes), dtype=np.uint8)
        buf = self._staging
        if buf is None or buf.size < need:
            self._staging = None  # drop the old one before allocating the larger one
            buf = self._staging = page_aligned_empty(need)
        return buf[:need].reshape(n_blocks, self.spec.block_bytes)

    def _promotion_chosen(self, keys: ChunkKeys) -> np.ndarray:
        """Count a hit below hot for each key; return the rows the promotion rule promotes."""
        with self._lock:
            counts = np.empty(len(keys), dtype=np.int64)
            for i, k in enumerate(keys):
                n = self._warm_hits.pop(k, 0) + 1
                self._warm_hits[k] = n
                counts[i] = n
            while len(self._warm_hits) > 65536:  # a bounded, per-process memory of warm hits
                self._warm_hits.popitem(last=False)
        return np.flatnonzero(self.promotion.should_promote(counts))

    def _promote(self, keys: ChunkKeys, payloads: np.ndarray) -> None:
        """Promote warm blocks just read, per the promotion rule, from the bytes in hand."""
        chosen = self._promotion_chosen(keys)
        if len(chosen):
            codes = self.hot.put_many(keys.take(chosen), payloads[chosen])
            self._count(promotions=int(np.count_nonzero(codes == PutResult.STORED)))

    # ---- store ----------------------------------------------------------------------------------
    def store(self, tokens: Any, kv: Any, salt: bytes = b"", *, from_token: int = 0) -> int:
        """Cache the full chunks among the first ``n_tokens`` tokens, ``n_tokens = kv.shape[3]``.

        Blocks already present in a tier (or being written by another process) are skipped.
        ``from_token`` (a multiple of ``chunk_tokens``): chunks before it are not stored and ``kv``'s
        positions before it are never read (the caller just restored them, e.g. into a GPU cache).
        Returns the number of blocks newly stored in the hot tier.
        """
        ids = as_tokens(tokens)
        src = self._host_source(kv)
        n_tokens = src.shape[3]
        if n_tokens > len(ids):
            raise InvalidInput(f"kv holds {n_tokens} tokens but only {len(ids)} token ids were given")
        C = self.spec.chunk_tokens
        if isinstance(from_token, bool) or not isinstance(from_token, (int, np.integer)) or from_token < 0 \
                or from_token % C:
            raise InvalidInput(f"from_token must be a non-negative multiple of chunk_tokens={C}, got {from_token!r}")
        keys = chunk_keys(self.spec, ids[: (n_tokens // C) * C], salt)
        if not len(keys):
            return 0
        skip = min(int(from_token) // C, len(keys))
        todo = skip + np.flatnonzero(~self.hot.contains_many(keys[skip:]))
        warm = self.warm
        if len(todo) and warm is not None and not self.demotion.at_store:
            in_warm = self._warm_call(lambda: warm.contains_many(keys.take(todo)),
                                      default=np.zeros(len(todo), dtype=bool))
            todo = todo[~in_warm]
        if not len(todo):
            return 0
        new = keys.take(todo)
        payloads = self._payload_rows(len(todo))
        # One gather per run of consecutive new chunks (all of them, for a fresh prompt).
        edges = np.flatnonzero(np.diff(todo) != 1) + 1
        for a, b in zip([0, *edges.tolist()], [*edges.tolist(), len(todo)]):
            model_to_blocks(self.spec, src, int(todo[a]) * C, payloads[a:b])
        codes = self.hot.put_many(new, payloads)
        stored = int(np.count_nonzero(codes == PutResult.STORED))
        to_warm = None
        if self.warm is not None:
            if self.demotion.at_store:
                to_warm = np.arange(len(new))
            elif (codes == PutResult.NO_SPACE).any():
                # Did not fit in the hot tier at all (a store larger than it): straight to warm.
                to_warm = np.flatnonzero(codes == PutResult.NO_SPACE)
        if to_warm is not None:
            wkeys, wpayloads = (new, payloads) if len(to_warm) == len(new) else (new.take(to_warm), payloads[to_warm])
            if self._writer is not None and self.demotion.at_store:
                # ``payloads`` is this call's own copy (never the caller's kv, which it may reuse):
                # the queued job keeps it until the write is done, then hands it back for reuse,
                # unless the remote writer holds it too (it may still be reading it then).
                shared = self.remote is not None and self.remote_write.at_store
                self._write_behind(wkeys, wpayloads, None if shared else payloads)
            else:
                self._write_warm(wkeys, wpayloads)
        if self.remote is not None and self.remote_write.at_store:
            self._remote_send(new, payloads)
        self._count(stored_blocks=stored, hot_bytes_written=stored * self.spec.block_bytes)
        return stored

    def _payload_rows(self, n: int) -> np.ndarray:
        """``n`` rows of block payloads for ``store`` to copy into.

        With write-behind a buffer travels with its job and comes back when the warm write is done;
        handing it to the next ``store`` spares that request the page faults of fresh memory (with
        the buffer kept by the job, the allocator cannot reuse its pages: a fresh allocation per store
        made it several times slower, benchmarks/store_latency.py). At most ``_SPARE_BUFFERS`` are
        kept per process.
        """
        if self._writer is not None:
            with self._spare_lock:
                fits = [i for i, buf in enumerate(self._spare) if len(buf) >= n]
                if fits:
                    best = min(fits, key=lambda i: len(self._spare[i]))
                    return self._spare.pop(best)[:n]
        return np.empty((n, *self.spec.block_shape), dtype=self.spec.numpy_dtype)

    def _give_back(self, rows: np.ndarray) -> None:
        """Keep the buffer behind ``rows`` for a later ``store`` (see ``_payload_rows``)."""
        base = rows if rows.base is None else rows.base
        if not isinstance(base, np.ndarray) or base.dtype != self.spec.numpy_dtype:
            return
        with self._spare_lock:
            if len(self._spare) < _SPARE_BUFFERS:
                self._spare.append(base)

    def _write_warm(self, keys: ChunkKeys, payloads: np.ndarray) -> None:
        codes = self._warm_call(lambda: self._warm_tier().put_many(keys, payloads), default=None)
        if codes is not None:
            n = int(np.count_nonzero(codes == PutResult.STORED))
            self._count(warm_bytes_written=n * self.spec.block_bytes)

    def _write_behind(self, keys: ChunkKeys, payloads: np.ndarray, buffer: np.ndarray | None) -> None:
        """Queue the warm write of ``keys`` in jobs of at most the queue's bound (a store larger than
        the whole queue is written in part rather than not at all). ``buffer`` holds ``payloads`` and
        is handed back for reuse once nothing refers to it (``None``: someone else may still use it;
        a store split into several jobs: never)."""
        writer = self._writer
        if writer is None:
            raise InvalidInput("this TieredCache does not write behind (demotion is not 'write_behind')")
        step = writer.max_blocks
        whole = buffer is not None and len(keys) <= step
        # The job's closure must not refer to a buffer it does not hand back: it would keep it alive.
        reuse = buffer if whole else None

        def job(k: ChunkKeys, p: np.ndarray) -> None:
            try:
                self._write_warm(k, p)
            finally:
                if reuse is not None:
                    self._give_back(reuse)

        for i in range(0, len(keys), step):
            k, p = keys[i:i + step], payloads[i:i + step]
            if not whole and p.base is not None:
                # A job keeps what it refers to: a view would keep the whole store's buffer alive while
                # the queue counts only its rows (warm_queue_bytes must bound memory really kept).
                p = p.copy()
            if writer.submit(functools.partial(job, k, p), blocks=len(k)):
                self._count(warm_queued_blocks=len(k))
            else:
                self._count(warm_dropped_blocks=len(k))
                if reuse is not None:
                    self._give_back(reuse)

    def _write_behind_failed(self, error: BaseException) -> None:
        # _write_warm already turns tier errors into counted misses; anything else is a bug that must
        # not kill the writer thread silently.
        self._count(warm_errors=1)
        warnings.warn(f"tieredkv: a background warm write failed: {error!r}", RuntimeWarning, stacklevel=2)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the queued warm writes are done (at most ``timeout_s``, default ``warm_flush_s``).

        Returns whether the queue is empty (always True without write-behind).
        """
        if self._writer is None:
            return True
        return self._writer.flush(self._flush_s if timeout_s is None else timeout_s)

    def _demote(self, evicted: Evicted) -> None:
        """The hot tier's on_evict hook: write evicted blocks to warm per the demotion rule."""
        if evicted.payloads is None or not len(evicted.keys):
            return
        if self.warm is None:
            if self._remote_on_evict:  # no warm tier: blocks leaving hot leave the host
                self._remote_demote(evicted)
            return
        chosen = np.flatnonzero(self.demotion.should_demote(evicted.hits))
        if not len(chosen):
            return
        payloads = evicted.payloads
        codes = self._warm_call(lambda: self._warm_tier().put_many(evicted.keys.take(chosen), payloads[chosen]),
                                default=None)
        if codes is not None:
            n = int(np.count_nonzero(codes == PutResult.STORED))
            self._count(demotions=n, warm_bytes_written=n * self.spec.block_bytes)

    def _warm_tier(self) -> Tier:
        """The warm tier, on paths that run only when there is one."""
        if self.warm is None:
            raise InvalidInput("this TieredCache has no warm tier (open it with warm_dir=...)")
        return self.warm

    def _warm_call(self, fn, default):
        """Run a warm-tier call; a warm failure degrades to a miss (counted, warned once), never an
        exception on the serving path. The hot tier keeps serving."""
        try:
            return fn()
        except (TieredKVError, OSError) as e:
            self._count(warm_errors=1)
            with self._lock:
                first, self._warned = not self._warned, True
            if first:
                warnings.warn(f"tieredkv: warm tier failed ({e}); serving from the hot tier",
                              RuntimeWarning, stacklevel=3)
            return default

    # ---- remote tier ------------------------------------------------------------------------------
    # Everything the remote tier adds lives here; lookup/load/store/_demote/close each call one helper.
    def _open_remote(self, remote: Any, queue_blocks: int, flush_s: float) -> None:
        from tieredkv.remote import RemoteTier
        from tieredkv.tier import Tier

        if isinstance(remote, str):
            remote = RemoteTier(self.spec, remote)
        elif not isinstance(remote, Tier):
            raise InvalidInput(f"remote must be a URL such as 'valkey://host:6379' or a Tier, got "
                               f"{type(remote).__name__}")
        if getattr(remote, "spec", self.spec) != self.spec:
            raise InvalidInput("remote tier was opened for another spec; open it with this cache's spec")
        if not isinstance(flush_s, (int, float)) or flush_s < 0:
            raise InvalidInput(f"remote_flush_s must be a number >= 0, got {flush_s!r}")
        self._remote_writer = BackgroundWriter("tieredkv-remote-writer", queue_blocks,
                                               on_error=lambda e: self._count(remote_errors=1))
        self._remote_flush_s = float(flush_s)
        self.remote = remote
        if isinstance(remote, RemoteTier):
            remote.observer = self._remote_event

    def _rt(self) -> Tier:
        """The remote tier; the helpers below run only when the cache has one."""
        if self.remote is None:
            raise InvalidInput("this TieredCache has no remote tier (or is closed)")
        return self.remote

    def _rw(self) -> BackgroundWriter:
        if self._remote_writer is None:
            raise InvalidInput("this TieredCache has no remote tier (or is closed)")
        return self._remote_writer

    @property
    def _remote_on_evict(self) -> bool:
        return self.remote is not None and not self.remote_write.at_store

    def _remote_event(self, deltas: dict) -> None:
        """RemoteTier's counter hook: its failed/skipped calls and refused values, per host."""
        errors = deltas.get("errors", 0) + deltas.get("skipped", 0)
        self._count(remote_errors=errors, remote_corrupt=deltas.get("corrupt", 0))

    def _remote_call(self, fn, default):
        """A call to the remote tier that must not fail a request (RemoteTier never raises on a dead
        store; a Tier of the user's might)."""
        try:
            return fn()
        except (TieredKVError, OSError):
            self._count(remote_errors=1)
            return default

    def _remote_lookup(self, keys: ChunkKeys, where: np.ndarray, run: int) -> int:
        """Ask the remote tier, in one call, for the blocks after the local run that no local tier
        holds; mark the ones it has and return the new run."""
        rest = np.flatnonzero(where[run:] < 0) + run
        found = self._remote_call(lambda: self._rt().contains_many(keys.take(rest)),
                                  default=np.zeros(len(rest), dtype=bool))
        where[rest[np.asarray(found, dtype=bool)]] = REMOTE
        new_run = int(np.argmin(where >= 0)) if (where < 0).any() else len(where)
        if new_run < len(where):
            self._count(remote_misses=1)
        return new_run

    def _load_remote(self, keys: ChunkKeys, place: Placer, first: int,
                     promote: list[tuple[ChunkKeys, np.ndarray, int]]) -> int:
        C = self.spec.chunk_tokens
        staging = np.empty((len(keys), *self.spec.block_shape), dtype=self.spec.numpy_dtype)
        got = self._remote_call(lambda: self._rt().get_many(keys, staging), default=0)
        if got:  # one copy for the run
            place(staging[:got].reshape(got, -1).view(np.uint8), first * C, False)
        self._count(remote_bytes_read=got * self.spec.block_bytes)
        if got:
            promote.append((keys[:got], staging[:got], REMOTE))
        return got

    def _promote_remote(self, keys: ChunkKeys, payloads: np.ndarray) -> None:
        """Promote remote hits per the promotion rule into hot, so this host's other workers find them
        locally, and into warm, so the host keeps them across restarts."""
        chosen = self._promotion_chosen(keys)
        if not len(chosen):
            return
        keys, payloads = keys.take(chosen), payloads[chosen]
        codes = self.hot.put_many(keys, payloads)
        self._count(promotions=int(np.count_nonzero(codes == PutResult.STORED)))
        if self.warm is not None:
            wcodes = self._warm_call(lambda: self.warm.put_many(keys, payloads), default=None)
            if wcodes is not None:
                self._count(warm_bytes_written=int(np.count_nonzero(wcodes == PutResult.STORED))
                            * self.spec.block_bytes)

    def _remote_send(self, keys: ChunkKeys, payloads: np.ndarray) -> None:
        """Queue blocks for the remote tier. ``payloads`` must be owned by this call (not reused)."""
        n = len(keys)
        if n and not self._rw().submit(lambda: self._remote_put(keys, payloads), n):
            self._count(remote_drops=n)  # backpressure: the store is behind, never an unbounded queue

    def _remote_put(self, keys: ChunkKeys, payloads: np.ndarray) -> None:
        """On the writer thread."""
        codes = self._rt().put_many(keys, payloads)
        self._count(remote_bytes_written=int(np.count_nonzero(codes == PutResult.STORED)) * self.spec.block_bytes)

    def _remote_demote(self, evicted: Evicted) -> None:
        """Blocks leaving this host's last local tier (warm if there is one, else hot), for the
        ``on_evict`` / ``on_nth_hit`` remote rules."""
        if evicted.payloads is None or not len(evicted.keys):
            return
        chosen = np.flatnonzero(self.remote_write.should_demote(evicted.hits))
        if len(chosen):
            self._remote_send(evicted.keys.take(chosen), evicted.payloads[chosen])

    def flush_remote(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued remote writes are done (at most ``timeout_s``); True when none is left."""
        return self._remote_writer.flush(timeout_s) if self._remote_writer is not None else True

    def _remote_stats(self) -> dict | None:
        if self.remote is None:
            return None
        doc = self._rt().stats().to_dict()
        w = self._rw()
        doc["queue"] = {"pending_blocks": w.pending_blocks, "max_blocks": w.max_blocks, "jobs": w.submitted,
                        "dropped_blocks": w.dropped_blocks, "failed_jobs": w.failed}
        return doc

    def _close_remote(self) -> None:
        writer, self._remote_writer = self._remote_writer, None
        if writer is not None:
            before = writer.dropped_blocks
            writer.close(self._remote_flush_s)
            if writer.dropped_blocks > before and getattr(self, "hot", None) is not None:
                self._count(remote_drops=writer.dropped_blocks - before)
        remote, self.remote = self.remote, None
        if remote is not None:
            remote.close()

    # ---- tensors ----------------------------------------------------------------------------------
    def _check_array(self, arr: np.ndarray, what: str, min_tokens: int) -> None:
        s = self.spec
        if arr.ndim != 5 or arr.shape[:3] != (s.num_layers, 2, s.num_kv_heads) or arr.shape[4] != s.head_dim:
            raise InvalidPayload(f"{what} must be shaped (num_layers={s.num_layers}, 2, num_kv_heads="
                                 f"{s.num_kv_heads}, n_tokens, head_dim={s.head_dim}), got {tuple(arr.shape)}")
        if arr.shape[3] < min_tokens:
            raise InvalidPayload(f"{what} holds {arr.shape[3]} tokens; the hit needs {min_tokens}")

    @staticmethod
    def _check_no_overlap(out) -> None:
        if isinstance(out, np.ndarray):
            strides, size = out.strides, out.itemsize
        else:  # torch counts strides in elements
            size = out.element_size()
            strides = tuple(st * size for st in out.stride())
        if overlaps_itself(tuple(out.shape), strides, size):
            raise InvalidPayload(f"out has overlapping strides (byte strides {strides}, as made by as_strided "
                                 "or expand): restored tokens would overwrite each other; pass an array with "
                                 "one element per index")

    def _torch_dtype_ok(self, t) -> bool:
        return str(t.dtype).removeprefix("torch.") == self.spec.dtype

    def _placer(self, out: Any, min_tokens: int) -> tuple[Placer, Callable[[int], None]]:
        """``place(rows, at_token, from_hot)``, which copies ``(k, block_bytes)`` rows of blocks into
        ``out`` at ``at_token`` in the model layout, and ``finish(n)`` to call once ``n`` tokens are in
        place. Checks ``out`` first."""
        if isinstance(out, np.ndarray):
            if out.dtype != self.spec.numpy_dtype:
                raise InvalidPayload(f"out dtype {out.dtype} != the spec's {self.spec.dtype} "
                                     f"(numpy {self.spec.numpy_dtype})")
            if not out.flags.writeable:
                raise InvalidPayload("out is read-only")
            self._check_array(out, "out", min_tokens)
            self._check_no_overlap(out)
            return self._host_placer(out), lambda n: None
        torch = _torch_or_none(out)
        if torch is None:
            raise InvalidPayload(f"out must be a numpy array or a torch tensor, got {type(out).__name__}")
        if not self._torch_dtype_ok(out):
            raise InvalidPayload(f"out dtype {out.dtype} != the spec's {self.spec.dtype}")
        self._check_array(out, "out", min_tokens)
        _check_device(out, "out")
        if out.requires_grad:
            raise InvalidPayload("out requires grad: autograd cannot track a cache restore; allocate it "
                                 "without requires_grad (or pass out.detach(), which shares its memory)")
        self._check_no_overlap(out)
        if out.device.type == "cpu":
            return self._host_placer(_numpy_of(out, self.spec.numpy_dtype)), lambda n: None
        # A CUDA tensor: hot rows are DMA'd straight out of the segment (registered once), other rows
        # through the driver; the re-layout runs on the GPU into a kept device staging buffer.
        from tieredkv import cuda

        if self._host_registry is None:
            self._host_registry = cuda.HostRegistry()
        registry = self._host_registry
        device = cuda.DeviceRestore(self.spec, out, self._device_stage)

        def place(rows: np.ndarray, at_token: int, from_hot: bool) -> None:
            if from_hot:
                registry.register(rows)
            device.place(rows, at_token)

        def finish(n: int) -> None:
            device.finish()
            self._device_stage = device.stage

        return place, finish

    def _host_placer(self, target: np.ndarray) -> Placer:
        spec = self.spec

        def place(rows: np.ndarray, at_token: int, from_hot: bool) -> None:
            blocks_to_model(spec, rows, target, at_token)

        return place

    def _host_source(self, kv: Any) -> np.ndarray:
        if isinstance(kv, np.ndarray):
            if kv.dtype != self.spec.numpy_dtype:
                raise InvalidPayload(f"kv dtype {kv.dtype} != the spec's {self.spec.dtype} "
                                     f"(numpy {self.spec.numpy_dtype})")
            self._check_array(kv, "kv", 0)
            return kv
        torch = _torch_or_none(kv)
        if torch is None:
            raise InvalidPayload(f"kv must be a numpy array or a torch tensor, got {type(kv).__name__}")
        if not self._torch_dtype_ok(kv):
            raise InvalidPayload(f"kv dtype {kv.dtype} != the spec's {self.spec.dtype}")
        self._check_array(kv, "kv", 0)
        _check_device(kv, "kv")
        if kv.device.type != "cpu":
            kv = kv.detach().to("cpu")
        return _numpy_of(kv.detach(), self.spec.numpy_dtype)

    # ---- introspection ------------------------------------------------------------------------------
    def _counters(self) -> counters.CacheCounters:
        """Where this cache counts: the first tier that keeps a shared row (the hot tier: one row
        per handle in its segment, summed per host), else a private row. Asked on every call: a
        tier that reattached (after fork, or a recreated segment) hands out its new row."""
        for tier in (self.hot, self.warm):
            if tier is not None:
                row = tier.cache_counters()
                if row is not None:
                    return row
        return self._private_counters

    def _count(self, **deltas: int) -> None:
        """Add to this handle's counter row (see ``_counters``)."""
        with self._lock:
            row = self._counters()
            for name, n in deltas.items():
                if n:
                    row.add(name, n)

    def _observe(self, what: str, seconds: float) -> None:
        with self._lock:
            self._counters().observe(what, seconds)

    def stats(self) -> dict:
        """Per-host counters of every process using this cache (they live in the hot segment), the
        prefix hit rate (hit tokens / prompt tokens), each tier's ``TierStats``, and
        ``warm_queue_blocks``: blocks this process has queued for the warm tier and not written yet
        (``warm_queued_blocks`` / ``warm_dropped_blocks`` are the per-host totals)."""
        if getattr(self, "hot", None) is None:
            raise InvalidInput("this TieredCache is closed")
        doc = self._counters().totals()
        doc["prefix_hit_rate"] = counters.prefix_hit_rate(doc)
        doc["hot"] = self.hot.stats().to_dict()
        doc["warm"] = self.warm.stats().to_dict() if self.warm is not None else None
        doc["warm_queue_blocks"] = self._writer.pending_blocks if self._writer is not None else 0
        doc["remote"] = self._remote_stats()
        return doc

    def unlink_hot(self) -> None:
        """Remove the hot segment's name (as a node restart would) and close this cache.

        Processes that still map the segment keep using it until they close; the next TieredCache
        creates a fresh, empty segment. The warm tier is untouched.
        """
        hot = getattr(self, "hot", None)
        if isinstance(hot, HotTier):
            hot.unlink()
        self.close()

    def close(self) -> None:
        """Close every tier (idempotent). Shared state stays for other processes and restarts.

        Writes still queued are flushed first: the remote tier's for at most ``remote_flush_s``, the
        warm tier's (write-behind) for at most ``warm_flush_s``; what is left then is dropped and
        counted."""
        self._close_remote()
        writer, self._writer = getattr(self, "_writer", None), None
        if writer is not None:
            before = writer.dropped_blocks
            writer.close(self._flush_s)
            if writer.dropped_blocks > before and self.hot is not None:
                self._count(warm_dropped_blocks=writer.dropped_blocks - before)
        if getattr(self, "_host_registry", None) is not None:
            self._host_registry.unregister_all()  # before the segment it pins is unmapped
        self._device_stage = None
        for tier in (getattr(self, "hot", None), self.warm):
            if tier is not None:
                tier.close()
        self._staging = None

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        warm = "" if self.warm is None else f", warm={self.warm!r}"
        return f"TieredCache({self.spec.namespace}, hot={getattr(self, 'hot', None)!r}{warm})"


def _flush_at_exit(ref: weakref.ref[TieredCache]) -> None:
    cache = ref()
    if cache is not None and cache._writer is not None:
        cache.flush()


def _torch_or_none(obj: Any):
    if type(obj).__module__.split(".")[0] != "torch":
        return None
    import torch

    return torch if isinstance(obj, torch.Tensor) else None


def _check_device(t, what: str) -> None:
    if t.device.type == "meta":
        raise InvalidPayload(f"{what} is on the meta device, which holds no data; pass a CPU or CUDA tensor")


def _numpy_of(t, numpy_dtype: np.dtype) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (any strides); bfloat16 is viewed as uint16."""
    import torch

    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
    arr = t.numpy()
    return arr.view(numpy_dtype) if arr.dtype != numpy_dtype else arr
