"""Prometheus exposition of a host's tieredkv counters (optional extra ``metrics``).

The numbers come from shared state, read at scrape time: the counter rows of each hot-tier segment
(``tieredkv.hot.admin.inspect``, which reads without registering) and, with ``warm_dir``, the warm tiers'
indexes. They are therefore per host, whichever process serves them: run one exporter per host (e.g.
``tieredkv stats --prometheus 9400``) or call ``serve_metrics`` in one worker.

Every series carries a ``segment`` label (and ``model``); warm-tier series carry ``path``. Counters
only grow for the life of a segment (a row outlives its owner), so PromQL ``rate()`` works across
worker restarts; they restart from zero when the segment is recreated.

The first number to look at is the prefix hit rate, the share of prompt tokens served from cache::

    sum(rate(tieredkv_hit_tokens_total[5m])) / sum(rate(tieredkv_prompt_tokens_total[5m]))

``tieredkv_prefix_hit_rate`` is the same ratio over the segment's whole life.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from tieredkv.errors import InvalidInput, MissingDependency

__all__ = ["SegmentCollector", "serve_metrics", "render", "MissingDependency"]

_INSTALL_HINT = "the Prometheus exporter needs prometheus_client: pip install 'tieredkv[metrics]'"


def _prometheus():
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client import core
    except ImportError as exc:  # pragma: no cover - exercised by a test that hides the module
        raise MissingDependency(_INSTALL_HINT) from exc
    return core


def _segment_names(names: Sequence[str] | None) -> list[str]:
    from tieredkv.hot import segment as seg

    if names:
        return [seg.check_name(n) for n in names]
    # Temporary names belong to creators that are still building (or died building): not a segment yet.
    return seg.list_segment_names(published_only=True)


def _warm_rows(warm_dir: str | os.PathLike | None) -> list[dict[str, Any]]:
    """``list_warm_tiers`` rows plus each tier's lifetime count of corrupt blocks (from its index)."""
    if warm_dir is None:
        return []
    from tieredkv.warm import files
    from tieredkv.warm.admin import list_warm_tiers

    rows = list_warm_tiers(warm_dir)
    for row in rows:
        row["corrupt_total"] = None
        try:
            index = files.open_index(row["path"])
            try:
                row["corrupt_total"] = files.corrupt_total(index)
            finally:
                index.close()
        except Exception:  # noqa: BLE001 - one unreadable tier must not fail the whole scrape
            pass
    return rows


class SegmentCollector:
    """A ``prometheus_client`` collector that reads hot-tier segments (and warm tiers) at scrape time.

    Args:
        names: segment names to expose; ``None`` or empty: every tieredkv segment in /dev/shm at the
            time of each scrape (so segments created later, e.g. one per NUMA node, show up).
        warm_dir: a warm tier directory, or a root holding several, whose usage to expose too.

    Raises:
        MissingDependency: ``prometheus_client`` is not installed.

    Example:
        >>> from prometheus_client import CollectorRegistry, generate_latest
        >>> registry = CollectorRegistry()
        >>> registry.register(SegmentCollector(["/tieredkv-no-such-segment"]))
        >>> b'tieredkv_segment_up{segment="/tieredkv-no-such-segment"} 0.0' in generate_latest(registry)
        True
    """

    def __init__(self, names: Sequence[str] | None = None, warm_dir: str | os.PathLike | None = None):
        self._core = _prometheus()
        self.names = list(names) if names else None
        self.warm_dir = warm_dir
        if self.names:
            _segment_names(self.names)  # fail now on a malformed name, not at every scrape

    def describe(self) -> Iterable:
        """Nothing: the families depend on which segments exist at scrape time.

        Returning nothing also keeps ``registry.register`` from calling ``collect()`` (a read of
        shared memory) just to learn the names.
        """
        return []

    def collect(self) -> Iterator:
        """Build every metric family from the segments' current counters."""
        from tieredkv.hot import admin

        docs = [admin.inspect(name) for name in _segment_names(self.names)]
        yield from families(docs, _warm_rows(self.warm_dir), self._core)


def families(docs: list[dict], warm_rows: list[dict], core=None) -> list:
    """Metric families for ``admin.inspect`` documents and warm-tier rows (see ``SegmentCollector``).

    Args:
        docs: one ``tieredkv.hot.admin.inspect`` result per segment.
        warm_rows: rows as ``_warm_rows`` builds them (may be empty).
        core: ``prometheus_client.core`` (looked up when ``None``).

    Returns:
        A list of ``prometheus_client`` metric families.
    """
    from tieredkv.counters import LATENCY_BUCKETS_S

    core = core or _prometheus()
    G, C, H = core.GaugeMetricFamily, core.CounterMetricFamily, core.HistogramMetricFamily
    L = ["segment", "model"]

    up = G("tieredkv_segment_up", "1 if the segment could be read, 0 if it is missing or unusable", labels=["segment"])
    hit_rate = G("tieredkv_prefix_hit_rate", "PREFIX HIT RATE: prompt tokens served from cache / prompt tokens "
                 "looked up, over the segment's life (per interval: rate(hit_tokens)/rate(prompt_tokens))", labels=L)
    prompt = C("tieredkv_prompt_tokens", "prompt tokens looked up", labels=L)
    hits = C("tieredkv_hit_tokens", "prompt tokens found in cache, by tier", labels=L + ["tier"])
    prefill = C("tieredkv_prefill_tokens", "prompt tokens left to prefill after the lookup", labels=L)
    loaded = C("tieredkv_loaded_tokens", "tokens restored from the tiers", labels=L)
    lookups = C("tieredkv_lookups", "TieredCache lookups", labels=L)
    moved = C("tieredkv_bytes", "bytes moved, by tier and direction", labels=L + ["tier", "direction"])
    stored = C("tieredkv_stored_blocks", "blocks stored into the hot tier by store()", labels=L)
    evictions = C("tieredkv_evictions", "blocks evicted from the hot tier", labels=L)
    promotions = C("tieredkv_promotions", "blocks promoted warm -> hot", labels=L)
    demotions = C("tieredkv_demotions", "blocks demoted hot -> warm", labels=L)
    lost = C("tieredkv_lost_blocks", "blocks a lookup found but the load could not deliver "
             "(evicted meanwhile, or corrupt and dropped)", labels=L)
    corrupt = C("tieredkv_corrupt_blocks", "warm blocks whose checksum failed on a load (dropped, never "
                "served)", labels=L)
    behind = C("tieredkv_warm_write_behind_blocks", "blocks handed to the background warm writer: queued, or "
               "dropped because its queue was full", labels=L + ["outcome"])
    warm_err = C("tieredkv_warm_errors", "warm-tier calls that failed (the cache went on without it)", labels=L)
    remote_err = C("tieredkv_remote_errors", "remote-store calls that failed, timed out or were skipped while "
                   "the store was marked down (each a miss)", labels=L)
    remote_miss = C("tieredkv_remote_misses", "lookups whose run ended at a block the remote store lacked", labels=L)
    remote_drop = C("tieredkv_remote_dropped_blocks", "blocks not written to the remote store because its "
                    "queue was full (backpressure)", labels=L)
    remote_bad = C("tieredkv_remote_corrupt_values", "remote values refused by a check (damaged or foreign; "
                   "deleted, never served)", labels=L)
    torn = C("tieredkv_hot_torn_reads", "hot-tier reads that saw a block change under them (retried or missed)",
             labels=L)
    recov = C("tieredkv_hot_recoveries", "hot-tier repairs after a process died holding the lock", labels=L)
    no_space = C("tieredkv_hot_no_space", "hot-tier puts refused for lack of space", labels=L)
    slots = G("tieredkv_hot_blocks", "hot-tier slots by state (capacity: all slots)", labels=L + ["state"])
    seg_bytes = G("tieredkv_hot_segment_bytes", "size of the shared-memory segment", labels=L)
    block_bytes = G("tieredkv_block_bytes", "bytes per cached block", labels=L)
    handles = G("tieredkv_live_handles", "handles (worker processes) attached now", labels=L)
    bounds = [("+Inf" if b == float("inf") else repr(b)) for b in LATENCY_BUCKETS_S]
    lookup_h = H("tieredkv_lookup_seconds", "TieredCache.lookup latency", labels=L)
    load_h = H("tieredkv_load_seconds", "TieredCache.load latency", labels=L)

    for doc in docs:
        ok = not doc.get("error") and "cache" in doc
        up.add_metric([doc["name"]], 1.0 if ok else 0.0)
        if not ok:
            continue
        lv = [doc["name"], doc.get("model_id") or ""]
        c, k = doc["cache"], doc["counters"]
        hit_rate.add_metric(lv, doc["prefix_hit_rate"])
        prompt.add_metric(lv, c["prompt_tokens"])
        hits.add_metric(lv + ["hot"], c["hot_hit_tokens"])
        hits.add_metric(lv + ["warm"], c["warm_hit_tokens"])
        hits.add_metric(lv + ["remote"], c["remote_hit_tokens"])
        prefill.add_metric(lv, c["prefill_tokens"])
        loaded.add_metric(lv, c["loaded_tokens"])
        lookups.add_metric(lv, c["lookups"])
        for tier in ("hot", "warm", "remote"):
            moved.add_metric(lv + [tier, "read"], c[f"{tier}_bytes_read"])
            moved.add_metric(lv + [tier, "written"], c[f"{tier}_bytes_written"])
        stored.add_metric(lv, c["stored_blocks"])
        evictions.add_metric(lv, k["evictions"])
        promotions.add_metric(lv, c["promotions"])
        demotions.add_metric(lv, c["demotions"])
        lost.add_metric(lv, c["lost_blocks"])
        corrupt.add_metric(lv, c["corrupt_blocks"])
        warm_err.add_metric(lv, c["warm_errors"])
        behind.add_metric(lv + ["queued"], c["warm_queued_blocks"])
        behind.add_metric(lv + ["dropped"], c["warm_dropped_blocks"])
        remote_err.add_metric(lv, c["remote_errors"])
        remote_miss.add_metric(lv, c["remote_misses"])
        remote_drop.add_metric(lv, c["remote_drops"])
        remote_bad.add_metric(lv, c["remote_corrupt"])
        torn.add_metric(lv, k["torn_reads"])
        recov.add_metric(lv, k["recoveries"])
        no_space.add_metric(lv, k["no_space"])
        slots.add_metric(lv + ["ready"], doc["ready_slots"])
        slots.add_metric(lv + ["writing"], doc["writing_slots"])
        slots.add_metric(lv + ["capacity"], doc["n_slots"])
        seg_bytes.add_metric(lv, doc["size_bytes"])
        block_bytes.add_metric(lv, doc["block_bytes"])
        handles.add_metric(lv, doc["live_handles"])
        for fam, hist, ns in ((lookup_h, doc["lookup_hist"], c["lookup_ns"]),
                              (load_h, doc["load_hist"], c["load_ns"])):
            cumulative, total = [], 0
            for bound, n in zip(bounds, hist):
                total += int(n)
                cumulative.append((bound, total))
            fam.add_metric(lv, cumulative, sum_value=ns / 1e9)

    out = [hit_rate, up, prompt, hits, prefill, loaded, lookups, moved, stored, evictions, promotions, demotions,
           lost, corrupt, behind, warm_err, remote_err, remote_miss, remote_drop, remote_bad, torn, recov, no_space,
           slots, seg_bytes, block_bytes, handles, lookup_h, load_h]
    if warm_rows:
        WL = ["path", "model"]
        w_used = G("tieredkv_warm_blocks", "warm-tier blocks by state (capacity: all slots)", labels=WL + ["state"])
        w_bytes = G("tieredkv_warm_disk_bytes", "disk space the warm tier's files take", labels=WL)
        w_corrupt = C("tieredkv_warm_corrupt_blocks", "blocks found corrupt and dropped, over the tier's life",
                      labels=WL)
        w_up = G("tieredkv_warm_up", "1 if the warm tier's metadata and index could be read", labels=["path"])
        for row in warm_rows:
            wl = [row["path"], row.get("model") or ""]
            w_up.add_metric([row["path"]], 0.0 if row.get("error") else 1.0)
            if row.get("blocks") is not None:
                w_used.add_metric(wl + ["used"], row["blocks"])
            if row.get("capacity_blocks") is not None:
                w_used.add_metric(wl + ["capacity"], row["capacity_blocks"])
            w_bytes.add_metric(wl, row.get("size_bytes") or 0)
            if row.get("corrupt_total") is not None:
                w_corrupt.add_metric(wl, row["corrupt_total"])
        out += [w_up, w_used, w_bytes, w_corrupt]
    return out


def render(names: Sequence[str] | None = None, warm_dir: str | os.PathLike | None = None) -> str:
    """The Prometheus text exposition of ``SegmentCollector(names, warm_dir)``, as one scrape would see it.

    Args:
        names: segment names (``None``: every segment).
        warm_dir: a warm tier directory or root, or ``None``.

    Returns:
        The exposition text (``text/plain; version=0.0.4``).

    Raises:
        MissingDependency: ``prometheus_client`` is not installed.
    """
    _prometheus()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SegmentCollector(names, warm_dir))
    return generate_latest(registry).decode()


def serve_metrics(port: int, names: Sequence[str] | None = None, warm_dir: str | os.PathLike | None = None, *,
                  addr: str = "127.0.0.1"):
    """Serve ``/metrics`` for the segments (and warm tiers) on ``addr:port`` from a daemon thread.

    The registry holds only tieredkv's collector: a scrape reads the shared counters and nothing else.

    Args:
        port: TCP port; ``0`` picks a free one (read it from the returned server's ``server_port``).
        names: segment names (``None``: every segment present at each scrape).
        warm_dir: a warm tier directory or root whose usage to expose, or ``None``.
        addr: address to bind; the default serves only this host (``"0.0.0.0"``: every interface).

    Returns:
        The HTTP server (a ``wsgiref`` server); ``shutdown()`` then ``server_close()`` stops it.

    Raises:
        MissingDependency: ``prometheus_client`` is not installed.
        InvalidInput: ``port`` is not in 0..65535, or ``addr:port`` cannot be bound (the port is taken,
            the address is not one of this host's, or it does not resolve); the message says which.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInput(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
    _prometheus()
    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SegmentCollector(names, warm_dir))
    # Our own small server rather than start_http_server: the returned object can be shut down on
    # every prometheus_client version the extra allows, and scrapes do not log to stderr.
    try:
        server = make_server(addr, port, make_wsgi_app(registry), _ThreadingServer, handler_class=_QuietHandler)
    except socket.gaierror as e:
        raise InvalidInput(f"addr {addr!r} does not resolve ({e.strerror}); give an IP address or host name "
                           "of this host (127.0.0.1: this host only, 0.0.0.0: every interface)") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            hint = f"port {port} is in use: choose another (0: any free port)"
        elif e.errno == errno.EADDRNOTAVAIL:
            hint = f"{addr} is not an address of this host: use one of its own (or 0.0.0.0: every interface)"
        elif e.errno == errno.EACCES:
            hint = f"port {port} needs privileges: use a port above 1023"
        else:
            hint = e.strerror or str(e)
        raise InvalidInput(f"cannot serve metrics on {addr}:{port}: {hint}") from None
    threading.Thread(target=server.serve_forever, name="tieredkv-metrics", daemon=True).start()
    return server


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass
