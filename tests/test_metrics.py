"""Prometheus exposition: the numbers a scrape shows are the per-host counters in the segment."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

# The `metrics` extra is part of the test setup (.ci/setup): a missing prometheus_client fails here.
from prometheus_client.parser import text_string_to_metric_families

from helpers import kv_for
from tieredkv import KVSpec, TieredCache, counters, metrics
from tieredkv.hot import segment as seg

MiB = 1 << 20


@pytest.fixture
def spec():
    return KVSpec(model_id="test/metrics", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                  chunk_tokens=4)


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels other than segment/model): value} of one exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("segment", "model", "path"))
            out[(s.name, labels)] = s.value
    return out


def one(d: dict, name: str, **labels) -> float:
    return d[(name, frozenset(labels.items()))]


def traffic(cache: TieredCache, spec: KVSpec, seed: int) -> None:
    """Store two prompts, look up three (one miss), load the hits."""
    rng = np.random.default_rng(seed)
    a, b, c = (rng.integers(0, 30_000, 17) for _ in range(3))
    for p in (a, b):
        cache.store(p, kv_for(spec, p))
    for p in (a, b, c):
        hit = cache.lookup(p)
        cache.load(hit, np.zeros((2, 2, 2, len(p), 8), np.float16))


def test_scrape_matches_the_segment_counters(spec, seg_name, tmp_path):
    with TieredCache(spec, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=4 * MiB,
                     demotion="write_through") as cache:
        traffic(cache, spec, 0)
        st = cache.stats()
        d = samples(metrics.render([seg_name], warm_dir=tmp_path / "warm"))
    assert st["lookups"] == 3 and st["prompt_tokens"] == 51 and st["hit_tokens"] == 32
    assert one(d, "tieredkv_prefix_hit_rate") == pytest.approx(32 / 51)
    assert one(d, "tieredkv_segment_up") == 1
    assert one(d, "tieredkv_prompt_tokens_total") == 51
    assert one(d, "tieredkv_hit_tokens_total", tier="hot") == st["hot_hit_tokens"] == 32
    assert one(d, "tieredkv_hit_tokens_total", tier="warm") == 0
    assert one(d, "tieredkv_prefill_tokens_total") == 51 - 32
    assert one(d, "tieredkv_lookups_total") == 3
    block = spec.block_bytes
    assert one(d, "tieredkv_bytes_total", tier="hot", direction="written") == 8 * block
    assert one(d, "tieredkv_bytes_total", tier="warm", direction="written") == 8 * block   # write-through
    assert one(d, "tieredkv_bytes_total", tier="hot", direction="read") == 8 * block
    assert one(d, "tieredkv_hot_blocks", state="ready") == 8
    assert one(d, "tieredkv_live_handles") == 1
    # Histograms: cumulative buckets, +Inf equals the count, the sum is the recorded time.
    # Three lookups; two loads (a load of a miss has nothing to time).
    assert sum(st["load_hist"]) == 2
    for name, count in (("tieredkv_lookup_seconds", 3), ("tieredkv_load_seconds", 2)):
        buckets = [v for (n, labels), v in d.items() if n == name + "_bucket"]
        assert len(buckets) == len(counters.LATENCY_BUCKETS_S)
        assert one(d, name + "_count") == count
        assert one(d, name + "_bucket", le="+Inf") == count
        assert one(d, name + "_sum") > 0
    bounds = sorted((float(dict(labels)["le"]), v) for (n, labels), v in d.items()
                    if n == "tieredkv_lookup_seconds_bucket")
    assert [v for _, v in bounds] == sorted(v for _, v in bounds)
    # The warm tier's usage and damage counter are read from its index.
    assert one(d, "tieredkv_warm_up") == 1
    assert one(d, "tieredkv_warm_blocks", state="used") == 8
    assert one(d, "tieredkv_warm_blocks", state="capacity") > 8
    assert one(d, "tieredkv_warm_corrupt_blocks_total") == 0


def test_evictions_promotions_demotions(spec, seg_name, tmp_path):
    from tieredkv import policies

    hot_bytes = seg.Layout.compute(spec, 4, policies.StateLayout.for_policy(policies.make("lru"), 4).nbytes).total_bytes
    with TieredCache(spec, hot_bytes=hot_bytes, hot_name=seg_name, warm_dir=tmp_path / "w", warm_bytes=4 * MiB,
                     demotion="on_evict") as c:
        rng = np.random.default_rng(1)
        a, b = rng.integers(0, 30_000, 17), rng.integers(0, 30_000, 17)
        c.store(a, kv_for(spec, a))
        c.store(b, kv_for(spec, b))          # evicts a's 4 blocks into warm
        c.load(c.lookup(a), np.zeros((2, 2, 2, 17, 8), np.float16))   # promotes them back, demoting b's
        st = c.stats()
        d = samples(metrics.render([seg_name]))
    assert st["demotions"] == 8 and st["promotions"] == 4
    assert one(d, "tieredkv_demotions_total") == 8
    assert one(d, "tieredkv_promotions_total") == 4
    assert one(d, "tieredkv_evictions_total") == st["hot"]["evictions"] >= 8
    assert one(d, "tieredkv_hit_tokens_total", tier="warm") == 16
    assert one(d, "tieredkv_bytes_total", tier="warm", direction="read") == 4 * spec.block_bytes
    assert not any(n.startswith("tieredkv_warm_blocks") for n, _ in d)  # no warm_dir given: no warm series


@pytest.mark.procs
def test_counters_are_per_host_not_per_process(spec, seg_name):
    """Another process's lookups show up in this process's scrape, also after it exited."""
    with TieredCache(spec, hot_bytes=MiB, hot_name=seg_name) as cache:
        traffic(cache, spec, 0)
        code = (
            "import sys, numpy as np; sys.path.insert(0, 'tests')\n"
            "from helpers import kv_for\nfrom test_metrics import traffic\n"
            "from tieredkv import KVSpec, TieredCache\n"
            "spec = KVSpec(model_id='test/metrics', num_layers=2, num_kv_heads=2, head_dim=8, dtype='float16', "
            "chunk_tokens=4)\n"
            f"with TieredCache(spec, hot_name={seg_name!r}) as c:\n    traffic(c, spec, 1)\n")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
        d = samples(metrics.render([seg_name]))
        assert one(d, "tieredkv_lookups_total") == 6
        assert one(d, "tieredkv_prompt_tokens_total") == 102
        assert one(d, "tieredkv_lookup_seconds_count") == 6
        assert cache.stats()["lookups"] == 6


def test_missing_and_foreign_segments_are_down_not_errors(seg_name):
    fd = os.open(f"/dev/shm{seg_name}", os.O_CREAT | os.O_RDWR, 0o600)   # not a tieredkv segment
    try:
        os.write(fd, b"\0" * 8192)
    finally:
        os.close(fd)
    missing = seg_name + "-gone"
    text = metrics.render([seg_name, missing])
    assert f'tieredkv_segment_up{{segment="{seg_name}"}} 0.0' in text
    assert f'tieredkv_segment_up{{segment="{missing}"}} 0.0' in text
    assert "tieredkv_prompt_tokens_total{" not in text


def test_all_segments_when_none_named(spec, seg_name):
    with TieredCache(spec, hot_bytes=MiB, hot_name=seg_name) as cache:
        traffic(cache, spec, 2)
        text = metrics.render()
    assert f'tieredkv_prefix_hit_rate{{model="test/metrics",segment="{seg_name}"}}' in text


def test_prefix_hit_rate_comes_first(spec, seg_name):
    with TieredCache(spec, hot_bytes=MiB, hot_name=seg_name):
        text = metrics.render([seg_name])
    first = next(line for line in text.splitlines() if not line.startswith("#"))
    assert first.startswith("tieredkv_prefix_hit_rate{")


def test_serve_metrics_over_http(spec, seg_name):
    with TieredCache(spec, hot_bytes=MiB, hot_name=seg_name) as cache:
        traffic(cache, spec, 3)
        server = metrics.serve_metrics(0, [seg_name])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30) as r:
                body = r.read().decode()
        finally:
            server.shutdown()
            server.server_close()
    d = samples(body)
    assert one(d, "tieredkv_lookups_total") == 3
    assert one(d, "tieredkv_prefix_hit_rate") == pytest.approx(32 / 51)
    assert "python_gc_objects_collected_total" not in body  # only tieredkv's collector is registered


def test_missing_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(metrics.MissingDependency, match=r"pip install 'tieredkv\[metrics\]'"):
        metrics.render()
    with pytest.raises(ImportError):
        metrics.SegmentCollector()


def test_bad_segment_name_fails_at_construction():
    from tieredkv import InvalidName

    with pytest.raises(InvalidName):
        metrics.SegmentCollector(["../etc/passwd"])
