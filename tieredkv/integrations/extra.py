"""``TieredCache`` arguments from an engine's free-form extra config (vLLM's ``kv_connector_extra_config``,
SGLang's ``--hicache-storage-backend-extra-config``). No engine import here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tieredkv.config import KEYWORDS
from tieredkv.errors import InvalidInput
from tieredkv.spec import parse_bytes

#: Hot-tier size when the config gives neither ``hot_bytes`` nor ``hot_blocks``.
DEFAULT_HOT_BYTES = 1 << 30


def cache_kwargs(extra: Mapping[str, Any] | None, *, own_keys: tuple[str, ...] = (),
                 what: str = "extra config") -> dict[str, Any]:
    """``TieredCache`` keyword arguments from an engine's extra-config mapping.

    Every ``TieredCache`` keyword (``tieredkv.config.KEYWORDS``) passes through unchanged (so options
    added later work from the engine's config with no change here); ``*_bytes`` values are parsed as
    sizes ("8G").
    ``own_keys`` are the integration's own keys: allowed, not passed on.

    Raises:
        InvalidInput: an unknown key (the message lists the valid ones) or a malformed size.
    """
    extra = dict(extra or {})
    accepted = list(KEYWORDS)
    unknown = sorted(set(extra) - set(accepted) - set(own_keys))
    if unknown:
        raise InvalidInput(f"unknown {what} keys {unknown}; valid keys: {sorted([*accepted, *own_keys])}")
    kwargs = {name: extra[name] for name in accepted if name in extra}
    for name, value in kwargs.items():
        if name.endswith("_bytes") and value is not None:
            kwargs[name] = parse_bytes(value, what=name)
    if kwargs.get("hot_bytes") is None and kwargs.get("hot_blocks") is None:
        kwargs["hot_bytes"] = DEFAULT_HOT_BYTES
    return kwargs
