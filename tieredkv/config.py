"""CacheConfig: every option of a ``TieredCache``, checked once, before any tier is opened.

```
CacheConfig
├── hot:    HotConfig     the shared-memory segment (always there: the top level)
├── warm:   WarmConfig    slab files + LMDB on a local disk (None: no warm tier)
├── levels: LevelConfig…  further local tiers of your own (tieredkv/levels.py, docs/architecture.md)
├── remote: RemoteConfig  a store shared by the fleet (None: none)
└── eviction, lock_timeout_s   shared by the tiers
```

The dataclasses are frozen and normalised: sizes may be given as ``"8G"``-style strings and are held as
ints, rules as their names. ``TieredCache(spec, **kwargs)`` builds one with ``CacheConfig.from_kwargs``,
whose messages name the keyword the caller used (``warm_flush_s``); a config built from the
dataclasses names the field (``WarmConfig.flush_s``). Every check is here, so an option accepted at
construction cannot fail a later call (a ``flush_s`` of ``inf`` would have made ``close()`` raise).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterator
from typing import Any

from tieredkv import policies
from tieredkv.errors import InvalidInput
from tieredkv.policies import demotion as demotion_rules
from tieredkv.policies import promotion as promotion_rules
from tieredkv.spec import KVSpec, parse_bytes
from tieredkv.tier import Evicted, Tier

#: ``open(spec, on_evict)``: open a level's tier for ``spec``; ``on_evict`` (or None) is the hook its
#: evictions go to (the level below, when that level admits blocks on eviction).
TierOpener = Callable[[KVSpec, "Callable[[Evicted], None] | None"], Tier]

#: The options earlier versions of ``TieredCache`` took by position after ``spec`` (still accepted, in
#: this order: ``CacheConfig.from_call``).
POSITIONAL = ("hot_bytes", "warm_dir", "warm_bytes", "eviction", "promotion", "demotion")
#: ``TieredCache``'s keyword arguments and where each one lives: (section, field).
KEYWORDS: dict[str, tuple[str, str]] = {
    "hot_bytes": ("hot", "bytes"), "hot_blocks": ("hot", "blocks"), "hot_name": ("hot", "name"),
    "numa_node": ("hot", "numa_node"), "promotion": ("hot", "promotion"),
    "warm_dir": ("warm", "dir"), "warm_bytes": ("warm", "bytes"), "demotion": ("warm", "write"),
    "warm_sync": ("warm", "sync"), "warm_verify": ("warm", "verify"),
    "warm_queue_bytes": ("warm", "queue_bytes"), "warm_flush_s": ("warm", "flush_s"),
    "warm_compress": ("warm", "compress"), "warm_slot_fraction": ("warm", "slot_fraction"),
    "remote": ("remote", "store"), "remote_write": ("remote", "write"),
    "remote_queue_blocks": ("remote", "queue_blocks"), "remote_queue_bytes": ("remote", "queue_bytes"),
    "remote_flush_s": ("remote", "flush_s"),
    "eviction": ("cache", "eviction"), "lock_timeout_s": ("cache", "lock_timeout_s"),
    "journal": ("cache", "journal"),
}
_SECTION_CLASS = {"hot": "HotConfig", "warm": "WarmConfig", "remote": "RemoteConfig", "cache": "CacheConfig",
                  "level": "LevelConfig"}
_KEYWORD_OF = {where: kw for kw, where in KEYWORDS.items()}
# True while from_kwargs builds a config: messages then name the keyword, not the field.
_BY_KEYWORD: contextvars.ContextVar[bool] = contextvars.ContextVar("tieredkv_config_by_keyword", default=False)


def _name(section: str, field: str) -> str:
    """The name a message uses for ``section.field``: the caller's keyword, or the dataclass field."""
    if _BY_KEYWORD.get() and (section, field) in _KEYWORD_OF:
        return _KEYWORD_OF[section, field]
    return f"{_SECTION_CLASS[section]}.{field}"


def _set(obj: Any, field: str, value: Any) -> None:
    object.__setattr__(obj, field, value)  # normalising a frozen dataclass in its __post_init__


def _size(section: str, field: str, value: Any, *, minimum: int) -> int:
    name = _name(section, field)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InvalidInput(f"{name} must be {what} (bytes) or a size like '8G', got {value!r}")
    return parse_bytes(value, what=name)


def _positive_int(section: str, field: str, value: Any, example: str) -> int:
    name = _name(section, field)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise InvalidInput(f"{name} must be a positive integer (e.g. {name}={example}), got {value!r}")
    return int(value)


def _seconds(section: str, field: str, value: Any, *, zero_ok: bool) -> float:
    """A finite number of seconds (``inf`` is refused: a bounded wait must have a bound)."""
    name = _name(section, field)
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_ok)):
        what = "a finite number of seconds >= 0" if zero_ok else "a positive, finite number of seconds"
        raise InvalidInput(f"{name} must be {what} (e.g. {name}=10.0), got {value!r}")
    return float(value)


def _rule(section: str, field: str, value: Any, registry: Any) -> str:
    name = _name(section, field)
    try:
        registry.make(value)
    except InvalidInput as e:  # the rule's own message (an unknown name lists the valid ones)
        raise InvalidInput(f"{name}: {e}") from None
    return value


def _choice(section: str, field: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidInput(f"{_name(section, field)} must be one of {choices}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class HotConfig:
    """The hot tier: one POSIX shared-memory segment per namespace (and NUMA node)."""

    #: Size of the segment to create, metadata included (an int or "8G"); ``None``: attach to the
    #: existing one (or, with ``blocks``, size it by block count).
    bytes: int | str | None = None
    #: Create the segment with exactly this many block slots instead of ``bytes``.
    blocks: int | None = None
    #: Segment name; ``None``: derived from the spec's namespace.
    name: str | None = None
    #: One segment per NUMA node: the node this process's segment lives on (docs/tuning.md).
    numa_node: int | None = None
    #: When a block read from a lower level is copied into hot: "always", "on_nth_hit:N" or "never".
    promotion: str = "always"

    def __post_init__(self) -> None:
        if self.bytes is not None:
            _set(self, "bytes", _size("hot", "bytes", self.bytes, minimum=1))
        if self.blocks is not None:
            _set(self, "blocks", _positive_int("hot", "blocks", self.blocks, "4096"))
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidInput(f"{_name('hot', 'name')} must be a str or None, got {self.name!r}")
        if self.numa_node is not None and (isinstance(self.numa_node, bool) or not isinstance(
                self.numa_node, numbers.Integral) or self.numa_node < 0):
            raise InvalidInput(f"{_name('hot', 'numa_node')} must be an int >= 0 or None, got {self.numa_node!r}")
        _rule("hot", "promotion", self.promotion, promotion_rules)


@dataclasses.dataclass(frozen=True)
class WarmConfig:
    """The warm tier: slab files and an LMDB index in ``dir``, kept across restarts."""

    #: Directory of the tier (one subdirectory per namespace is made in it).
    dir: str | os.PathLike
    #: Capacity (an int or "64G"); required.
    bytes: int | str | None = None
    #: When a block reaches warm: "write_behind" (at store, on a background thread), "write_through"
    #: (at store, before it returns), "on_evict" or "on_nth_hit:N" (when the level above evicts it).
    write: str = "write_behind"
    #: Durability of a write that returned: "none", "data" or "full" (docs/warm-tier.md).
    sync: str = "none"
    #: Checksum checks on reads: "always" (the only one that catches media corruption), "sampled", "never".
    verify: str = "always"
    #: With write-behind: the most block bytes queued for the writer thread (at least one block is allowed).
    queue_bytes: int | str = 256 << 20
    #: With write-behind: how long ``close()`` waits for queued writes.
    flush_s: float = 10.0
    #: Write blocks compressed: "none", "zstd" (about 1.45x on bf16 KV) or "lz4" (about 1.2x, decodes
    #: faster); True means "zstd". Saves disk reads and writes; capacity only with ``slot_fraction``.
    #: Off by default because a restore from the page cache or a fast NVMe is slower through the codec
    #: (docs/warm-tier.md). Needs blosc2 (``pip install 'tieredkv[compress]'``); reads decode
    #: compressed blocks regardless.
    compress: str | bool | None = "none"
    #: Below 1, a new tier is compact: slots of this share of a block, so ``bytes`` holds
    #: ``1 / slot_fraction`` times as many blocks, all stored compressed ("zstd" if ``compress`` is
    #: "none"); a block that does not compress into a slot is not stored. 0.75 fits bf16 KV (about 1.3x
    #: the blocks). An existing tier keeps its slots. See docs/warm-tier.md, "Compression".
    slot_fraction: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.dir, bytes) or not isinstance(self.dir, (str, os.PathLike)) or not os.fspath(self.dir):
            # "" would silently put the warm tier in whatever directory the worker started in.
            raise InvalidInput(f"{_name('warm', 'dir')} must be a non-empty path (str or os.PathLike), "
                               f"got {self.dir!r}")
        if self.bytes is None or self.bytes == 0:
            raise InvalidInput(f"{_name('warm', 'bytes')} is required with {_name('warm', 'dir')} "
                               f"(e.g. {_name('warm', 'bytes')}='64G')")
        _set(self, "bytes", _size("warm", "bytes", self.bytes, minimum=1))
        _rule("warm", "write", self.write, demotion_rules)
        _choice("warm", "sync", self.sync, ("none", "data", "full"))
        _choice("warm", "verify", self.verify, ("always", "sampled", "never"))
        _set(self, "queue_bytes", _size("warm", "queue_bytes", self.queue_bytes, minimum=0))
        _set(self, "flush_s", _seconds("warm", "flush_s", self.flush_s, zero_ok=True))
        _set(self, "compress", _compression("warm", "compress", self.compress))
        if isinstance(self.slot_fraction, bool) or not isinstance(self.slot_fraction, numbers.Real) \
                or not 0 < self.slot_fraction <= 1:
            raise InvalidInput(f"{_name('warm', 'slot_fraction')} must be in (0, 1], got {self.slot_fraction!r}")
        if self.slot_fraction < 1:
            _compression("warm", "slot_fraction", "zstd")  # a compact tier needs blosc2: say so now


def _compression(section: str, field: str, value: Any) -> str:
    """A codec choice for a local tier ("none", "zstd", "lz4"), its library checked now.

    Raises:
        InvalidInput: an unknown choice.
        MissingDependency: the choice needs blosc2, which is not installed.
    """
    from tieredkv import codec

    name = codec.choice(value, _name(section, field))
    if name == "zlib":
        raise InvalidInput(f"{_name(section, field)}='zlib' is too slow for a local tier; use 'zstd' or 'lz4'")
    if name != "none":
        codec.blosc2_module()
    return name


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """The remote tier: a store shared by the hosts of a fleet (docs/fleet.md)."""

    #: A URL ("valkey://host:6379", "mooncake://host:50051", options in the query string) or a ``Tier``.
    #: The cache closes it.
    store: Any
    #: Which blocks are sent: "write_through" (every stored block), "on_evict" (blocks leaving the
    #: host's last local level) or "on_nth_hit:N" (those of them hit at least N times).
    write: str = "write_through"
    #: Bound on blocks waiting for the remote writer; beyond it writes are dropped and counted.
    queue_blocks: int | None = None
    #: The same bound in bytes (an int or "512M"), like the warm tier's; give one of the two.
    queue_bytes: int | str | None = None
    #: How long ``close()`` waits for queued remote writes.
    flush_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.store, str):
            from tieredkv.remote.store import parse_url

            parse_url(self.store)
        elif not isinstance(self.store, Tier):
            raise InvalidInput(f"{_name('remote', 'store')} must be a URL such as 'valkey://host:6379' or a "
                               f"Tier, got {type(self.store).__name__}")
        _rule("remote", "write", self.write, demotion_rules)
        if self.queue_blocks is not None and self.queue_bytes is not None:
            raise InvalidInput(f"give {_name('remote', 'queue_blocks')} or {_name('remote', 'queue_bytes')}, "
                               f"not both")
        if self.queue_bytes is not None:
            _set(self, "queue_bytes", _size("remote", "queue_bytes", self.queue_bytes, minimum=0))
        elif self.queue_blocks is not None:
            _set(self, "queue_blocks", _positive_int("remote", "queue_blocks", self.queue_blocks, "256"))
        _set(self, "flush_s", _seconds("remote", "flush_s", self.flush_s, zero_ok=True))

    def max_blocks(self, block_bytes: int) -> int:
        """The queue bound in blocks (256 when neither bound is given)."""
        if self.queue_bytes is not None:
            return max(int(self.queue_bytes) // block_bytes, 1)
        return self.queue_blocks if self.queue_blocks is not None else 256


@dataclasses.dataclass(frozen=True)
class LevelConfig:
    """A further level of your own: any ``Tier`` (an NVMe or CXL tier, say), placed below the warm tier
    (or below the level named by ``after``) and above the remote tier. See docs/architecture.md.
    """

    #: The level's name: its key in ``stats()``; its counters are named ``<name>_hit_tokens`` etc.
    name: str
    #: ``open(spec, on_evict)`` returns the open tier (see ``TierOpener``).
    open: TierOpener
    #: When blocks reach it: "write_through", "write_behind", "on_evict" or "on_nth_hit:N".
    write: str = "write_through"
    #: The level it sits right below ("hot", "warm" or another level's name); None: below the last
    #: local level (just above the remote tier).
    after: str | None = None
    #: With write-behind: bound on blocks queued for its writer thread.
    queue_blocks: int = 256
    #: With write-behind: how long ``close()`` waits for queued writes.
    flush_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name in ("hot", "warm",
                                                                                          "remote", "cache"):
            raise InvalidInput(f"LevelConfig.name must be an identifier other than hot/warm/remote/cache, "
                               f"got {self.name!r}")
        if not callable(self.open):
            raise InvalidInput(f"LevelConfig.open must be callable(spec, on_evict) -> Tier, got {self.open!r}")
        _rule("level", "write", self.write, demotion_rules)
        _set(self, "queue_blocks", _positive_int("level", "queue_blocks", self.queue_blocks, "256"))
        _set(self, "flush_s", _seconds("level", "flush_s", self.flush_s, zero_ok=True))


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Everything a ``TieredCache`` is opened with (see the module docstring)."""

    #: The hot tier (the top level; always there).
    hot: HotConfig = dataclasses.field(default_factory=HotConfig)
    #: The warm tier, or None for none.
    warm: WarmConfig | None = None
    #: The remote tier, or None for none.
    remote: RemoteConfig | None = None
    #: Further levels of your own, in order (see ``LevelConfig``).
    levels: tuple[LevelConfig, ...] = ()
    #: Eviction policy of the local tiers (see ``tieredkv.policies.names()``).
    eviction: str = "lru"
    #: Longest wait for a lock held by another live process before ``LockTimeout``.
    lock_timeout_s: float = 10.0
    #: Record the tier changes this handle makes (stored, evicted) in the host journal next to the hot
    #: segment (``tieredkv.journal``): what KV-aware routers are told (docs/vllm.md).
    journal: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.journal, bool):
            raise InvalidInput(f"{_name('cache', 'journal')} must be True or False, got {self.journal!r}")
        for section, cls in (("hot", HotConfig), ("warm", WarmConfig), ("remote", RemoteConfig)):
            value = getattr(self, section)
            if not isinstance(value, cls) and not (value is None and section != "hot"):
                raise InvalidInput(f"CacheConfig.{section} must be a {cls.__name__}, got {type(value).__name__}")
        levels = tuple(self.levels)
        if not all(isinstance(level, LevelConfig) for level in levels):
            raise InvalidInput("CacheConfig.levels must hold LevelConfig entries")
        names = [level.name for level in levels]
        if len(set(names)) != len(names):
            raise InvalidInput(f"CacheConfig.levels: two levels share a name ({names})")
        known = {"hot", "warm", *names}
        for level in levels:
            if level.after is not None and level.after not in known:
                raise InvalidInput(f"LevelConfig.after={level.after!r} names no level; use one of {sorted(known)}")
        _set(self, "levels", levels)
        name = _name("cache", "eviction")
        try:
            policies.make(self.eviction)
        except InvalidInput as e:
            raise InvalidInput(f"{name}: {e}") from None
        _set(self, "lock_timeout_s", _seconds("cache", "lock_timeout_s", self.lock_timeout_s, zero_ok=False))

    @classmethod
    def from_kwargs(cls, base: CacheConfig | None = None, **kwargs: Any) -> CacheConfig:
        """A config from ``TieredCache``'s keyword arguments (``KEYWORDS``), over ``base`` if given.

        Raises:
            InvalidInput: an unknown keyword, or a bad value (the message names the keyword).
        """
        unknown = sorted(set(kwargs) - set(KEYWORDS))
        if unknown:
            raise InvalidInput(f"unknown TieredCache option(s) {unknown}; valid: {sorted(KEYWORDS)}")
        base = base if base is not None else cls()
        sections: dict[str, dict[str, Any]] = {"hot": {}, "warm": {}, "remote": {}, "cache": {}}
        for kw, value in kwargs.items():
            section, field = KEYWORDS[kw]
            sections[section][field] = value
        with _keyword_names():
            hot = dataclasses.replace(base.hot, **sections["hot"])
            warm = _merged(WarmConfig, base.warm, sections["warm"], "dir")
            remote = _merged(RemoteConfig, base.remote, sections["remote"], "store")
            return dataclasses.replace(base, hot=hot, warm=warm, remote=remote, **sections["cache"])

    @classmethod
    def from_call(cls, config: Any, positional: tuple[Any, ...], kwargs: dict[str, Any]) -> CacheConfig:
        """The config of a call ``TieredCache(spec, config, *positional, **kwargs)``: ``config`` (None:
        the defaults) with the keywords replacing its fields; or, in the positional form of earlier
        versions (``TieredCache(spec, hot_bytes, warm_dir, ...)``: ``config`` is then not a
        ``CacheConfig``), the values given by position named as in ``POSITIONAL``.

        Raises:
            InvalidInput: too many options by position, one given both ways, or a bad option.
        """
        if positional or not isinstance(config, (CacheConfig, type(None))):
            given = (config, *positional)
            if len(given) > len(POSITIONAL):
                raise InvalidInput(f"TieredCache takes at most {len(POSITIONAL)} options by position "
                                   f"{POSITIONAL}; pass the others by keyword")
            twice = sorted(set(POSITIONAL[:len(given)]) & set(kwargs))
            if twice:
                raise InvalidInput(f"TieredCache got {twice} both by position and by keyword")
            kwargs, config = {**dict(zip(POSITIONAL, given)), **kwargs}, None
        return cls.from_kwargs(config, **kwargs) if kwargs or config is None else config


def _merged(cls: Any, base: Any, given: dict[str, Any], key: str) -> Any:
    """``base`` with the ``given`` fields replaced; ``None`` when the section's ``key`` (its directory
    or store) is ``None``. Options given for a section that is not there are still checked."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)} if base is not None else {}
    fields.update(given)
    if fields.get(key) is None:
        if given:  # e.g. warm_flush_s=inf with warm_dir=None: checked all the same, then unused
            checked = {**fields, **_PLACEHOLDER[key]}
            if cls is WarmConfig and not checked.get("bytes"):
                checked["bytes"] = 1
            cls(**checked)
        return None
    return cls(**fields)


_PLACEHOLDER = {"dir": {"dir": "."}, "store": {"store": "valkey://127.0.0.1:1"}}


@contextlib.contextmanager
def _keyword_names() -> Iterator[None]:
    token = _BY_KEYWORD.set(True)
    try:
        yield
    finally:
        _BY_KEYWORD.reset(token)
