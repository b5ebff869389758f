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

import contextlib
import os
import socket
import threading

import numpy as np

from tieredkv import forksafe
from tieredkv.errors import InvalidInput, MissingDependency, RemoteUnavailable
from tieredkv.remote.store import OVERSIZED, Encoder, Sink, Store, int_option
from tieredkv.tier import PutResult

#: Mooncake's "object not found" error code (OBJECT_NOT_FOUND): a clean miss, not a failure.
_NOT_FOUND = -704
#: REPLICA_IS_NOT_READY: another client's put of that name has started and not ended. A miss for now,
#: as Mooncake's own clients take it, not the store failing.
_NOT_READY = -703
#: The code ``batch_get_into`` gives one name whose object is larger than its buffer (the client logs
#: "Buffer too small"): no value of ours, which the tier refuses and deletes, not a failed store.
_TOO_BIG = -600
#: How long ``close`` waits for a call in flight before abandoning the native client to it.
CLOSE_WAIT_S = 10.0


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
        #: Native clients ``close`` could not close because a call was still using them: kept alive (a
        #: client freed under a running call crashes the process), dropped with the process.
        self._abandoned: list = []
        self._users = 0  # calls running on the native client (close waits for them)
        self._idle = threading.Condition(threading.Lock())
        self._pid = os.getpid()
        self._get_buf = np.empty(0, dtype=np.uint8)
        self._put_buf = np.empty(0, dtype=np.uint8)
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        # Locks are fresh (tieredkv.forksafe); the calls that were running were the parent's threads.
        # The parent's client is of no use here (the engine's threads did not survive) and freeing it
        # could touch what those threads held: keep it, unused; the next call sets up our own.
        self._users = 0
        if self._store is not None:
            self._abandoned.append((self._store, self._get_buf, self._put_buf))
        self._store, self._pid = None, os.getpid()

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

    @contextlib.contextmanager
    def _using(self):
        """The connected client, counted as in use until the block ends: ``close`` does not free a
        client (nor its registered buffers) while a native call runs on it."""
        # Counted before the client is taken: close() sets _closed first and then waits for the count,
        # so either this call sees _closed (and raises) or close() sees this call (and waits).
        with self._idle:
            self._users += 1
        try:
            yield self._client()
        finally:
            with self._idle:
                self._users -= 1
                self._idle.notify_all()

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
        with self._using() as store:
            codes = store.batch_is_exist(names)
        if any(c < 0 for c in codes):
            raise RemoteUnavailable(f"{self.url}: batch_is_exist failed (codes {sorted(set(codes))})")
        return np.asarray(codes, dtype=np.int64) == 1

    def get_many(self, names: list[str], max_bytes: int, sink: Sink) -> None:
        with self._get_lock, self._using() as store:
            base = self._get_buf.ctypes.data
            for batch in self._batches(len(names), max_bytes):
                offsets = [(j - batch.start) * max_bytes for j in batch]
                sizes = store.batch_get_into([names[j] for j in batch], [base + o for o in offsets],
                                             [max_bytes] * len(batch))
                for j, off, size in zip(batch, offsets, sizes):
                    if size in (_NOT_FOUND, _NOT_READY):
                        sink(j, None)
                    elif size == _TOO_BIG:
                        sink(j, OVERSIZED)
                    elif size < 0 or size > max_bytes:
                        raise RemoteUnavailable(f"{self.url}: batch_get_into failed (rc={size})")
                    else:
                        sink(j, self._get_buf[off:off + size].data.toreadonly())

    def put_many(self, names: list[str], max_bytes: int, encode: Encoder) -> np.ndarray:
        codes = np.full(len(names), PutResult.NO_SPACE, dtype=np.int8)
        if not names:
            return codes
        with self._put_lock, self._using() as store:
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
        with self._using() as store:
            # force=True: a value just written holds a lease for a few seconds; a corrupt value must go now.
            return sum(1 for name in names if store.remove(name, True) == 0)

    def info(self) -> dict:
        with self._using():
            pass
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
        if store is None or self._pid != os.getpid():
            return
        # A read or write in flight (the background writer sending a batch) still uses the native
        # client and the registered buffers: freeing them under it crashes the process (SIGSEGV).
        # Wait for it; one that does not end in time keeps the client, abandoned, for the process.
        with self._idle:
            idle = self._idle.wait_for(lambda: self._users == 0, timeout=CLOSE_WAIT_S)
        if not idle:
            self._abandoned.append((store, self._get_buf, self._put_buf))
            return
        try:
            store.close()
        except Exception:  # noqa: BLE001 - closing a client of a dead master may fail: nothing to keep
            pass
