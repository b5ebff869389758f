"""A Valkey (or Redis) server as the remote store, over RESP with the ``valkey`` client.

Probe: one pipeline of EXISTS (one round trip for a whole prompt). Reads: one pipeline of GETRANGE
bounded to one byte past the largest value a spec may have, so an oversized value is recognised without
being transferred whole. Writes: one pipeline of SET. Values are opaque bytes; eviction is the server's
(``maxmemory`` with an LRU policy: an evicted block is simply absent, a clean miss).

Access control: the server's ACL user and password (``AUTH user password``) and TLS, as the ``valkey``
client does them. The password comes from a file or the environment, like the fleet secret.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from tieredkv import forksafe
from tieredkv.errors import InvalidInput, MissingDependency, RemoteUnavailable
from tieredkv.remote.store import OVERSIZED, Encoder, Sink, Store, float_option, int_option, read_secret_option
from tieredkv.tier import PutResult


class ValkeyStore(Store):
    """``valkey://[user@]host:port?db=0&ttl_s=0&timeout_s=5&password_file=PATH&tls=1``.

    Options:
        db: database number.
        ttl_s: expire values after this many seconds (0: never; let ``maxmemory`` evict).
        timeout_s: socket timeout of one command (the background writer's bound; the request path has
            the remote tier's tighter deadline on top).
        username: the ACL user (also ``user@`` in the URL); default: the server's default user.
        password_file: a file holding the user's password (else ``TIEREDKV_REMOTE_PASSWORD``; a password
            in the URL's ``user:password@`` works too, but lands on command lines and in logs).
        tls: 1 to speak TLS (``valkeys://`` and ``rediss://`` set it); ``tls_ca``, ``tls_cert``,
            ``tls_key``: the CA bundle to trust and this client's certificate and key (files).
    """

    scheme = "valkey"
    options = ("db", "ttl_s", "timeout_s", "username", "password", "password_file", "tls", "tls_ca", "tls_cert",
               "tls_key")
    #: Values of one pipelined write are built in a buffer of at most this size (a bigger batch is sent
    #: in several pipelines).
    PUT_BUFFER_BYTES = 32 << 20

    def __init__(self, host: str, port: int, options: dict[str, str]):
        super().__init__(host, port, options)
        try:
            import valkey
        except ImportError:
            raise MissingDependency("valkey:// needs the valkey client: pip install 'tieredkv[remote]'") from None
        # Every failure of the client is the store's, not the caller's: a refused, reset or stalled
        # connection, and also a reply the client cannot parse (a damaged stream, a proxy in between),
        # which surfaces as any of these.
        self._errors = (valkey.exceptions.ValkeyError, OSError, ValueError, TypeError, IndexError, KeyError,
                        AttributeError, UnicodeError)
        self.ttl_s = int_option(options, "ttl_s", 0)
        timeout = float_option(options, "timeout_s", 5.0, minimum=0.001)
        password = read_secret_option(options, "password", "TIEREDKV_REMOTE_PASSWORD")
        tls = options.get("tls", "0")
        if tls not in ("0", "1", "true", "false"):
            raise InvalidInput(f"URL option tls={tls!r} must be 0 or 1")
        tls_kw: dict[str, Any] = {}
        if tls in ("1", "true"):
            tls_kw = {"ssl": True, "ssl_ca_certs": options.get("tls_ca"), "ssl_certfile": options.get("tls_cert"),
                      "ssl_keyfile": options.get("tls_key")}
        elif any(k in options for k in ("tls_ca", "tls_cert", "tls_key")):
            raise InvalidInput("URL options tls_ca/tls_cert/tls_key need tls=1 (or a valkeys:// URL)")
        # The connection pool is thread-safe and reconnects on the next command after a server restart.
        self._put_lock = threading.Lock()
        forksafe.register(self)  # unlocked in a forked child; the client's pool renews itself after fork
        self._put_buf = np.empty(0, dtype=np.uint8)
        self._client = valkey.Valkey(host=host, port=port, db=int_option(options, "db", 0),
                                     username=options.get("username") or None, password=password,
                                     socket_timeout=timeout, socket_connect_timeout=timeout, **tls_kw)

    def _run(self, what: str, fn):
        try:
            return fn()
        except self._errors as e:
            raise RemoteUnavailable(f"{self.url}: {what} failed: {e}") from None

    def exists_many(self, names: list[str]) -> np.ndarray:
        def probe():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(_wire(name))
            return np.asarray([_integer(r) for r in pipe.execute()], dtype=bool)

        return self._run("EXISTS", probe) if names else np.zeros(0, dtype=bool)

    def _empty_strings(self, names: list[str]) -> np.ndarray:
        """Per name: an empty string is stored under it now (EXISTS and STRLEN in one transaction)."""
        def probe():
            pipe = self._client.pipeline(transaction=True)
            for name in names:
                pipe.exists(_wire(name))
                pipe.strlen(_wire(name))
            replies = [_integer(r) for r in pipe.execute()]
            return np.asarray([e == 1 and n == 0 for e, n in zip(replies[0::2], replies[1::2])], dtype=bool)

        return self._run("EXISTS", probe)

    def get_many(self, names: list[str], max_bytes: int, sink: Sink) -> None:
        if not names:
            return

        def read():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.getrange(_wire(name), 0, max_bytes)  # at most max_bytes + 1 bytes cross the wire
            # A per-name error (a name of another type) is that name's problem, not the store's.
            return pipe.execute(raise_on_error=False)

        values = self._run("GETRANGE", read)
        if len(values) != len(names):
            raise RemoteUnavailable(f"{self.url}: {len(values)} replies to {len(names)} reads")
        # An empty reply is an absent name or an empty string under it; only the latter, which no writer
        # could ever replace (SET NX), is worth a second round trip to tell apart. A name another host
        # set since the read is neither: a miss this time (counting it corrupt deleted a good value).
        empty = [i for i, v in enumerate(values) if isinstance(v, bytes) and not v]
        held = self._empty_strings([names[i] for i in empty]) if empty else np.zeros(0, dtype=bool)
        present = {i for i, h in zip(empty, held) if h}
        for i, value in enumerate(values):
            if (isinstance(value, Exception) or not isinstance(value, bytes) or len(value) > max_bytes
                    or i in present):
                sink(i, OVERSIZED)  # no value of ours: refused as corrupt, and deleted
            else:
                sink(i, memoryview(value) if value else None)

    def put_many(self, names: list[str], max_bytes: int, encode: Encoder) -> np.ndarray:
        codes = np.zeros(len(names), dtype=np.int8)
        per = max(1, self.PUT_BUFFER_BYTES // max_bytes)
        with self._put_lock:
            for start in range(0, len(names), per):
                batch = range(start, min(start + per, len(names)))
                # Values are built in one reused buffer: fresh buffers per value cost a page fault per
                # 4 KiB on every put. The pipeline has sent them all when execute() returns.
                if self._put_buf.nbytes < len(batch) * max_bytes:
                    self._put_buf = np.empty(len(batch) * max_bytes, dtype=np.uint8)
                values = [encode(j, self._put_buf[k * max_bytes:(k + 1) * max_bytes]) for k, j in enumerate(batch)]

                def put(batch=batch, values=values):
                    pipe = self._client.pipeline(transaction=False)
                    for j, value in zip(batch, values):
                        pipe.set(_wire(names[j]), value, ex=self.ttl_s or None, nx=True)
                    # An OOM refusal (maxmemory with noeviction) is a per-command error, not a dead server.
                    return pipe.execute(raise_on_error=False)

                for j, reply in zip(batch, self._run("SET", put)):
                    codes[j] = (PutResult.STORED if reply is True else PutResult.EXISTS if reply is None
                                else PutResult.NO_SPACE)
        return codes

    def delete_many(self, names: list[str]) -> int:
        return _integer(self._run("DEL", lambda: self._client.delete(*map(_wire, names)))) if names else 0

    def scan(self, prefix: str) -> Iterator[str]:
        try:
            for name in self._client.scan_iter(match=prefix + "*", count=1000):
                # Any client may write any name: one that is not UTF-8 still comes back (and goes out
                # again in _wire) byte for byte.
                yield name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else str(name)
        except self._errors as e:
            raise RemoteUnavailable(f"{self.url}: SCAN failed: {e}") from None

    def info(self) -> dict:
        def ask():
            mem = self._client.info("memory")
            return {"url": self.url, "names": _integer(self._client.dbsize()),
                    "used_memory_bytes": _integer(mem.get("used_memory", 0)),
                    "maxmemory_bytes": _integer(mem.get("maxmemory", 0)),
                    "maxmemory_policy": str(mem.get("maxmemory_policy", ""))}

        return self._run("INFO", ask)

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass


def _wire(name: str) -> bytes:
    """A name as the server has it (names read by ``scan`` may hold bytes that are not UTF-8)."""
    return name.encode("utf-8", "surrogateescape")


def _integer(reply) -> int:
    """An integer reply, or ValueError (a reply of another kind: a damaged stream)."""
    if isinstance(reply, bool) or not isinstance(reply, (int, bytes, str)):
        raise ValueError(f"expected an integer reply, got {type(reply).__name__}")
    return int(reply)
