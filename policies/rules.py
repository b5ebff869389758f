"""A tiny registry for the tier-movement rules (promotion, demotion).

A rule is a small object built from a name with an optional integer argument
(``"on_nth_hit:2"``); each rule family (``promotion``, ``demotion``) has its own ``RuleRegistry``.
"""

from __future__ import annotations

from collections.abc import Callable

from tieredkv.errors import InvalidInput

from .base import UnknownPolicy


class RuleRegistry:
    """Rules of one family by name.

    Args:
        kind: what the rules decide, for error messages (``"promotion"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._rules: dict[str, type] = {}

    def register(self, cls: type | None = None, *, name: str | None = None) -> Callable:
        """Class decorator adding a rule under ``name`` (default ``cls.name``)."""

        def wrap(c: type) -> type:
            key = name or getattr(c, "name", "")
            if not key:
                raise InvalidInput(f"{c.__name__} has no name")
            self._rules[key] = c
            return c

        return wrap(cls) if cls is not None else wrap

    def names(self) -> list[str]:
        """Registered rule names."""
        return sorted(self._rules)

    def make(self, spec, **params):
        """Build a rule from ``"name"`` or ``"name:N"`` (N an integer argument), or pass one through.

        Raises:
            UnknownPolicy: the name is not registered; the message lists the valid ones.
            ValueError: the argument after ``:`` is not an integer.
        """
        if not isinstance(spec, str):
            if any(isinstance(spec, c) for c in self._rules.values()):
                return spec
            raise InvalidInput(f"a {self.kind} rule is a name or a rule object, got {type(spec).__name__}")
        base, sep, arg = spec.partition(":")
        cls = self._rules.get(base)
        if cls is None:
            raise UnknownPolicy(f"unknown {self.kind} rule {spec!r}; valid: {', '.join(self.names())}")
        if not sep:
            return cls(**params)
        try:
            n = int(arg)
        except ValueError:
            raise InvalidInput(f"{self.kind} rule {spec!r}: the part after ':' must be an integer") from None
        return cls(n, **params)
