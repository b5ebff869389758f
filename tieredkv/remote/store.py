"""The client side of a remote store: the few calls the remote tier needs, and the URL that names one.

```
RemoteTier ──names, values──► Store ──► ValkeyStore   (RESP: pipelined EXISTS, MGET, pipelined SET)
                                    └─► MooncakeStore (batch_is_exist, batch_get_into / batch_put_from
                                                       on registered buffers)
```

A store moves opaque values under string names; it knows nothing of blocks or keys. Every call either
answers or raises ``RemoteUnavailable`` (refused, reset, timed out): the tier above decides that this
is a miss. A store reconnects by itself on a later call once the server is back.
"""

from __future__ import annotations

import abc
import ipaddress
import math
import re
import urllib.parse
from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np

from tieredkv.errors import InvalidInput, Unsupported

#: ``encode(i, into)``: value ``i``'s bytes, built in ``into`` (a uint8 array) when given.
Encoder = Callable[[int, "np.ndarray | None"], memoryview]
#: ``sink(i, value)``: called by ``get_many`` for each name in order; ``value`` is a read-only view of
#: the value's bytes, valid only during the call, or ``None`` when the store does not hold that name.
Sink = Callable[[int, "memoryview | None"], None]


class Store(abc.ABC):
    """A connection to one remote store. Thread-safe: the request path and the background writer
    share one.

    Args:
        host, port: the server (the Valkey server, the Mooncake master's RPC address).
        options: store-specific options from the URL's query string (strings).
    """

    scheme: ClassVar[str] = ""
    #: Options this store understands (an unknown one is an error naming these).
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, host: str, port: int, options: dict[str, str]):
        unknown = set(options) - set(self.options)
        if unknown:
            raise InvalidInput(f"unknown {self.scheme}:// option(s) {sorted(unknown)}; valid: {sorted(self.options)}")
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def connect(self) -> None:
        """Set up the connection now rather than inside the first deadline-bound call (best effort:
        raises ``RemoteUnavailable``, and the next call tries again). Default: connect lazily."""

    @abc.abstractmethod
    def exists_many(self, names: list[str]) -> np.ndarray:
        """Bool per name: the store holds it. One round trip."""

    @abc.abstractmethod
    def get_many(self, names: list[str], max_bytes: int, sink: Sink) -> None:
        """Fetch values (each at most ``max_bytes``) in as few round trips as the store allows and hand
        each to ``sink`` in order."""

    @abc.abstractmethod
    def put_many(self, names: list[str], max_bytes: int, encode: Encoder) -> np.ndarray:
        """Store one value per name; a ``PutResult`` code (int8) per name: ``STORED``, ``EXISTS`` (the
        store already holds that name) or ``NO_SPACE`` (the store refused it, e.g. full).

        ``encode(i, into)`` builds value ``i`` (at most ``max_bytes``) and returns a view of it; ``into``
        is a uint8 buffer the store will send from (registered memory: no copy), or None."""

    @abc.abstractmethod
    def delete_many(self, names: list[str]) -> int:
        """Delete names; return how many existed (as far as the store can tell)."""

    def scan(self, prefix: str) -> Iterator[str]:
        """Names that start with ``prefix`` (administration: ``tieredkv ls/verify --remote``)."""
        raise Unsupported(f"a {self.scheme}:// store cannot list its names; use a valkey:// store for "
                           f"ls and verify")

    @abc.abstractmethod
    def info(self) -> dict:
        """What the server says about itself (memory used and allowed, names held), for ``stats``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the connection. Idempotent."""


def parse_url(url: str) -> tuple[str, str, int, dict[str, str]]:
    """Split ``scheme://host:port?opt=value&...`` into its parts, or raise naming what is wrong."""
    if not isinstance(url, str):
        raise InvalidInput(f"remote must be a URL string or a RemoteTier, got {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in STORES:
        raise InvalidInput(f"remote URL {url!r}: unknown scheme {parts.scheme!r}; use one of "
                           f"{sorted(s + '://host:port' for s in STORES)}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise InvalidInput(f"remote URL {url!r} needs a host and a port, e.g. {parts.scheme}://127.0.0.1:6379")
    if not _host_ok(parts.hostname):
        # An over-long label fails in the resolver on every call, not here: refuse it here, once.
        raise InvalidInput(f"remote URL {url!r}: {parts.hostname!r} is not a host name (labels of 1-63 letters, "
                           f"digits or '-', at most 253 characters) nor an IP address")
    if parts.path not in ("", "/"):
        raise InvalidInput(f"remote URL {url!r}: no path expected after host:port")
    options = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
    return parts.scheme, parts.hostname, port, options


def _host_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_LABEL_RE.fullmatch(label) for label in labels)


_LABEL_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def open_store(scheme: str, host: str, port: int, options: dict[str, str]) -> Store:
    """Instantiate the store class registered for ``scheme`` (imports its client library lazily)."""
    import importlib

    module, cls = STORES[scheme]
    return getattr(importlib.import_module(module), cls)(host, port, options)


#: scheme -> (module, class). A new store is one module and one line here.
STORES = {
    "valkey": ("tieredkv.remote.valkey_store", "ValkeyStore"),
    "redis": ("tieredkv.remote.valkey_store", "ValkeyStore"),
    "mooncake": ("tieredkv.remote.mooncake_store", "MooncakeStore"),
}


def int_option(options: dict[str, str], name: str, default: int, minimum: int = 0) -> int:
    """An integer URL option, or raise naming it."""
    return _option(options, name, default, minimum, int, "an integer")


def float_option(options: dict[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    """A float URL option, or raise naming it."""
    return _option(options, name, default, minimum, float, "a number")


def _option(options: dict[str, str], name: str, default, minimum, kind, what: str):
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise InvalidInput(f"URL option {name}={raw!r} must be {what}") from None
    if not value >= minimum or not math.isfinite(value):  # also refuses NaN, and inf (no bound at all)
        raise InvalidInput(f"URL option {name}={value} must be a finite number >= {minimum}")
    return value
