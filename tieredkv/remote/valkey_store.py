"""A Valkey (or Redis) server as the remote store, over RESP with the ``valkey`` client.

Probe: one pipeline of EXISTS (one round trip for a whole prompt). Reads: one MGET. Writes: one
pipeline of SET. Values are opaque bytes; eviction is the server's (``maxmemory`` with an LRU policy:
an evicted block is simply absent, a clean miss).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from tieredkv.errors import MissingDependency, RemoteUnavailable
from tieredkv.remote.store import Encoder, Sink, Store, float_option, int_option
from tieredkv.tier import PutResult


class ValkeyStore(Store):
    """``valkey://host:port?db=0&ttl_s=0&timeout_s=5``.

    Options:
        db: database number.
        ttl_s: expire values after this many seconds (0: never; let ``maxmemory`` evict).
        timeout_s: socket timeout of one command (the background writer's bound; the request path has
            the remote tier's tighter deadline on top).
    """

    scheme = "valkey"
    options = ("db", "ttl_s", "timeout_s")
    #: Values of one pipelined write are built in a buffer of at most this size (a bigger batch is sent
    #: in several pipelines).
    PUT_BUFFER_BYTES = 32 << 20

    def __init__(self, host: str, port: int, options: dict[str, str]):
        super().__init__(host, port, options)
        try:
            import valkey
        except ImportError:
            raise MissingDependency("valkey:// needs the valkey client: pip install 'tieredkv[remote]'") from None
        self._errors = (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError,
                        valkey.exceptions.ResponseError, OSError)
        self.ttl_s = int_option(options, "ttl_s", 0)
        timeout = float_option(options, "timeout_s", 5.0, minimum=0.001)
        # The connection pool is thread-safe and reconnects on the next command after a server restart.
        self._put_lock = threading.Lock()
        self._put_buf = np.empty(0, dtype=np.uint8)
        self._client = valkey.Valkey(host=host, port=port, db=int_option(options, "db", 0),
                                     socket_timeout=timeout, socket_connect_timeout=timeout)

    def _run(self, what: str, fn):
        try:
            return fn()
        except self._errors as e:
            raise RemoteUnavailable(f"{self.url}: {what} failed: {e}") from None

    def exists_many(self, names: list[str]) -> np.ndarray:
        def probe():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        return np.asarray(self._run("EXISTS", probe) if names else [], dtype=bool)

    def get_many(self, names: list[str], max_bytes: int, sink: Sink) -> None:
        if not names:
            return
        values = self._run("MGET", lambda: self._client.mget(names))
        for i, value in enumerate(values):
            sink(i, None if value is None or len(value) > max_bytes else memoryview(value))

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
                        pipe.set(names[j], value, ex=self.ttl_s or None, nx=True)
                    # An OOM refusal (maxmemory with noeviction) is a per-command error, not a dead server.
                    return pipe.execute(raise_on_error=False)

                for j, reply in zip(batch, self._run("SET", put)):
                    codes[j] = (PutResult.STORED if reply is True else PutResult.EXISTS if reply is None
                                else PutResult.NO_SPACE)
        return codes

    def delete_many(self, names: list[str]) -> int:
        return int(self._run("DEL", lambda: self._client.delete(*names))) if names else 0

    def scan(self, prefix: str) -> Iterator[str]:
        try:
            for name in self._client.scan_iter(match=prefix + "*", count=1000):
                yield name.decode()
        except self._errors as e:
            raise RemoteUnavailable(f"{self.url}: SCAN failed: {e}") from None

    def info(self) -> dict:
        mem = self._run("INFO", lambda: self._client.info("memory"))
        return {"url": self.url, "names": int(self._run("DBSIZE", self._client.dbsize)),
                "used_memory_bytes": int(mem.get("used_memory", 0)),
                "maxmemory_bytes": int(mem.get("maxmemory", 0)),
                "maxmemory_policy": str(mem.get("maxmemory_policy", ""))}

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
