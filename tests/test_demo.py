"""The serving demo: its private cache, its numbers, and one tiny end-to-end run on real processes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import LazyModule
from tieredkv import KVSpec, demo

torch = LazyModule("torch")  # imported by the tests that use it, not at collection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = KVSpec(model_id="demo-test", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=4)


def _kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, 2, n_tokens, 4), generator=g)


def test_private_cache_contract():
    cache = demo.PrivatePrefixCache(SPEC)
    tokens = np.arange(10)
    kv = _kv(8)
    assert cache.lookup(tokens).tokens == 0
    assert cache.store(tokens[:8], kv) == 2
    assert cache.store(tokens[:8], kv) == 0          # already there
    hit = cache.lookup(tokens)
    assert (hit.tokens, hit.hot_blocks, hit.warm_blocks) == (8, 2, 0)
    out = torch.zeros((2, 2, 2, 8, 4))
    assert cache.load(hit, out) == 8
    assert torch.equal(out, kv)
    assert cache.lookup(tokens[:8]).tokens == 4      # a hit leaves at least one token to compute
    assert cache.lookup(tokens, salt=b"other").tokens == 0
    assert cache.stats()["bytes"] == 2 * SPEC.block_bytes


def test_private_cache_capacity_drops_least_recent():
    cache = demo.PrivatePrefixCache(SPEC, capacity_bytes=2 * SPEC.block_bytes)
    cache.store(np.arange(12), _kv(12))
    assert cache.stats()["blocks"] == 2
    assert cache.lookup(np.arange(13)).tokens == 0   # the first block went first: the chain is cut


PSS = {"Pss": 100, "Pss_Anon": 60, "Pss_Shmem": 30, "Pss_File": 10}


def test_summary_and_table():
    settings = demo.Settings(workers=2, requests_per_worker=2, prefix_tokens=8, suffix_tokens=4,
                             chunk_tokens=4, new_tokens=2)
    done = [{"request": i, "worker": i // 2, "ttft_ms": t, "total_ms": t + 1, "cached_tokens": c,
             "computed_tokens": 12 - c, "prompt_tokens": 12, "new_tokens": 2, "restore_ms": 0.1, "store_ms": 0.1,
             "phases": {"lookup": 0.1, "lookup_cpu": 0.1, "forward": t - 0.5, "forward_cpu": t / 4, "store": 0.3,
                        "store_cpu": 0.2, "cpu": t / 4 + 0.1, "wait": 3 * t / 4 - 0.1}}
            for i, (t, c) in enumerate(((10.0, 0), (2.0, 8), (3.0, 8), (4.0, 8)))]
    stats = [{"prefix_hot_blocks": 2, "prefix_warm_blocks": 2, "cache": {}}] * 2
    shared = demo.summarize("shared", settings, SPEC, done, stats, wall_s=2.0, pss=PSS, rss=200)
    assert shared["prefix_hit_rate"] == 0.75 == shared["ideal_prefix_hit_rate"]
    assert shared["prefix_kv_bytes"] == 2 * SPEC.block_bytes            # held once
    private = demo.summarize("private", settings, SPEC, done, stats, wall_s=2.0, pss=PSS, rss=200)
    assert private["prefix_kv_bytes"] == 4 * SPEC.block_bytes           # once per worker
    assert private["ideal_prefix_hit_rate"] == 0.5
    assert shared["tokens_per_s"] == 4.0 and shared["ttft_p50_ms"] == 3.5
    assert (shared["pss_bytes"], shared["pss_shmem_bytes"]) == (100, 30)
    doc = {"settings": {**demo.Settings().__dict__, "kv_bytes_per_token": SPEC.bytes_per_token},
           "configs": {"no_cache": {**shared, "prefix_hit_rate": 0.0}, "shared": shared}}
    table = demo.format_table(doc)
    assert "shared vs no_cache" in table and "TTFT p50" in table
    # Where the time went: the mean CPU per phase (forward (10+2+3+4)/4/4 ms), the waiting, the store after.
    assert shared["phases_ms"]["forward_cpu"]["mean"] == 19 / 16
    assert shared["ttft_cpu_p50_ms"] == pytest.approx(3.5 / 4 + 0.1)
    assert "  shared    1.3 ms CPU (forward 1.2, lookup 0.1) + 3.5 ms waiting; then 0.2 ms CPU storing" in table
    assert [r["request"] for r in shared["per_request"]] == [0, 1, 2, 3]
    # Several rounds: the table says the spread; a busy machine gets a note; a quiet one does not.
    rounds = [dict(shared, ttft_p50_ms=t, ttft_cpu_p50_ms=t / 10) for t in (30.0, 10.0, 20.0)]
    chosen = demo._median_round(rounds)
    assert chosen["ttft_p50_ms"] == 20.0 and chosen["ttft_p50_ms_rounds"] == [30.0, 10.0, 20.0]
    private = demo._median_round([dict(shared, ttft_p50_ms=t, ttft_cpu_p50_ms=t / 5) for t in (20.0, 20.0, 20.0)])
    busy = {**doc, "configs": {"private": private, "shared": chosen},
            "rounds": [{"busy_before": 0.6, "loadavg_before": [9.0, 8.0, 7.0], "loadavg_after": [9.0, 8, 7]}]}
    text = demo.format_table(busy)
    assert "shared vs private TTFT p50 +50%, -50%, +0% (median +0%)" in text
    assert "CPU to 1st token -25%, -75%, -50% (median -50%)" in text
    assert "NOTE: the machine was busy" in text and "load average up to 9.0" in text
    quiet = {**busy, "rounds": [{"busy_before": 0.05, "loadavg_before": [0.2, 0, 0], "loadavg_after": [1, 0, 0]}]}
    assert "NOTE" not in demo.format_table(quiet)


def test_the_share_of_the_machine_other_programs_used_and_when_that_is_too_much():
    """CPU time of the demo's own processes is not counted as other programs'; a round during which
    others took most of the CPUs gets the note that wall-clock comparisons mean little, a quiet one
    none; the summary names the write-behind thread's CPU."""
    assert demo.others_busy((0, 0, 0), (1000, 700, 200)) == {"others_busy": 0.5, "demo_busy": 0.2}
    assert demo.others_busy((5, 5, 5), (5, 5, 5)) == {"others_busy": 0.0, "demo_busy": 0.0}
    before = demo.cpu_sample([])
    t = time.process_time()
    while time.process_time() - t < 0.3:  # this process's own work: counted as the demo's
        pass
    got = demo.others_busy(before, demo.cpu_sample([]))
    assert got["demo_busy"] > 0 and 0 <= got["others_busy"] <= 1
    settings = {**demo.Settings().__dict__, "cpu_count": 2}
    phases = {"cpu": {"mean": 40.0}, "wait": {"mean": 9.0}, "forward_cpu": {"mean": 35.0},
              "other_threads_cpu": {"mean": 1.5}}
    doc = {"settings": settings, "configs": {"shared": {"phases_ms": phases}},
           "rounds": [{"busy_before": 0.1, "loadavg_before": [3.0, 0, 0], "loadavg_after": [6.5, 0, 0],
                       "others_busy": {"private": 0.2, "shared": 0.7}}]}
    text = "\n".join(demo.load_lines(doc) + demo.where_time_went(doc))
    assert "other programs used 20-70% of them while the configurations served" in text
    assert "load average up to 6.5" in text and "NOTE: the machine was busy" in text and "Too loaded" in text
    assert "(its other threads, the write-behind writer's, used 1.5 ms CPU meanwhile)" in text
    doc["rounds"][0]["others_busy"] = {"private": 0.02, "shared": 0.05}
    quiet = "\n".join(demo.load_lines(doc))
    assert "NOTE" not in quiet and "Too loaded" not in quiet


def test_the_progress_bar_promises_no_time_left(monkeypatch):
    """The first request computes the whole prompt alone and the rest restore it: an estimate from it
    promised an hour for a run of minutes. The bar shows the time so far, never a time left."""
    import io

    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = demo._Progress(32, True)
    bar.stage("shared: serving")
    bar.advance()
    time.sleep(0.2)
    bar.advance()
    bar.close()
    text = err.getvalue()
    assert "2/32 requests" in text and "so far]" in text
    assert "<" not in text and "remaining" not in text and "?" not in text


def test_pss_of_this_process():
    mine = demo.pss_bytes(os.getpid())
    assert mine["Pss"] > 0 and mine["Pss"] >= mine["Pss_Anon"]


def test_bad_flags_are_refused():
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.main(parser.parse_args(["--configs", "nope"])) == 2
    assert demo.main(parser.parse_args(["--configs", "restart"])) == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--workers", "0"])
    assert parser.parse_args(["--hot-bytes", "512M"]).hot_bytes == 512 << 20


@pytest.mark.procs
def test_demo_end_to_end_on_worker_processes(tmp_path):
    """2 workers x 2 requests through all four configurations; checks the JSON's shape and hit rates."""
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "tieredkv.demo", "--workers", "2", "--requests-per-worker", "2",
         "--prefix-tokens", "128", "--suffix-tokens", "16", "--new-tokens", "2", "--no-progress", "--rounds", "2",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"settings", "configs", "rounds"}
    assert len(doc["rounds"]) == 2 and all(0 <= r["busy_before"] <= 1 for r in doc["rounds"])
    assert list(doc["configs"]) == ["no_cache", "private", "shared", "restart"]
    for name, c in doc["configs"].items():
        for field in ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s", "prefix_hit_rate", "prefix_kv_bytes",
                      "pss_bytes"):
            assert isinstance(c[field], (int, float)), (name, field)
        assert c["requests"] == 4 and c["pss_bytes"] > 0 and c["tokens_per_s"] > 0
        assert len(c["ttft_p50_ms_rounds"]) == 2 and c["ttft_p50_ms"] in c["ttft_p50_ms_rounds"]
        assert c["pss_untrimmed_bytes"] > 0 and c["phases_ms"]["forward_cpu"]["mean"] > 0
        assert len(c["per_request"]) == 4
    c = doc["configs"]
    assert c["no_cache"]["prefix_hit_rate"] == 0 and c["no_cache"]["prefix_kv_bytes"] == 0
    assert c["private"]["prefix_hit_rate"] == 0.5                  # each worker's first request misses
    assert c["shared"]["prefix_hit_rate"] == 0.75                   # only the service's first misses
    assert c["restart"]["prefix_hit_rate"] == 1.0                   # every block comes from the warm tier
    block = doc["settings"]["block_bytes"]
    assert c["shared"]["prefix_kv_bytes"] == 2 * block              # 128 tokens = 2 blocks, held once
    assert c["private"]["prefix_kv_bytes"] == 2 * 2 * block         # ... and once per worker
    assert doc["settings"]["workers"] == 2 and doc["settings"]["prefix_tokens"] == 128
    assert png.stat().st_size > 0
    assert "restart vs no_cache" in proc.stdout and "2 rounds" in proc.stdout
    assert "where the time to the first token went" in proc.stdout and "what the columns mean" in proc.stdout
    # Where the time went, per request: page faults per phase, the timeline, busy workers, a fresh
    # worker's first hit against its later ones (shared: every worker's first request hits).
    for name, cfg in c.items():
        for r in cfg["per_request"]:
            assert r["at"][0] <= r["at"][1] <= r["at"][2] and r["busy_workers"] >= 1 - 1e-6, (name, r)
            assert r["arrival_ttft_ms"] >= r["ttft_ms"] - 1e-6 and "load_faults" in r["phases"]
        assert cfg["busy_workers_mean"] >= 1 - 1e-6 and cfg["phases_ms"]["decode_cpu"]["mean"] > 0
    assert c["no_cache"]["busy_workers_hits_mean"] == 0.0          # no hits to count
    assert c["shared"]["busy_workers_hits_mean"] >= 1 - 1e-6 and "busy workers beside a hit" in proc.stdout
    assert c["shared"]["first_in_worker"]["first"]["requests"] == 1
    assert c["shared"]["first_in_worker"]["later"]["requests"] == 2
    assert "busy workers on" in proc.stdout and "from each request's arrival" in proc.stdout
    # Each round started cold: the shared config's first request missed in both.
    assert [r["cached_tokens"] for r in c["shared"]["per_request"]][0] == 0
    # Greedy decoding: every configuration generates the same tokens for the same request.
    answers = {name: tuple(cfg["first_answer_ids"]) for name, cfg in c.items()}
    assert len(set(answers.values())) == 1 and len(answers["shared"]) == 2, answers
    assert not [p for p in os.listdir("/dev/shm") if doc["settings"]["namespace_tag"] in p]


class _WordTokenizer:
    """A tokenizer's call signature over a fixed vocabulary of words (what make_requests uses)."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.ids.setdefault(w, len(self.ids)) for w in text.split()]}


def test_text_prompts_share_the_system_prompt_and_differ_in_the_question():
    settings = demo.Settings(workers=2, requests_per_worker=2, prefix_tokens=100, suffix_tokens=12)
    tok = _WordTokenizer()
    requests = demo.make_requests(settings, 10_000, tok)
    assert len(requests) == 4
    system = tok(demo.SYSTEM_TEXT)["input_ids"]
    for r in requests:
        assert r[:100].tolist() == (system * 3)[:100]               # the system prompt, repeated to 100
        assert 100 < len(r) <= 112
    assert len({tuple(r[100:]) for r in requests}) == 4              # every question its own


def test_busy_workers_first_hits_and_the_shared_vs_private_account():
    """Per request, the mean number of workers serving while it waited for its first token; a worker's
    first hit against its later ones; the summary's account of shared vs private TTFT as CPU x busy."""
    def req(i, worker, at, cpu, cached=8, first=False, faults=0):
        return {"request": i, "worker": worker, "at": at, "cached_tokens": cached, "first_in_worker": first,
                "phases": {"cpu": cpu, "faults": faults, "load_cpu": cpu / 2, "load_faults": faults,
                           "forward_cpu": cpu / 2, "forward_faults": 0}}
    done = [req(0, 0, [0.0, 1.0, 2.0], 10.0, first=True, faults=900),   # alone but for request 1's second half
            req(1, 1, [0.5, 1.5, 3.0], 4.0, faults=10),                   # beside request 0 throughout
            req(2, 0, [2.0, 2.0, 2.5], 4.0, faults=30)]                   # zero-length wait: itself only
    assert demo.busy_workers(done) == [1.5, 2.0, 1.0]
    assert [d["busy_workers"] for d in done] == [1.5, 2.0, 1.0]
    assert demo._hits_mean(done + [dict(req(3, 1, [3.0, 4.0, 5.0], 9.0, cached=0), busy_workers=5.0)],
                           "busy_workers") == 1.5          # the miss is left out
    assert demo.busy_workers([{"request": 0}]) == []                      # older workers: no timeline
    split = demo.first_vs_later(done)
    assert split["first"]["requests"] == 1 and split["first"]["faults"] == 900
    assert split["later"]["requests"] == 2 and split["later"]["cpu"] == 4.0 and split["later"]["faults"] == 20
    # A miss is no first *hit*.
    assert "first" not in demo.first_vs_later([req(0, 0, [0, 1, 2], 10.0, cached=0, first=True)])

    settings = {**demo.Settings().__dict__, "cpu_count": 2, "kv_bytes_per_token": 1024}
    phases = {"cpu": {"mean": 50.0}, "wait": {"mean": 150.0}, "forward_cpu": {"mean": 45.0},
              "faults": {"mean": 1200.0}, "decode_cpu": {"mean": 160.0}}
    shared = {"phases_ms": phases, "busy_workers_mean": 8.0, "ttft_p50_ms": 230.0, "ttft_cpu_p50_ms": 50.0,
              "first_in_worker": {"first": {"cpu": 80.0, "load_cpu": 30.0, "forward_cpu": 48.0, "faults": 9500.0},
                                  "later": {"cpu": 52.0, "faults": 30.0}}}
    private = {"phases_ms": phases, "busy_workers_mean": 7.0, "ttft_p50_ms": 200.0, "ttft_cpu_p50_ms": 50.0}
    text = "\n".join(demo.where_time_went({"settings": settings, "configs": {"private": private, "shared": shared}}))
    assert "160.0 ms CPU decoding" in text
    assert "beside 8.0 busy workers on 2 CPUs; 1,200 page faults (first touches) per request" in text
    assert ("a worker's first hit 80.0 ms CPU (load 30.0, forward 48.0, 9,500 faults), its later hits 52.0 ms "
            "CPU") in text
    # Same CPU, 8 busy workers against 7: +14% predicted, +15% measured.
    assert ("shared vs private: TTFT p50 +15%; CPU to 1st token +0% and busy workers 8.0 vs 7.0 (+14%: more "
            "requests in flight at once) predict +14% where nothing else runs") in text
    # Up to one busy worker per CPU nobody waits for a core: no difference predicted.
    two = {"private": dict(private, busy_workers_mean=1.0), "shared": dict(shared, busy_workers_mean=2.0)}
    assert "predict +0%" in "\n".join(demo.where_time_went({"settings": settings, "configs": two}))
    # Where the JSON says how many were busy beside the hits (the p50 lies among them), that counts.
    hits = {"private": dict(private, busy_workers_hits_mean=7.0), "shared": dict(shared, busy_workers_hits_mean=7.7)}
    assert ("busy workers beside a hit 7.7 vs 7.0 (+10%: more requests in flight at once) predict +10%"
            in "\n".join(demo.where_time_went({"settings": settings, "configs": hits})))


def test_ttft_from_arrival_counts_the_wait_behind_the_workers_earlier_requests():
    """A request queued behind its worker's earlier ones waits for them: the TTFT a client sees counts
    that; the table's TTFT (from the worker taking it) does not. Both are reported."""
    settings = demo.Settings(workers=1, requests_per_worker=2, prefix_tokens=8, suffix_tokens=4, chunk_tokens=4)
    done = [{"request": i, "worker": 0, "ttft_ms": 2.0, "arrival_ttft_ms": a, "total_ms": 3.0, "cached_tokens": 8,
             "computed_tokens": 4, "prompt_tokens": 12, "new_tokens": 2, "restore_ms": 0.1, "store_ms": 0.1,
             "phases": {"cpu": 1.0, "wait": 1.0}} for i, a in enumerate((2.0, 5.0, 8.0))]
    stats = [{"prefix_hot_blocks": 2, "prefix_warm_blocks": 0, "cache": {}}]
    c = demo.summarize("shared", settings, SPEC, done, stats, wall_s=1.0, pss=PSS, rss=1)
    assert c["ttft_p50_ms"] == 2.0 and c["arrival_ttft_p50_ms"] == 5.0
    assert [r["arrival_ttft_ms"] for r in c["per_request"]] == [2.0, 5.0, 8.0]
    configs = {"private": {**c, "busy_workers_mean": 1.0, "ttft_cpu_p50_ms": 1.0, "arrival_ttft_p50_ms": 20.0},
               "shared": {**c, "busy_workers_mean": 1.0, "ttft_cpu_p50_ms": 1.0}}
    text = "\n".join(demo.where_time_went({"settings": {"cpu_count": 2}, "configs": configs}))
    assert "from each request's arrival" in text and "TTFT p50 shared 5.0 ms, private 20.0 ms (-75%)" in text
