"""Eviction policy base class, the registry, and the operations every home calls.

A policy is a small strategy over a ``SlotState``: it may declare extra per-slot int64 fields, global
words and a ghost ring, and overrides the hooks it needs. The common fields (see ``state.py``) are kept
here, by ``insert``/``hit``/``remove``/``evict``, so a policy only writes what is its own.

Homes (the hot tier, the simulator) call only these four functions:

    insert(policy, st, slots, key64, parents, positions)   # under the home's lock
    hit(policy, st, slots)                                 # may run without the lock
    remove(policy, st, slots)                              # explicit removal, under the lock
    evict(policy, st, n, evictable) -> slots               # under the lock; frees the victims

``evict`` also takes ``incoming=key64s`` (the keys about to be inserted): ARC adapts its target and
picks its victim list from them, as in the paper. A home that does not pass them still gets valid
decisions (ARC then adapts when the keys are inserted).

``hit`` runs without the lock in the hot tier: a policy's ``on_hit`` may only do plain stores of
aligned int64 words (a lost update under a race is fine; a torn structure is not).
"""

from __future__ import annotations

import abc
import importlib
import importlib.metadata
import re
from collections.abc import Callable

import numpy as np

from tieredkv.errors import CorruptState, InvalidInput

from . import _jit
from .state import SlotState

_REGISTRY: dict[str, type[EvictionPolicy]] = {}

#: Installed packages add policies under this entry-point group (``name = "package.module:Class"``);
#: they are loaded the first time a name is not found in the registry.
ENTRY_POINT_GROUP = "tieredkv.policies"
_MODULE_CLASS = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_entry_points_loaded = False


class UnknownPolicy(InvalidInput, KeyError):
    """An unknown policy name. The message lists the valid ones (a ``KeyError`` too, as it was)."""

    def __str__(self) -> str:  # KeyError's str() would repr() the message
        return str(self.args[0])


class EvictionPolicy(abc.ABC):
    """Base class. Subclasses set ``name`` and override ``choose`` (and hooks as needed).

    Args:
        **params: policy parameters (e.g. ``small_ratio`` for S3-FIFO); unknown ones are an error.
    """

    name: str = ""
    slot_fields: tuple[str, ...] = ()
    global_fields: tuple[str, ...] = ()
    #: Number of ghost lists (each holds ``ghost_capacity(n_slots)`` keys).
    ghost_lists: int = 1
    #: True if ``on_hit`` changes structure that must be changed under the lock.
    hit_needs_lock: bool = False

    def __init__(self, **params):
        if params:
            raise InvalidInput(f"policy {self.name!r} takes no parameters, got {sorted(params)}")

    def ghost_capacity(self, n_slots: int) -> int:
        """Live keys each ghost list holds for a cache of ``n_slots`` (0: the policy keeps no ghosts)."""
        return 0

    def full_name(self) -> str:
        """The name ``make`` rebuilds this policy from, wrapped policies included
        (``"prefix_aware:arc"``): what a tier records and compares, since two policies with one
        ``name`` may keep different state."""
        return self.name

    # ---- hooks --------------------------------------------------------------------------------
    def on_insert(self, st: SlotState, slots: np.ndarray) -> None:
        """Called after the common fields of newly inserted ``slots`` are set."""

    def on_hit(self, st: SlotState, slots: np.ndarray) -> None:
        """Called after ``last_access``/``hits`` of ``slots`` were bumped."""

    def on_remove(self, st: SlotState, slots: np.ndarray, evicted: bool) -> None:
        """Called before ``slots`` stop being resident (``evicted``: chosen by ``choose``)."""

    def on_miss(self, st: SlotState, key64s: np.ndarray) -> None:
        """Called by ``evict(..., incoming=key64s)`` before choosing: these keys missed and will be
        inserted next."""

    @abc.abstractmethod
    def choose(self, st: SlotState, n: int, candidates: np.ndarray) -> np.ndarray:
        """Return up to ``n`` distinct victim slots among ``candidates`` (bool mask over slots).

        May update the policy's own bookkeeping (a clock hand, reference bits, queue membership);
        the victims are then removed by ``evict``.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register(cls: type[EvictionPolicy] | None = None, *, name: str | None = None) -> Callable:
    """Class decorator adding an eviction policy to the registry under ``name`` (default cls.name)."""

    def wrap(c: type[EvictionPolicy]) -> type[EvictionPolicy]:
        key = name or c.name
        if not key:
            raise InvalidInput(f"{c.__name__} has no name")
        _REGISTRY[key] = c
        return c

    return wrap(cls) if cls is not None else wrap


def names() -> list[str]:
    """Registered eviction policy names."""
    return sorted(_REGISTRY)


def make(spec: str | EvictionPolicy, **params) -> EvictionPolicy:
    """Build a policy from its name (``"lru"``, ``"prefix_aware:s3fifo"``, ...) or pass one through.

    Args:
        spec: a registered name; ``wrapper:inner`` builds a wrapping policy (``prefix_aware``) over
            another one; ``"package.module:Class"`` imports a policy class (and registers it under its
            ``name``, so that processes attaching to a segment that uses it find it by name); an
            ``EvictionPolicy`` instance is returned as is. Names not registered are also looked up
            in the installed packages' ``tieredkv.policies`` entry points.
        **params: the policy's parameters (e.g. ``small_ratio=0.1`` for S3-FIFO).

    Raises:
        UnknownPolicy: the name (or the inner name) is not registered, or ``module:Class`` cannot be
            imported or is not an ``EvictionPolicy``; the message lists the valid names.
        TypeError: a parameter the policy does not take.
    """
    if isinstance(spec, EvictionPolicy):
        return spec
    if not isinstance(spec, str):
        raise InvalidInput(f"a policy is a name or an EvictionPolicy, got {type(spec).__name__}")
    base_name, _, inner = spec.partition(":")
    if base_name not in _REGISTRY:
        _load_entry_points()
    if base_name not in _REGISTRY and _MODULE_CLASS.match(spec):
        return import_policy(spec)(**params)
    if base_name not in _REGISTRY:
        raise UnknownPolicy(f"unknown eviction policy {spec!r}; valid: {', '.join(names())} (or "
                            "'package.module:Class' for a policy of your own)")
    cls = _REGISTRY[base_name]
    if inner:
        return cls(base=make(inner), **params)
    return cls(**params)


def import_policy(path: str) -> type[EvictionPolicy]:
    """Import the policy class ``"package.module:Class"`` and register it under its ``name``.

    Raises:
        UnknownPolicy: the module cannot be imported, has no such class, or the class is not an
            ``EvictionPolicy`` subclass with a ``name``.
    """
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as e:
        raise UnknownPolicy(f"eviction policy {path!r}: cannot import {module_name!r} ({e}); is it on the "
                            "Python path (the current directory for the tieredkv command)?") from None
    except AttributeError:
        raise UnknownPolicy(f"eviction policy {path!r}: module {module_name!r} has no {attr!r}") from None
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)) or not getattr(obj, "name", ""):
        raise UnknownPolicy(f"eviction policy {path!r} is not an EvictionPolicy subclass with a name")
    if _REGISTRY.get(obj.name) not in (None, obj):
        raise UnknownPolicy(f"eviction policy {path!r}: the name {obj.name!r} is taken by "
                            f"{_REGISTRY[obj.name].__module__}.{_REGISTRY[obj.name].__qualname__}")
    _REGISTRY[obj.name] = obj
    return obj


def _load_entry_points() -> None:
    """Register the policies of installed packages (group ``tieredkv.policies``), once per process.

    A broken entry point is skipped: one bad plugin must not make the built-in policies unusable.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = import_policy(ep.value)
        except UnknownPolicy:
            continue
        _REGISTRY.setdefault(ep.name, cls)


# ---- the operations homes call ------------------------------------------------------------------
def _int64s(values, n: int) -> np.ndarray:
    """``values`` (an array or a scalar) as ``n`` contiguous int64s, for the compiled kernels."""
    a = np.asarray(values, dtype=np.int64)
    if a.shape == (n,):
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(np.broadcast_to(a, (n,)))


def insert(policy: EvictionPolicy, st: SlotState, slots: np.ndarray, key64: np.ndarray,
           parents: np.ndarray, positions: np.ndarray) -> None:
    """Make ``slots`` resident. ``parents``: parent slot per block or -1. Under the home's lock."""
    slots = np.asarray(slots, dtype=np.int64)
    if not len(slots):
        return
    if _jit.ENABLED:
        end = st.add_g("tick", len(slots))
        _jit.insert_common(st.resident, st.key64, st.last_access, st.insert_tick, st.hits, st.n_children,
                           st.position, st.parent, slots,
                           np.asarray(key64, dtype=np.uint64).view(np.int64).reshape(len(slots)),
                           _int64s(parents, len(slots)), _int64s(positions, len(slots)), end - len(slots) + 1)
        st.add_g("n_resident", len(slots))
        policy.on_insert(st, slots)
        return
    ticks = st.advance(len(slots))
    st.resident[slots] = 1
    st.key64[slots] = np.asarray(key64, dtype=np.uint64).view(np.int64)
    st.last_access[slots] = ticks
    st.insert_tick[slots] = ticks
    st.hits[slots] = 0
    st.n_children[slots] = 0
    st.position[slots] = positions
    parents = np.asarray(parents, dtype=np.int64)
    # A parent only counts if it is resident (it may be in the same batch, inserted just above).
    valid = parents >= 0
    if valid.any():
        valid[valid] = st.resident[parents[valid]] == 1
        st.parent[slots] = np.where(valid, parents, -1)
        np.add.at(st.n_children, parents[valid], 1)
    else:
        st.parent[slots] = -1
    st.add_g("n_resident", len(slots))
    policy.on_insert(st, slots)


def hit(policy: EvictionPolicy, st: SlotState, slots: np.ndarray) -> None:
    """Record hits on resident ``slots``. Relaxed: plain aligned stores, safe without the lock."""
    slots = np.asarray(slots, dtype=np.int64)
    if not len(slots):
        return
    st.last_access[slots] = st.advance(len(slots))
    st.hits[slots] += 1
    policy.on_hit(st, slots)


def remove(policy: EvictionPolicy, st: SlotState, slots: np.ndarray, *, evicted: bool = False) -> None:
    """Stop tracking ``slots`` (resident ones only). Under the home's lock."""
    slots = np.asarray(slots, dtype=np.int64)
    slots = slots[st.resident[slots] == 1]
    if not len(slots):
        return
    policy.on_remove(st, slots, evicted)
    if _jit.ENABLED:
        _jit.remove_common(st.resident, st.parent, st.n_children, slots)
        st.add_g("n_resident", -len(slots))
        return
    parents = st.parent[slots]
    live = parents >= 0
    if live.any():
        np.subtract.at(st.n_children, parents[live], 1)
    orphaned = slots[st.n_children[slots] > 0]
    if len(orphaned):
        # Children of a removed block lose their parent link (prefix_aware never gets here). One
        # O(n_slots) pass with a mask: cheaper than a set membership test (np.isin sorts).
        gone = np.zeros(st.n_slots + 1, dtype=bool)   # index -1 (no parent) lands on the spare last entry
        gone[orphaned] = True
        st.parent[gone[st.parent]] = -1
    st.resident[slots] = 0
    st.parent[slots] = -1
    st.n_children[slots] = 0
    st.add_g("n_resident", -len(slots))


def evict(policy: EvictionPolicy, st: SlotState, n: int, evictable: np.ndarray | None = None, *,
          incoming: np.ndarray | None = None) -> np.ndarray:
    """Choose up to ``n`` victims among resident (and ``evictable``) slots and remove them.

    Args:
        policy: the policy.
        st: its state.
        n: victims wanted (0 is fine: ``incoming`` is still recorded).
        evictable: optional bool mask over slots; False slots (pinned, being written) are never chosen.
        incoming: optional key64s that missed and are about to be inserted, oldest first.

    Returns:
        The victim slots (int64, distinct, in eviction order); fewer than ``n`` if too few candidates.
    """
    if incoming is not None:
        incoming = np.asarray(incoming).astype(np.uint64, copy=False).view(np.int64)
        policy.on_miss(st, incoming)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    candidates = st.resident == 1
    if evictable is not None:
        candidates &= evictable
    if not candidates.any():
        return np.zeros(0, dtype=np.int64)
    st.incoming = incoming
    try:
        victims = np.asarray(policy.choose(st, int(n), candidates), dtype=np.int64)
    finally:
        st.incoming = None
    if len(victims) and not candidates[victims].all():
        raise CorruptState(f"policy {policy.name!r} chose a slot that was not a candidate (its state is "
                           f"damaged, or the policy is wrong)")
    if len(victims) > n or (len(victims) > 1 and len(set(victims.tolist())) != len(victims)):
        raise CorruptState(f"policy {policy.name!r} chose {len(victims)} victims for n={n}, or a slot twice (its "
                           f"state is damaged, or the policy is wrong)")
    remove(policy, st, victims, evicted=True)
    return victims
