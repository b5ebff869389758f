"""Mooncake Store as the remote store (``mooncake-transfer-engine-non-cuda``; TCP on CPU-only hosts).

The master (``mooncake_master``) keeps the object metadata; memory is contributed by "holder" clients
(``mooncake_client``, or any client set up with a global segment). This client contributes none by
default: a worker should not hold the fleet's cache in its own address space, where its restart would
drop it.

Reads and writes move through two buffers registered once with the transfer engine, so the engine
copies straight between the holders and these buffers (``batch_get_into`` / ``batch_put_from``): no
Python bytes object per value.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np

from tieredkv.errors import InvalidInput, MissingDependency, RemoteUnavailable
from tieredkv.remote.store import Encoder, Sink, Store, int_option
from tieredkv.tier import PutResult

#: Mooncake's "object not found" error code (OBJECT_NOT_FOUND): a clean miss, not a failure.
_NOT_FOUND = -704


class MooncakeStore(Store):
    """``mooncake://master_host:rpc_port?local=127.0.0.1&segment_mb=0&buffer_mb=64&batch_mb=32``.

    Options:
        local: this client's address as the other clients see it (where its transfer engine listens).
        segment_mb: memory this client contributes to the store (0: a pure client).
        buffer_mb: the client's own transfer buffer.
        batch_mb: size of each of the two registered buffers (one for reads, one for writes); a batch
            larger than that is moved in several calls.
        protocol: the transfer engine's protocol (``tcp``; ``rdma`` where the hardware has it).
    """

    scheme = "mooncake"
    options = ("local", "segment_mb", "buffer_mb", "batch_mb", "protocol")

    def __init__(self, host: str, port: int, options: dict[str, str]):
        super().__init__(host, port, options)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise MissingDependency(f"mooncake:// needs mooncake-transfer-engine-non-cuda (pip install "
                               f"'tieredkv[remote]') and Debian's libibverbs1 ({e})") from None
        self._cls = MooncakeDistributedStore
        self.local = options.get("local", "127.0.0.1")
        self.segment_bytes = int_option(options, "segment_mb", 0) << 20
        self.buffer_bytes = int_option(options, "buffer_mb", 64, minimum=1) << 20
        self.batch_bytes = int_option(options, "batch_mb", 32, minimum=1) << 20
        self.protocol = options.get("protocol", "tcp")
        self._lock = threading.Lock()      # connect / close
        self._get_lock = threading.Lock()  # the read buffer
        self._put_lock = threading.Lock()  # the write buffer
        self._store = None
        self._closed = False
        self._pid = os.getpid()
        self._get_buf = np.empty(0, dtype=np.uint8)
        self._put_buf = np.empty(0, dtype=np.uint8)

    # ---- connection -------------------------------------------------------------------------------
    def _client(self):
        """The connected client; (re)connects on first use, after a failed setup and after fork."""
        with self._lock:
            if self._closed:
                raise RemoteUnavailable(f"{self.url}: this client is closed")
            if self._pid != os.getpid():  # the engine's threads did not survive fork: start afresh
                self._store, self._pid = None, os.getpid()
            if self._store is None:
                # setup() keeps the GIL while it retries a master that does not answer (about 90 s,
                # measured): no deadline could cut that short, so see first that the master listens.
                try:
                    socket.create_connection((self.host, self.port), timeout=1.0).close()
                except OSError as e:
                    raise RemoteUnavailable(f"{self.url}: the master does not answer ({e})") from None
                store = self._cls()
                rc = store.setup(self.local, "P2PHANDSHAKE", self.segment_bytes, self.buffer_bytes,
                                 self.protocol, "", f"{self.host}:{self.port}")
                if rc != 0:
                    raise RemoteUnavailable(f"{self.url}: setup failed (rc={rc}); is mooncake_master running?")
                get_buf = np.zeros(self.batch_bytes, dtype=np.uint8)
                put_buf = np.zeros(self.batch_bytes, dtype=np.uint8)
                for buf in (get_buf, put_buf):
                    rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
                    if rc != 0:
                        raise RemoteUnavailable(f"{self.url}: register_buffer failed (rc={rc})")
                if self._closed:  # closed while this setup ran: give the new client back at once
                    store.close()
                    raise RemoteUnavailable(f"{self.url}: closed")
                self._store, self._get_buf, self._put_buf = store, get_buf, put_buf
            return self._store

    def connect(self) -> None:
        self._client()  # setup and buffer registration take long next to a deadline: do them up front

    def _batches(self, n: int, slot_bytes: int) -> list[range]:
        per = max(1, self.batch_bytes // slot_bytes)
        if slot_bytes > self.batch_bytes:
            raise InvalidInput(f"a {slot_bytes}-byte value does not fit the {self.batch_bytes}-byte "
                               f"transfer buffer; raise the URL's batch_mb")
        return [range(i, min(i + per, n)) for i in range(0, n, per)]

    # ---- calls -------------------------------------------------------------------------------------
    def exists_many(self, names: list[str]) -> np.ndarray:
        if not names:
            return np.zeros(0, dtype=bool)
        codes = self._client().batch_is_exist(names)
        if any(c < 0 for c in codes):
            raise RemoteUnavailable(f"{self.url}: batch_is_exist failed (codes {sorted(set(codes))})")
        return np.asarray(codes, dtype=np.int64) == 1

    def get_many(self, names: list[str], max_bytes: int, sink: Sink) -> None:
        store = self._client()
        with self._get_lock:
            base = self._get_buf.ctypes.data
            for batch in self._batches(len(names), max_bytes):
                offsets = [(j - batch.start) * max_bytes for j in batch]
                sizes = store.batch_get_into([names[j] for j in batch], [base + o for o in offsets],
                                             [max_bytes] * len(batch))
                for j, off, size in zip(batch, offsets, sizes):
                    if size == _NOT_FOUND:
                        sink(j, None)
                    elif size < 0:
                        raise RemoteUnavailable(f"{self.url}: batch_get_into failed (rc={size})")
                    else:
                        sink(j, self._get_buf[off:off + size].data.toreadonly())

    def put_many(self, names: list[str], max_bytes: int, encode: Encoder) -> np.ndarray:
        codes = np.full(len(names), PutResult.NO_SPACE, dtype=np.int8)
        if not names:
            return codes
        store = self._client()
        with self._put_lock:
            base = self._put_buf.ctypes.data
            for batch in self._batches(len(names), max_bytes):
                offsets = [(j - batch.start) * max_bytes for j in batch]
                # Values are built straight in registered memory: the engine sends from there.
                sizes = [len(encode(j, self._put_buf[off:off + max_bytes])) for j, off in zip(batch, offsets)]
                rcs = store.batch_put_from([names[j] for j in batch], [base + o for o in offsets], sizes)
                if rcs and all(c < 0 for c in rcs):
                    # Nothing of the batch went in: the master is gone or no holder has room. A single
                    # refusal among successes is the store declining that value (False, not raised).
                    raise RemoteUnavailable(f"{self.url}: batch_put_from failed (codes {sorted(set(rcs))})")
                # Mooncake answers 0 for a name it already holds too: both are "the store has it".
                codes[batch.start:batch.stop][np.asarray(rcs, dtype=np.int64) == 0] = PutResult.STORED
        return codes

    def delete_many(self, names: list[str]) -> int:
        store = self._client()
        # force=True: a value just written holds a lease for a few seconds; a corrupt value must go now.
        return sum(1 for name in names if store.remove(name, True) == 0)

    def info(self) -> dict:
        self._client()
        return {"url": self.url, "local": self.local, "segment_bytes": self.segment_bytes}

    def close(self) -> None:
        self._closed = True
        # A setup in progress holds the lock (against a dead master, for about 90 s): do not wait for
        # it; it closes its client itself when it sees _closed.
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            store, self._store = self._store, None
        finally:
            self._lock.release()
        if store is not None and self._pid == os.getpid():
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closing a client of a dead master may fail: nothing to keep
                pass
