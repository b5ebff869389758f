"""Levels: a ``TieredCache`` is an ordered list of them, and loops over it.

```
levels[0]  hot     the top: every stored block goes here; its failures raise
levels[1]  warm    admitted at store (write-through / write-behind) or on eviction from the level above
levels[…]  yours   any Tier with a LevelConfig (config.py): same rules, no edit to the cache
levels[-1] remote  admitted at store or on eviction from the last local level; always written behind
```

A ``Level`` is one tier plus the rules of how blocks reach it and how it fails:

- **admission** (``rule``, a demotion rule by name): ``at_store`` levels get every block ``store``
  writes (on the level's background writer when the rule says ``background``, or always for a level
  opened with ``queued=True``, the remote tier); the others get the blocks the level above evicts
  (``admit_evicted`` is the above tier's ``on_evict`` hook), filtered by ``should_demote(hits)``.
  Blocks read from a level are promoted into every level above it (the promotion rule chooses which).
- **failures**: the top level's calls raise; any other level's become counted misses (its ``errors``
  counter) with one ``RuntimeWarning`` per level: the hot tier keeps serving.
- **counters**: each level counts into the cache's counter row under its own names (``LevelCounters``;
  the hot, warm and remote names are the historical ones, fixed by the row layout in ``counters.py``).
  A level of your own counts into a private table shown in ``stats()[name]["cache"]``.

A level never refers to the cache: it gets a ``Counting`` (where counts go) and, through the tier's
``on_evict`` hook, the level below. ``observers``: callables ``(event, level_name, keys)`` called after
blocks are ``"stored"`` in a level (by a store, a promotion or a demotion) or ``"evicted"`` from it,
for a journal of tier changes; they run on the thread that made the change and must not raise.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv import counters, forksafe
from tieredkv.background import BackgroundWriter
from tieredkv.errors import (
    CapacityError,
    CorruptState,
    FormatError,
    InvalidInput,
    LockTimeout,
    PermissionDenied,
    TieredKVError,
    WarmTierUnavailable,
)
from tieredkv.keys import ChunkKeys
from tieredkv.policies import demotion as demotion_rules
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier

#: Failures of a lower level's state at open (damaged or unreachable files, a stuck writer, a disk too
#: full to create it) after which the cache opens without that level instead of not at all.
OPEN_DEGRADES = (CorruptState, FormatError, WarmTierUnavailable, LockTimeout, CapacityError, OSError)
#: ``observer(event, level_name, keys)``: ``event`` is ``"stored"`` or ``"evicted"``.
Observer = Callable[[str, str, ChunkKeys], None]


@dataclasses.dataclass(frozen=True)
class LevelCounters:
    """The names a level counts under (``None``: not counted). See ``counters.CACHE_FIELDS``."""

    hit_tokens: str | None
    bytes_read: str | None
    bytes_written: str | None
    errors: str | None = None       # calls that failed (a miss instead)
    queued: str | None = None       # blocks handed to the background writer
    dropped: str | None = None      # blocks the writer's full queue refused (or left at close)
    misses: str | None = None       # probes of this level that ended the hit
    corrupt: str | None = None      # damaged blocks the tier dropped during a load (``corrupt_seen``)
    demoted: str | None = None      # blocks written because the level above evicted them
    promoted: str | None = None     # blocks copied in from a lower level after a load
    refused: str | None = None      # values the tier refused as damaged or foreign (its own report)

    @classmethod
    def named(cls, name: str) -> LevelCounters:
        """The counters of a level of your own: ``<name>_hit_tokens``, ``<name>_errors``, ..."""
        return cls(hit_tokens=f"{name}_hit_tokens", bytes_read=f"{name}_bytes_read",
                   bytes_written=f"{name}_bytes_written", errors=f"{name}_errors", queued=f"{name}_queued_blocks",
                   dropped=f"{name}_dropped_blocks", misses=f"{name}_misses", corrupt=f"{name}_corrupt_blocks",
                   demoted=f"{name}_demotions", promoted=f"{name}_promotions", refused=f"{name}_refused")


HOT_COUNTERS = LevelCounters(hit_tokens="hot_hit_tokens", bytes_read="hot_bytes_read",
                             bytes_written="hot_bytes_written", promoted="promotions")
WARM_COUNTERS = LevelCounters(hit_tokens="warm_hit_tokens", bytes_read="warm_bytes_read",
                              bytes_written="warm_bytes_written", errors="warm_errors",
                              queued="warm_queued_blocks", dropped="warm_dropped_blocks",
                              corrupt="corrupt_blocks", demoted="demotions")
REMOTE_COUNTERS = LevelCounters(hit_tokens="remote_hit_tokens", bytes_read="remote_bytes_read",
                                bytes_written="remote_bytes_written", errors="remote_errors",
                                dropped="remote_drops", misses="remote_misses", refused="remote_corrupt")


class Counting:
    """Where a cache counts: the first tier that keeps a shared row (the hot tier: one row per handle
    in its segment, summed per host), else a private row. Names outside ``CACHE_FIELDS`` (levels of
    your own) go to a private table, ``extra``."""

    def __init__(self) -> None:
        self.tiers: list[Tier] = []       # asked in order for a row (set once the levels are open)
        self.extra: dict[str, int] = {}
        self._private = counters.private()
        self._lock = threading.Lock()
        forksafe.register(self)  # unlocked in a forked child (a writer thread may count at fork)

    def row(self) -> counters.CacheCounters:
        """Asked on every call: a tier that reattached (after fork, or a recreated segment) hands out
        its new row."""
        for tier in self.tiers:
            try:
                row = tier.cache_counters()
            except TieredKVError:  # closed under us (unlink_hot): count the rest privately
                continue
            if row is not None:
                return row
        return self._private

    def add(self, **deltas: int) -> None:
        """Add to this handle's counters (zero deltas are skipped)."""
        deltas = {name: n for name, n in deltas.items() if n}
        if not deltas:
            return
        with self._lock:
            row = self.row()
            for name, n in deltas.items():
                if name in counters.FIELD_INDEX:
                    row.add(name, n)
                else:
                    self.extra[name] = self.extra.get(name, 0) + n

    def observe(self, what: str, seconds: float) -> None:
        with self._lock:
            self.row().observe(what, seconds)


class Level:
    """One tier of a cache and the rules of how blocks reach it (see the module docstring).

    Args:
        name: its name (``stats()`` key; ``"hot"``, ``"warm"``, ``"remote"`` or yours).
        code: its value in ``PrefixHit.where``.
        tier: the open tier.
        rule: its admission rule (a ``DemotionRule``); ``None`` for the top level.
        names: its counter names.
        counting: where it counts.
        fatal: failures raise (the top level) instead of becoming counted misses.
        exclusive: it holds blocks the level above does not (it admits evictions and is local), so
            ``store`` checks it before storing a block again.
        writer: its background writer (``None``: writes happen in the caller's thread).
        flush_s: how long ``close`` waits for its queued writes.
        observers: called after blocks are stored in or evicted from it.
    """

    def __init__(self, name: str, code: int, tier: Tier, *, rule: demotion_rules.DemotionRule | None,
                 names: LevelCounters, counting: Counting, fatal: bool = False, exclusive: bool = False,
                 writer: BackgroundWriter | None = None, flush_s: float = 0.0,
                 observers: list[Observer] | None = None):
        self.name, self.code, self.tier, self.rule = name, code, tier, rule
        self.names, self.fatal, self.exclusive = names, fatal, exclusive
        self.writer, self.flush_s = writer, flush_s
        self.observers = observers if observers is not None else []
        self._counting = counting
        self._block_bytes = tier.spec.block_bytes
        self._warned = False
        self._warn_lock = threading.Lock()
        forksafe.register(self)

    @property
    def at_store(self) -> bool:
        """Blocks reach this level when they are stored (not when the level above evicts them)."""
        return self.rule is not None and self.rule.at_store

    # ---- counting and failures ------------------------------------------------------------------
    def count(self, **deltas: int) -> None:
        """Add to the counters this level names (``count(errors=1)`` adds to ``names.errors``)."""
        named = {getattr(self.names, what): n for what, n in deltas.items() if getattr(self.names, what)}
        if named:
            self._counting.add(**named)

    def call(self, fn: Callable[[], Any], default: Any) -> Any:
        """Run a call on this level's tier: the top level's failures raise; any other level's are a
        counted miss (``default``), warned about once, and the levels above keep serving."""
        if self.fatal:
            return fn()
        try:
            return fn()
        except (TieredKVError, OSError) as e:
            self.failed(e)
            return default

    def failed(self, error: BaseException) -> None:
        """Count a failure of this level; the first one is also warned about."""
        self.count(errors=1)
        with self._warn_lock:
            first, self._warned = not self._warned, True
        if first:
            warnings.warn(f"tieredkv: {self.name} tier failed ({error}); serving from the hot tier and the other "
                          f"levels above it", RuntimeWarning, stacklevel=4)

    def tier_event(self, deltas: dict) -> None:
        """The tier's own report of failed or skipped calls and refused values (the remote tier's
        ``observer``: those calls do not raise, so ``call`` cannot count them)."""
        self.count(errors=deltas.get("errors", 0) + deltas.get("skipped", 0), refused=deltas.get("corrupt", 0))

    def notify(self, event: str, keys: ChunkKeys) -> None:
        for observer in self.observers:
            observer(event, self.name, keys)

    # ---- the serving path -----------------------------------------------------------------------
    def contains(self, keys: ChunkKeys) -> np.ndarray:
        """Residency per key (a failing lower level: all absent)."""
        return self.call(lambda: self.tier.contains_many(keys), default=np.zeros(len(keys), dtype=bool))

    def match(self, keys: ChunkKeys) -> int:
        """How many leading ``keys`` the level holds (a failing lower level: none)."""
        return self.call(lambda: self.tier.match(keys), default=0)

    def read(self, keys: ChunkKeys, rows: np.ndarray, sink: Callable[[int, np.ndarray], None] | None) -> int:
        """Read leading blocks into ``rows`` (``sink`` moves each group on as it is read); count the
        bytes and the blocks the tier found damaged."""
        corrupt_before = self.tier.corrupt_seen
        got = self.call(lambda: self.tier.get_many(keys, rows, sink), default=0)
        self.count(corrupt=self.tier.corrupt_seen - corrupt_before, bytes_read=got * self._block_bytes)
        return got

    def read_through(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None], staging: np.ndarray,
                     parallel: bool = False) -> int:
        """``read`` for blocks needed only where ``sink`` puts them (``Tier.read_through``: the tier may
        reuse one small buffer instead of ``staging``, and with ``parallel`` call ``sink`` from a second
        thread); counts as ``read``."""
        corrupt_before = self.tier.corrupt_seen
        got = self.call(lambda: self.tier.read_through(keys, sink, staging, parallel=parallel), default=0)
        self.count(corrupt=self.tier.corrupt_seen - corrupt_before, bytes_read=got * self._block_bytes)
        return got

    def read_shared(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Read leading blocks as runs of the tier's own memory (the top level: no staging copy)."""
        got = self.call(lambda: self.tier.read_runs(keys, sink), default=0)
        self.count(bytes_read=got * self._block_bytes)
        return got

    def put(self, keys: ChunkKeys, payloads: Any, *, why: str = "stored") -> np.ndarray | None:
        """Write blocks now, in this thread; count what was stored (``why``: ``"stored"``,
        ``"demoted"`` or ``"promoted"``). ``payloads``: rows, or a fill callable for a tier that takes
        one (``HotTier.put_many``). Returns the ``PutResult`` codes (``None``: the level failed)."""
        codes = self.call(lambda: self.tier.put_many(keys, payloads), default=None)
        if codes is None:
            return None
        stored = codes == PutResult.STORED
        n = int(np.count_nonzero(stored))
        if why == "promoted" and self.names.promoted is not None:
            self.count(promoted=n)  # a level that counts promotions counts them, not their bytes
        else:
            self.count(bytes_written=n * self._block_bytes, **({why: n} if why == "demoted" else {}))
        if n and self.observers:
            self.notify("stored", keys if n == len(keys) else keys.take(np.flatnonzero(stored)))
        return codes

    def write(self, keys: ChunkKeys, payloads: np.ndarray, *, why: str = "stored") -> None:
        """Write blocks: queued on the background writer if the level has one (in jobs of at most its
        bound, so a store larger than the whole queue is written in part rather than not at all),
        else now. A queued job keeps ``payloads`` (rows nobody else writes) until it is done."""
        writer = self.writer
        if writer is None:
            self.put(keys, payloads, why=why)
            return
        step = writer.max_blocks
        whole = len(keys) <= step
        for i in range(0, len(keys), step):
            k, p = keys[i:i + step], payloads[i:i + step]
            if not whole and p.base is not None:
                # A job keeps what it refers to: a view would keep the whole buffer alive while the
                # queue counts only the job's rows, and the queue bound must bound the memory kept.
                p = p.copy()
            if writer.submit(_Job(self, k, p, why), blocks=len(k)):
                self.count(queued=len(k))
            else:  # backpressure: the tier is behind; never an unbounded queue
                self.count(dropped=len(k))

    def admit_evicted(self, evicted: Evicted) -> None:
        """The ``on_evict`` hook of the level above: take the blocks this level's rule admits."""
        if evicted.payloads is None or not len(evicted.keys) or self.rule is None:
            return
        chosen = np.flatnonzero(self.rule.should_demote(evicted.hits))
        if len(chosen):
            keys = evicted.keys if len(chosen) == len(evicted.keys) else evicted.keys.take(chosen)
            payloads = evicted.payloads if len(chosen) == len(evicted.keys) else evicted.payloads[chosen]
            self.write(keys, payloads, why="demoted")

    # ---- lifetime -------------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the queued writes (at most ``timeout_s``, default ``flush_s``); True when none is left."""
        if self.writer is None:
            return True
        return self.writer.flush(self.flush_s if timeout_s is None else timeout_s)

    def close_writer(self) -> None:
        """Flush for at most ``flush_s``, stop the writer; what is left is dropped and counted."""
        writer, self.writer = self.writer, None
        if writer is not None:
            before = writer.dropped_blocks
            writer.close(self.flush_s)
            self.count(dropped=writer.dropped_blocks - before)

    def stats(self) -> dict:
        """The tier's ``TierStats`` as a dict; with a writer, its ``queue``; a level of your own adds
        its cache counters (``cache``)."""
        doc = self.tier.stats().to_dict()
        w = self.writer
        if w is not None and self.names is not WARM_COUNTERS:  # warm's queue is warm_queue_blocks
            doc["queue"] = {"pending_blocks": w.pending_blocks, "max_blocks": w.max_blocks, "jobs": w.submitted,
                            "dropped_blocks": w.dropped_blocks, "failed_jobs": w.failed}
        if self.names.hit_tokens is not None and self.names.hit_tokens not in counters.FIELD_INDEX:
            extra = self._counting.extra
            names = [getattr(self.names, f.name) for f in dataclasses.fields(self.names)]
            doc["cache"] = {name: extra.get(name, 0) for name in names if name}
        return doc

    def __repr__(self) -> str:
        return f"Level({self.name}, {self.tier!r})"


class _Job:
    """One queued write of a level (runs on its writer thread)."""

    def __init__(self, level: Level, keys: ChunkKeys, payloads: np.ndarray, why: str):
        self.level, self.keys, self.payloads, self.why = level, keys, payloads, why

    def __call__(self) -> None:
        self.level.put(self.keys, self.payloads, why=self.why)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How to open one level (made from the ``CacheConfig``)."""

    name: str
    code: int
    rule: str | None                               # admission rule name; None: the top level
    names: LevelCounters
    open: Callable[[KVSpec, Callable[[Evicted], None] | None], Tier]
    max_blocks: Callable[[KVSpec], int] | None     # its writer's bound; None: never written behind
    queued: bool = False                           # every write goes through the writer (remote)
    flush_s: float = 0.0
    local: bool = True                             # on this host (store may check it for a block)


def open_levels(spec: KVSpec, config: Any, counting: Counting,
                observers: list[Observer]) -> tuple[list[Level], list[tuple[str, BaseException]]]:
    """Open the levels of ``config`` (a ``CacheConfig``), bottom first, so each tier is opened with the
    ``on_evict`` hook of the level below it when that level admits evicted blocks.

    Returns:
        ``(levels, failures)``: the open levels, top first, and ``(name, error)`` of the lower levels
        whose state could not open (``OPEN_DEGRADES``): they are left out; the caller warns and counts.

    Raises:
        TieredKVError: a level that must not be worked around (the hot tier, bad arguments, another
            user's files); the levels opened before it are closed.
    """
    opened: list[Level] = []   # bottom first
    failures: list[tuple[str, BaseException]] = []
    try:
        for entry in reversed(entries(config)):
            level = _open_level(spec, entry, opened[-1] if opened else None, counting, observers, failures)
            if level is not None:
                opened.append(level)
    except BaseException:
        for level in opened:
            close_level(level)
        raise
    return opened[::-1], failures


def warn_degraded(levels: list[Level], failures: list[tuple[str, BaseException]], counting: Counting,
                  warm_dir: str | os.PathLike | None) -> None:
    """Warn once about each lower level that could not open (``open_levels``' failures) and count it in
    its ``<name>_errors``. Its files are damaged or unusable right now; that must not keep the worker
    (and with it the hot tier every worker shares) from starting: the cache serves without it."""
    left = "+".join(level.name for level in levels)
    for name, error in failures:
        warnings.warn(f"tieredkv: the {name} tier cannot open ({error}); running {left}-only until restart "
                      f"({_open_failure_hint(name, warm_dir, error)})", RuntimeWarning, stacklevel=3)
        counting.add(**{f"{name}_errors": 1})


def _open_failure_hint(name: str, warm_dir: str | os.PathLike | None, error: BaseException) -> str:
    """What to do about a tier that could not open. For the warm tier, a permission problem (a directory
    another user made, e.g. a Kubernetes hostPath created root-owned) is fixed by its owner, not by a
    repair."""
    if name != "warm" or warm_dir is None:
        return "`tieredkv verify --repair` checks and rebuilds a warm tier"
    cause = error if isinstance(error, OSError) else error.__cause__
    if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM):
        try:
            st = os.stat(warm_dir)
            owner = f"owned by uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}"
        except OSError as exc:
            owner = f"not readable: {exc.strerror}"
        return (f"this process runs as uid {os.geteuid()} and may not write to {warm_dir} ({owner}): give the "
                f"directory to the workers' user, mode 0700 (chown; systemd: CacheDirectory=; a Kubernetes hostPath: "
                f"an init container that chowns it, see docs/deploy.md)")
    if isinstance(cause, OSError) and cause.errno == errno.EROFS:
        return f"{warm_dir} is on a read-only filesystem: mount it read-write"
    return "`tieredkv verify --repair` checks and rebuilds it"


def _open_level(spec: KVSpec, entry: _Entry, below: Level | None, counting: Counting, observers: list[Observer],
                failures: list[tuple[str, BaseException]]) -> Level | None:
    rule = demotion_rules.make(entry.rule) if entry.rule is not None else None
    # Every tier gets an eviction hook, so observers (added at any time) see evictions; only a level
    # below that admits evicted blocks needs their bytes: the others' hooks take keys only.
    admits = below is not None and not below.at_store

    def on_evict(evicted: Evicted, below: Level | None = below if admits else None) -> None:
        for observer in observers:
            observer("evicted", entry.name, evicted.keys)
        if below is not None:
            below.admit_evicted(evicted)
    try:
        tier = entry.open(spec, on_evict)
    except OPEN_DEGRADES as e:
        if entry.rule is None or isinstance(e, PermissionDenied):
            raise  # the top level, or another user's files: an operator decision, never worked around
        failures.append((entry.name, e))
        return None
    if getattr(tier, "spec", spec) != spec:
        tier.close()
        raise InvalidInput(f"the {entry.name} tier was opened for another spec; open it with this cache's spec")
    if not admits and hasattr(tier, "evict_payloads"):
        tier.evict_payloads = False  # nobody below takes the bytes: no copy of what is evicted
    level = Level(entry.name, entry.code, tier, rule=rule, names=entry.names, counting=counting,
                  fatal=rule is None, exclusive=entry.local and rule is not None and not rule.at_store,
                  flush_s=entry.flush_s, observers=observers)
    if rule is not None and entry.max_blocks is not None and (entry.queued or (rule.at_store and rule.background)):
        level.writer = BackgroundWriter(f"tieredkv-{entry.name}-writer", entry.max_blocks(spec), on_error=level.failed)
    if entry.names.refused is not None and hasattr(tier, "observer"):
        tier.observer = level.tier_event  # the remote tier reports its failed calls and refused values
    return level


def entries(config: Any) -> list[_Entry]:
    """The levels of a ``CacheConfig``, top first: hot, warm, yours, remote."""
    cfg = config
    hot = cfg.hot

    def open_hot(spec: KVSpec, on_evict: Callable[[Evicted], None] | None) -> Tier:
        from tieredkv.hot import HotTier

        return HotTier(spec, hot.bytes, n_slots=hot.blocks, name=hot.name, policy=cfg.eviction,
                       numa_node=hot.numa_node, lock_timeout_s=cfg.lock_timeout_s, on_evict=on_evict)

    out = [_Entry("hot", 0, None, HOT_COUNTERS, open_hot, None)]
    if cfg.warm is not None:
        warm = cfg.warm

        def open_warm(spec: KVSpec, on_evict: Callable[[Evicted], None] | None) -> Tier:
            from tieredkv.warm import WarmTier

            return WarmTier(spec, warm.dir, warm.bytes, sync=warm.sync, verify=warm.verify, policy=cfg.eviction,
                            lock_timeout_s=cfg.lock_timeout_s, on_evict=on_evict, compress=warm.compress,
                            slot_fraction=float(warm.slot_fraction))

        out.append(_Entry("warm", 1, warm.write, WARM_COUNTERS, open_warm,
                          lambda spec: max(int(warm.queue_bytes) // spec.block_bytes, 1), flush_s=warm.flush_s))
    for i, extra in enumerate(cfg.levels):
        at = len(out) if extra.after is None else 1 + next(j for j, e in enumerate(out) if e.name == extra.after)
        out.insert(at, _Entry(extra.name, 3 + i, extra.write, LevelCounters.named(extra.name), extra.open,
                              functools.partial(_fixed, extra.queue_blocks), flush_s=extra.flush_s))
    if cfg.remote is not None:
        remote = cfg.remote

        def open_remote(spec: KVSpec, on_evict: Callable[[Evicted], None] | None) -> Tier:
            if not isinstance(remote.store, str):
                return remote.store
            from tieredkv.remote import RemoteTier

            return RemoteTier(spec, remote.store)

        out.append(_Entry("remote", 2, remote.write, REMOTE_COUNTERS, open_remote,
                          lambda spec: remote.max_blocks(spec.block_bytes), queued=True, flush_s=remote.flush_s,
                          local=False))
    return out


def _fixed(n: int, spec: KVSpec) -> int:
    return n


def close_level(level: Level) -> None:
    """Stop its writer (flushing for at most its ``flush_s``), then close its tier."""
    level.close_writer()
    level.tier.close()
