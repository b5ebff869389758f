"""The trace simulator: readers, synthetic generator, hit-ratio accounting, JSON shape, plot, CLI."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pytest

from tieredkv import policies
from tieredkv.errors import FormatError, InvalidInput
from tieredkv.sim import (
    Trace,
    add_arguments,
    main,
    plot_mrc,
    read_trace,
    resolve_capacity,
    run_simulation,
    simulate,
    simulate_tiered,
    synthetic_trace,
    write_trace,
)

MOONCAKE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces", "mooncake_synthetic_trace.jsonl")


# ---- traces ----------------------------------------------------------------------------------------
def test_read_mooncake_jsonl(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]}\n'
                 '\n'
                 '{"timestamp": 40, "input_length": 1600, "output_length": 5, "hash_ids": [7, 8, 9, 9]}\n')
    t = read_trace(p)
    assert t.n_requests == 2 and t.unique_blocks == 3
    assert t.requests() == [[0, 1], [0, 1, 2]]       # dense ids; the repeated 9 counted once
    assert t.timestamps_ms.tolist() == [0, 40]


def test_real_mooncake_trace_loads():
    t = read_trace(MOONCAKE)
    assert (t.n_requests, t.n_accesses, t.unique_blocks) == (3993, 121877, 43924)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_write_then_read_round_trips(tmp_path, suffix):
    t = synthetic_trace(50, seed=4)
    p = tmp_path / f"trace{suffix}"
    write_trace(t, p)
    back = read_trace(p)
    assert back.requests() == t.requests()


def test_string_block_ids(tmp_path):
    p = tmp_path / "ours.jsonl"
    p.write_text(json.dumps({"blocks": ["aa", "bb"]}) + "\n" + json.dumps({"blocks": ["aa", "cc"]}) + "\n")
    assert read_trace(p).requests() == [[0, 1], [0, 2]]


def test_bad_trace_files(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0}\n')
    with pytest.raises(FormatError, match="hash_ids"):
        read_trace(p)
    p.write_text("not json\n")
    with pytest.raises(FormatError, match="not JSON"):
        read_trace(p)
    q = tmp_path / "bad.csv"
    q.write_text("a,b\n1,2\n")
    with pytest.raises(FormatError, match="request"):
        read_trace(q)
    with pytest.raises(InvalidInput, match="csv, jsonl"):
        read_trace(tmp_path / "trace.parquet")


def test_synthetic_is_seeded_and_shares_prefixes():
    a, b, c = synthetic_trace(300, seed=1), synthetic_trace(300, seed=1), synthetic_trace(300, seed=2)
    assert a.requests() == b.requests()
    assert a.requests() != c.requests()
    reqs = a.requests()
    firsts = {r[0] for r in reqs}
    assert len(firsts) <= 32                               # every request opens with a system prompt
    grown = sum(1 for x, y in zip(reqs, reqs[1:]) if len(y) > len(x) and y[:len(x)] == x)
    assert grown > 0                                       # some turns extend the previous turn
    assert a.unique_blocks < a.n_accesses                  # reuse exists


# ---- replay ----------------------------------------------------------------------------------------
def test_block_and_prefix_hit_ratio_by_hand():
    t = Trace.from_requests([[10, 11, 12], [10, 11, 13], [14, 11, 12]])
    r = simulate(t, "lru", 100)
    # request 2 hits 10, 11 (both leading); request 3 hits 11, 12 after a miss (not prefix hits)
    assert (r["hits"], r["prefix_hits"], r["accesses"]) == (4, 2, 9)
    assert r["block_hit_ratio"] == pytest.approx(4 / 9)
    assert r["prefix_hit_ratio"] == pytest.approx(2 / 9)


def test_capacity_is_respected_and_evictions_counted():
    t = Trace.from_requests([[i] for i in range(10)] + [[0]])
    r = simulate(t, "fifo", 4)
    assert r["evictions"] == 7 and r["hits"] == 0          # 0 was evicted long before it came back
    r = simulate(t, "fifo", 10)
    assert r["evictions"] == 0 and r["hits"] == 1


def test_request_longer_than_cache_keeps_its_leading_blocks():
    t = Trace.from_requests([list(range(10)), [0, 1, 2, 3]])
    r = simulate(t, "lru", 4)
    assert r["prefix_hits"] == 4


@pytest.mark.parametrize("name", ["fifo", "s3fifo", "clock", "prefix_aware:fifo"])
def test_a_request_never_evicts_its_own_hits(name):
    # Blocks 0..3 are oldest; request 3 hits 0 and 1, then stores 3 new blocks into a full cache.
    t = Trace.from_requests([[0, 1], [2, 3], [0, 1, 4, 5, 6], [0, 1]])
    r = simulate(t, name, 5)
    assert r["prefix_hits"] == 2 + 2


@pytest.mark.parametrize("capacity, blocks", [("1000", 1000), (1000, 1000), ("5%", 2196), (" 10% ", 4392)])
def test_resolve_capacity(capacity, blocks):
    assert resolve_capacity(capacity, 43924) == blocks


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "0%", "-5%", ""])
def test_resolve_capacity_rejects(bad):
    with pytest.raises(InvalidInput, match="percentage"):
        resolve_capacity(bad, 100)


def test_run_simulation_json_shape():
    t = synthetic_trace(300, seed=3)
    out = run_simulation(t, ["lru", "s3fifo", "prefix_aware:arc"], ["10%", 50])
    assert {"trace", "requests", "unique_blocks", "results"} <= set(out)
    assert out["requests"] == 300 and out["unique_blocks"] == t.unique_blocks
    rows = out["results"]
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        (p, c) for p in ("lru", "s3fifo", "prefix_aware:arc") for c in sorted({50, round(0.1 * t.unique_blocks)})]
    for r in rows:
        assert 0 <= r["prefix_hit_ratio"] <= r["block_hit_ratio"] <= 1
    json.dumps(out)                                        # plain JSON types only


def test_unknown_policy_fails_before_any_replay():
    with pytest.raises(policies.UnknownPolicy, match="valid: arc, clock"):
        run_simulation(synthetic_trace(10), ["lru", "belady"], [10])


def test_lru_hit_ratio_grows_with_capacity():
    """LRU is a stack algorithm: a bigger cache never hits less (requests shorter than the cache)."""
    t = synthetic_trace(400, seed=5)
    ratios = [simulate(t, "lru", c)["block_hit_ratio"] for c in (300, 600, 1200, 2400)]
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]


def test_mooncake_prefix_never_exceeds_block_hit_ratio():
    out = run_simulation(read_trace(MOONCAKE), ["lru", "prefix_aware:lru"], ["5%"])
    lru, pa = out["results"]
    assert 0 < lru["prefix_hit_ratio"] <= lru["block_hit_ratio"] < 1
    # Leaves-only eviction never strands a block, so nearly every hit is a usable prefix hit.
    assert pa["block_hit_ratio"] - pa["prefix_hit_ratio"] < lru["block_hit_ratio"] - lru["prefix_hit_ratio"]


def test_simulator_runs_a_users_policy():
    @policies.register
    class Newest(policies.EvictionPolicy):
        name = "test_newest"

        def choose(self, st, n, candidates):
            slots = np.flatnonzero(candidates)
            return slots[np.argsort(-st.insert_tick[slots])][:n]

    try:
        t = Trace.from_requests([[1], [2], [3], [1], [2]])
        assert simulate(t, "test_newest", 2)["hits"] == 1    # 3 replaced 2, so only 1 hits
    finally:
        from tieredkv.policies import base
        base._REGISTRY.pop("test_newest", None)


def test_two_level_replay():
    t = synthetic_trace(400, seed=6)
    hot_only = simulate(t, "lru", 200)
    both = simulate_tiered(t, "lru", 200, 2000)
    assert both["hot_hit_ratio"] + both["warm_hit_ratio"] == pytest.approx(both["block_hit_ratio"])
    assert both["block_hit_ratio"] > hot_only["block_hit_ratio"]
    assert both["warm_hit_ratio"] > 0 and both["demotions"] > 0
    never = simulate_tiered(t, "lru", 200, 2000, promotion="never")
    assert never["promotions"] == 0
    wt = simulate_tiered(t, "lru", 200, 2000, demotion="write_through")
    assert wt["demotions"] >= both["demotions"]
    picky = simulate_tiered(t, "lru", 200, 2000, demotion="on_nth_hit:1")
    assert picky["demotions"] < both["demotions"]


# ---- plot and CLI -------------------------------------------------------------------------------------
def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = run_simulation(synthetic_trace(100, seed=1), ["lru", "fifo"], ["5%", "20%"])
    path = plot_mrc(out, tmp_path / "mrc.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'tieredkv\[plot\]'"):
        plot_mrc({"results": [{}]}, tmp_path / "x.png")


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main(parser.parse_args(argv))


def test_cli_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    write_trace(synthetic_trace(120, seed=2), trace)
    rc = _cli(["--trace", str(trace), "--policy", "lru,s3fifo", "--capacity", "100,5%",
               "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "mrc.png"), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "s3fifo" in table and "prefix hit" in table
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["results"]) == 4 and out["requests"] == 120
    assert (tmp_path / "mrc.png").stat().st_size > 0


def test_cli_two_level_and_errors(capsys):
    assert _cli(["--synthetic", "80", "--policy", "arc", "--hot", "20", "--warm", "200", "--no-progress"]) == 0
    assert "warm" in capsys.readouterr().out
    assert _cli(["--synthetic", "10", "--policy", "nope", "--no-progress"]) == 2
    assert "valid: arc" in capsys.readouterr().err
    assert _cli(["--synthetic", "10", "--warm", "5", "--no-progress"]) == 2
    assert _cli(["--synthetic", "10", "--capacity", "lots", "--no-progress"]) == 2
    assert "percentage" in capsys.readouterr().err
    assert _cli(["--trace", "/nonexistent/trace.jsonl", "--no-progress"]) == 2
