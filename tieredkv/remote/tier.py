"""RemoteTier: blocks in a store shared by many hosts, behind the same ``Tier`` contract as hot and warm.

```
request path: match / contains_many / get_many ──► caller threads ──► Store      (deadline: a late or
                                                    (bounded)                      failed call is a miss)
off the path:  put_many (TieredCache's background writer) ──────────► Store
```

It never slows a request down beyond its deadline and never raises on the request path: a store that
is slow, dead or restarting is a miss, counted as an error; after an error the store is left alone for
``retry_s`` (calls in that window are misses at once, counted as skipped), then tried again, so a
restarted server is picked up without restarting the worker.

Every value is checked against the block asked for (``tieredkv.remote.value``): a value that fails any
check is a miss and a counted corruption, and is deleted from the store so the next writer replaces it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from tieredkv import codec as cd
from tieredkv import forksafe
from tieredkv.errors import InvalidInput, MissingDependency, RemoteUnavailable
from tieredkv.keys import ChunkKeys
from tieredkv.layout import as_block_bytes
from tieredkv.remote.auth import AUTH_OPTIONS, load_key
from tieredkv.remote.store import Store, float_option, open_store, parse_url
from tieredkv.remote.value import FORMAT_VERSION, Codec
from tieredkv.spec import KVSpec
from tieredkv.tier import (
    Evicted,
    PutResult,
    Tier,
    TierStats,
    check_count,
    check_keys,
    out_rows,
)

#: URL options the tier itself reads (the rest go to the store).
TIER_OPTIONS = ("deadline_ms", "retry_s", "compress", "min_mb_per_s") + AUTH_OPTIONS


def name_prefix(tag: str) -> str:
    """Prefix of every name of one namespace in the store (``ls`` counts by it); ``tag`` is the
    namespace's keyed tag (``FleetKey.namespace_tag``)."""
    return f"tkv{FORMAT_VERSION}:{tag}:"


class _Call:
    """One request-path call on a daemon thread of its own. Daemon threads, not an executor's: a call
    stuck in a store's client (a Mooncake setup against a dead master retries for about 90 s) must
    not hold up the interpreter's exit, which joins executor threads."""

    def __init__(self, fn, done: Callable[[], None]):
        self.fn, self._done = fn, done
        self.finished = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller, which re-raises it
            self.error = e
        finally:
            self.finished.set()
            self._done()


class _Guard:
    """Lets a request give up on a read: after ``cancel()`` the read writes nothing more."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True


class RemoteTier(Tier):
    """A remote store of blocks for one spec.

    Args:
        spec: the namespace; its fingerprint prefixes every name, its digest is checked in every value.
        store: a ``Store``, or a URL: ``valkey://host:port`` or ``mooncake://host:port`` (the master's
            RPC address), with tier options and store options in the query string, e.g.
            ``valkey://10.0.0.5:6379?deadline_ms=20&compress=1``.
        deadline_ms: bound on a probe (``match``/``contains_many``); a read gets this plus the time
            its bytes take at ``min_mb_per_s``.
        retry_s: after an error, leave the store alone this long.
        compress: the codec values are written with: "none" (default), "zstd" (byte planes + ZSTD, about
            1.45x on bf16 KV), "lz4" (about 1.2x, faster) or "zlib" (slow; no dependency); True means
            "zstd". The first two need blosc2 (``pip install 'tieredkv[compress]'``). Reads accept every
            codec whatever this says; a value in a codec this host lacks is a miss (``undecodable``).
            See docs/fleet.md for when it pays.
        min_mb_per_s: the slowest transfer rate a read may have before it counts as late.
        workers: request-path calls that may be in flight at once; when all are stuck on a store that
            does not answer, further calls are misses at once.
        capacity_blocks: the store's size in blocks as the operator sized it, for ``stats`` (0: derive it
            from the server's ``maxmemory`` when it reports one).
        secret: the fleet secret (bytes); without it, it is read from the URL's ``secret_file=PATH``
            or the environment (``tieredkv.remote.auth``). Never put it in the URL.
        insecure: run without a secret (values can then be forged by any client of the store); also
            ``insecure=1`` in the URL. Without a secret and without this, opening fails.

    Raises:
        InvalidInput: a bad URL or option, or no secret (the message names it).
        MissingDependency: ``compress`` needs blosc2, which is not installed.
    """

    def __init__(self, spec: KVSpec, store: Store | str, *, deadline_ms: float | None = None,
                 retry_s: float | None = None, compress: bool | str | None = None, min_mb_per_s: float | None = None,
                 workers: int = 4, capacity_blocks: int = 0, secret: bytes | None = None,
                 insecure: bool | None = None):
        if not isinstance(spec, KVSpec):
            raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
        options: dict[str, str] = {}
        url_parts = None
        if isinstance(store, str):
            scheme, host, port, store_opts = parse_url(store)
            options = {k: store_opts.pop(k) for k in TIER_OPTIONS if k in store_opts}
            url_parts = (scheme, host, port, store_opts)
        elif not isinstance(store, Store):
            raise InvalidInput(f"store must be a URL or a Store, got {type(store).__name__}")
        self.spec = spec
        self.deadline_s = (deadline_ms if deadline_ms is not None
                           else float_option(options, "deadline_ms", 50.0, minimum=0.001)) / 1000
        self.retry_s = retry_s if retry_s is not None else float_option(options, "retry_s", 1.0)
        if compress is None:
            compression = cd.choice(options.get("compress", "0"), "URL option compress")
        else:
            compression = cd.choice(compress, "compress")
        mb = min_mb_per_s if min_mb_per_s is not None else float_option(options, "min_mb_per_s", 100.0, 0.001)
        self.min_bytes_per_s = mb * 1e6
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidInput(f"workers must be a positive int, got {workers!r}")
        self.capacity_blocks = check_count(capacity_blocks, "capacity_blocks")
        key = load_key(options, secret, insecure)
        self.authenticated = key.authenticated
        self.codec = Codec(spec, key, compress=compression)
        self.prefix = name_prefix(key.namespace_tag(spec.fingerprint))
        # Opened only once every tier option checked out: a bad option leaves nothing open.
        self.store: Store = open_store(*url_parts) if url_parts is not None else cast(Store, store)
        self._workers = workers
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._in_flight = 0
        forksafe.register(self)
        self._down_until = 0.0
        self._closed = False
        self._counts = {name: 0 for name in ("hits", "misses", "bytes_in", "bytes_out", "puts", "corrupt",
                                             "errors", "skipped", "refused", "wire_bytes_in", "undecodable")}
        #: Called with each change of the error/skipped/corrupt counters (TieredCache keeps per-host sums).
        self.observer: Callable[[dict], None] | None = None
        # Connect in the background, off any deadline: a Mooncake client's setup takes long next to a
        # probe, and against a master that is down it retries for about 90 s. Calls meanwhile wait
        # for it within their deadline (a miss if it is not done).
        self._start(self._connect)

    def _after_fork_in_child(self) -> None:
        # The lock is fresh (tieredkv.forksafe); the calls in flight were the parent's threads.
        self._pid, self._in_flight = os.getpid(), 0

    def _connect(self) -> None:
        try:
            self.store.connect()
        except RemoteUnavailable:
            self._failed()  # a store that is down at start-up is a miss like any other, retried later

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def compress(self) -> bool:
        """Whether values are written compressed (``codec.compression`` names the codec)."""
        return self.codec.compress

    def names(self, keys: ChunkKeys) -> list[str]:
        """The store names of ``keys``: ``tkv2:<namespace tag>:<name digest>``, both keyed by the fleet
        secret (``Codec.digests``; the tenant's salt is inside the key)."""
        return self._names(self.codec.digests(keys))

    def _names(self, digests: list[bytes]) -> list[str]:
        return [self.prefix + d.hex() for d in digests]

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput("this RemoteTier is closed")

    # ---- calls with a deadline ----------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v
        self._notify(deltas)

    def _notify(self, deltas: dict) -> None:
        observer = self.observer
        if observer is not None and any(deltas.get(k) for k in ("errors", "skipped", "corrupt")):
            observer(deltas)

    def _call(self, fn, timeout_s: float):
        """Run ``fn`` on a caller thread and wait at most ``timeout_s``; raise ``RemoteUnavailable`` if
        the store is marked down, every caller is stuck, ``fn`` failed, or the deadline passed.

        A late call keeps running on its thread and its result is dropped: a ``fn`` that writes into
        the caller's memory must stop when told (see ``_Guard``).
        """
        with self._lock:
            if self._closed:
                raise InvalidInput("this RemoteTier is closed")
            if self._pid != os.getpid():  # threads do not survive fork
                self._pid, self._in_flight = os.getpid(), 0
            down = time.monotonic() < self._down_until
            stuck = not down and self._in_flight >= self._workers
        if down:
            self._count(skipped=1)
            raise RemoteUnavailable(f"{self.url} is marked down after an error; retrying soon")
        if stuck:
            self._count(errors=1)
            raise RemoteUnavailable(f"{self.url}: {self._workers} calls are still waiting for the store")
        call = self._start(fn)
        if not call.finished.wait(timeout_s):
            self._failed()
            raise RemoteUnavailable(f"{self.url}: no answer within {timeout_s * 1000:.0f} ms")
        error = call.error
        if isinstance(error, Exception) and not isinstance(error, InvalidInput):
            # Whatever a store's client raised (a refused connection, and also a reply it could not
            # parse: a damaged stream, a proxy in between, a protocol error) is the store failing: a
            # miss with the retry back-off, never an exception on the request path.
            self._failed()
            if isinstance(error, RemoteUnavailable):
                raise error
            raise RemoteUnavailable(f"{self.url}: {type(error).__name__}: {error}") from error
        if error is not None:  # a misuse (InvalidInput names it), KeyboardInterrupt: not the store's
            raise error
        return call.result

    def _start(self, fn) -> _Call:
        call = _Call(fn, self._done)
        with self._lock:
            self._in_flight += 1
        threading.Thread(target=call.run, name="tieredkv-remote", daemon=True).start()
        return call

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _failed(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s
        self._count(errors=1)

    def _read_deadline(self, n: int) -> float:
        return self.deadline_s + n * self.codec.max_bytes / self.min_bytes_per_s

    # ---- Tier ---------------------------------------------------------------------------------------
    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        """Residency per key; all False when the store does not answer within the deadline."""
        keys = check_keys(self.spec, keys)
        self._check_open()
        if not len(keys):
            return np.zeros(0, dtype=bool)
        names = self.names(keys)
        try:
            found = self._call(lambda: self.store.exists_many(names), self.deadline_s)
        except RemoteUnavailable:
            return np.zeros(len(keys), dtype=bool)
        if len(found) != len(keys):  # a confused answer is an error, and a miss
            self._failed()
            return np.zeros(len(keys), dtype=bool)
        return found

    def match(self, keys: ChunkKeys) -> int:
        found = self.contains_many(keys)
        return int(np.argmin(found)) if not found.all() else len(found)

    def get_many(self, keys: ChunkKeys, out: np.ndarray,
                 sink: Callable[[int, np.ndarray], None] | None = None) -> int:
        """Copy the leading blocks the store holds into ``out`` (row per key); return how many.

        The run ends at the first block that is absent, fails a check (counted as corrupt, deleted
        from the store) or when the store does not answer in time (counted as an error). ``sink``
        (see ``Tier.get_many``) gets the run's rows in one call once they are in ``out``.
        """
        keys = check_keys(self.spec, keys)
        n = len(keys)
        rows = out_rows(self.spec, out, n)
        self._check_open()
        if n == 0:
            return 0
        digests = self.codec.digests(keys)
        names = self._names(digests)
        guard = _Guard()
        try:
            run, bad = self._call(lambda: self._fetch(digests, names, rows, guard), self._read_deadline(n))
        except RemoteUnavailable:
            guard.cancel()  # a late call must not write into the caller's rows any more
            run, bad = 0, False
        self._count(hits=run, misses=n - run, bytes_out=run * self.spec.block_bytes, corrupt=int(bad))
        if sink is not None and run:
            sink(0, rows[:run])
        return run

    def _fetch(self, digests: list[bytes], names: list[str], rows: np.ndarray, guard: _Guard) -> tuple[int, bool]:
        """On a caller thread: check each value and write its payload into ``rows``, stopping at the first
        absent or bad one, or when the caller gave up (``guard``). Returns ``(run, bad)``."""
        run, stop, bad = 0, False, False

        def sink(i: int, value) -> None:
            nonlocal run, stop, bad
            if stop or i != run:
                return
            if value is None:
                stop = True
                return
            with guard.lock:  # the caller cancels under this lock: no write lands after it returned
                if guard.cancelled:
                    stop = True
                    return
                try:
                    good = self.codec.decode_into(value, digests[i], rows[i])
                except MissingDependency:
                    # Sound, but in a codec this host cannot run: a miss; the value stays for others.
                    stop = True
                    self._count(undecodable=1)
                    return
            if good:
                run += 1
            else:
                stop = bad = True

        self.store.get_many(names, self.codec.max_bytes, sink)
        if bad:
            # A damaged or foreign value: remove it so the next writer of this block replaces it.
            self.store.delete_many([names[run]])
        return run, bad

    def put_many(self, keys: ChunkKeys, payloads: np.ndarray) -> np.ndarray:
        """Encode and store blocks the store does not hold yet; one ``PutResult`` per block: ``STORED``,
        ``EXISTS`` (the store has it, or it came earlier in this batch) or ``NO_SPACE`` (the store
        refused it, or is down). Blocks until the store answers (its own timeout bounds it):
        TieredCache calls this from its background writer, never from a request."""
        keys = check_keys(self.spec, keys)
        n = len(keys)
        rows = as_block_bytes(self.spec, payloads, n)
        self._check_open()
        codes = np.full(n, PutResult.EXISTS, dtype=np.int8)
        if n == 0:
            return codes
        with self._lock:
            down = time.monotonic() < self._down_until
        if down:
            self._count(skipped=1)
            codes[:] = PutResult.NO_SPACE
            return codes
        kv = np.ascontiguousarray(keys.keys, dtype="<u8").view("V16").ravel()
        _, first = np.unique(kv, return_index=True)
        first.sort()
        digests = self.codec.digests(keys)
        names = self._names(digests)
        sizes = np.zeros(n, dtype=np.int64)

        def encode(j: int, into):
            i = int(first[todo[j]])
            value = self.codec.encode(digests[i], rows[i], into)
            sizes[first[todo[j]]] = len(value)
            return value

        try:
            # Probe first: a block another host already sent costs one EXISTS, not its bytes.
            todo = np.flatnonzero(~self.store.exists_many([names[i] for i in first]))
            results = self.store.put_many([names[first[j]] for j in todo], self.codec.max_bytes, encode)
            if len(results) != len(todo):
                raise RemoteUnavailable(f"{self.url}: {len(results)} answers to {len(todo)} writes")
        except InvalidInput:
            raise
        except Exception:  # noqa: BLE001 - any client failure is the store's (see _call): counted, backed off
            self._failed()
            codes[first] = PutResult.NO_SPACE
            return codes
        codes[first[todo]] = results
        stored = codes == PutResult.STORED
        self._count(puts=int(stored.sum()), refused=int(np.count_nonzero(codes == PutResult.NO_SPACE)),
                    bytes_in=int(stored.sum()) * self.spec.block_bytes, wire_bytes_in=int(sizes[stored].sum()))
        return codes

    def remove(self, keys: ChunkKeys) -> int:
        """Delete blocks from the store (an administrative call: it raises ``RemoteUnavailable``)."""
        keys = check_keys(self.spec, keys)
        self._check_open()
        return self.store.delete_many(self.names(keys)) if len(keys) else 0

    def evict(self, n: int) -> Evicted:
        """The store evicts by itself (Valkey's maxmemory policy, Mooncake's watermarks) and reports no
        victims: nothing here chooses any, so this evicts nothing and hands back no blocks."""
        check_count(n)
        self._check_open()
        empty = np.zeros((0, 2), dtype=np.uint64)
        return Evicted(keys=ChunkKeys(empty, empty.copy(), np.zeros((0, self.spec.chunk_tokens), np.uint32)),
                       payloads=np.zeros((0, self.spec.block_bytes), np.uint8), hits=np.zeros(0, np.int64))

    @property
    def corrupt_seen(self) -> int:
        """Values this handle refused (damaged or foreign) and deleted."""
        with self._lock:
            return self._counts["corrupt"]

    def stats(self) -> TierStats:
        """This process's counters; the store's own numbers under ``extra["server"]`` when it answers.

        ``used_blocks`` is what the server says it holds (Valkey: every name in the database, all
        namespaces); ``capacity_blocks`` is the one given, else ``maxmemory`` / the largest value."""
        self._check_open()
        try:
            server: Any = self._call(self.store.info, max(self.deadline_s, 1.0))
        except RemoteUnavailable as e:
            server = {"error": str(e)}
        with self._lock:
            counts = dict(self._counts)
        extra = {"url": self.url, "compress": self.codec.compression, "errors": counts.pop("errors"),
                 "undecodable": counts.pop("undecodable"),
                 "skipped": counts.pop("skipped"), "refused": counts.pop("refused"),
                 "wire_bytes_in": counts.pop("wire_bytes_in"), "server": server}
        # Compressed values take less: size the store by the mean value this process wrote.
        per_value = self.codec.max_bytes
        if self.compress and counts["puts"] and extra["wire_bytes_in"]:
            per_value = -(-int(extra["wire_bytes_in"]) // counts["puts"])
        capacity = self.capacity_blocks or int(server.get("maxmemory_bytes", 0)) // per_value
        return TierStats(name="remote", capacity_blocks=capacity, used_blocks=int(server.get("names", 0)),
                         extra=extra, **counts)

    @property
    def counts(self) -> dict:
        """A copy of this process's counters (hits, misses, corrupt, errors, skipped, ...)."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Close the connection. Idempotent; a call still stuck in the store's client is not waited for
        (its daemon thread ends with it, or with the process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.store.close()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url}, {self.spec.namespace})"
