"""Eviction, promotion and demotion policies (installed as ``tieredkv.policies``).

Policies see only the struct-of-arrays slot state (``state.SlotState``), never a tier, so the same code
decides in the hot tier's shared memory and in the offline simulator.
"""

from .base import EvictionPolicy, UnknownPolicy, evict, hit, insert, make, names, register, remove
from .state import SlotState, StateLayout
from . import lru  # noqa: F401  (registers)

__all__ = ["EvictionPolicy", "SlotState", "StateLayout", "UnknownPolicy", "evict", "hit", "insert",
           "make", "names", "register", "remove"]
