"""The offline optimum: Belady's MIN (with and without bypass), the prefix optimum, the gap closed."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

from tieredkv import policies
from tieredkv.sim import Trace, read_trace, run_simulation, simulate, synthetic_trace
from tieredkv.sim.optimal import belady, gap_closed, is_prefix_tree, next_use

MOONCAKE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces", "mooncake_synthetic_trace.jsonl")


def _slice(trace: Trace, n: int) -> Trace:
    return Trace.from_requests((trace.request(i).tolist() for i in range(n)), name=f"{trace.name}[:{n}]")


def _exhaustive_optimum(keys: list[int], cap: int, bypass: bool) -> int:
    """Most hits any schedule gets on ``keys`` (one access at a time), by trying every choice."""

    @functools.cache
    def best(t: int, cached: frozenset) -> int:
        if t == len(keys):
            return 0
        k = keys[t]
        if k in cached:
            return 1 + best(t + 1, cached)
        if len(cached) < cap:
            return best(t + 1, cached | {k})
        options = [best(t + 1, (cached - {v}) | {k}) for v in cached]
        if bypass:
            options.append(best(t + 1, cached))
        return max(options)

    return best(0, frozenset())


def test_next_use():
    assert next_use(np.array([5, 6, 5, 7, 6, 5])).tolist() == [2, 4, 5, 6, 6, 6]


@pytest.mark.parametrize("bypass", [False, True])
def test_belady_is_optimal_on_small_traces(bypass):
    rng = np.random.default_rng(7)
    for _ in range(25):
        keys = rng.integers(0, 6, size=14).tolist()
        cap = int(rng.integers(1, 4))
        trace = Trace.from_requests([[k] for k in keys])
        ours = belady(trace, cap, bypass=bypass)["hits"]
        # Trace ids are dense remaps; hits do not depend on the names.
        assert ours == _exhaustive_optimum(keys, cap, bypass), (keys, cap)


def test_belady_bounds_every_policy_and_is_the_prefix_optimum():
    trace = synthetic_trace(300, seed=4)
    assert is_prefix_tree(trace)
    for cap in (60, 400):
        best = belady(trace, cap)
        assert best["exact_prefix"]
        # Never holds a block without its parent: every hit is a prefix hit.
        assert best["prefix_hit_ratio"] == best["block_hit_ratio"]
        for name in policies.names() + ["prefix_aware:arc"]:
            r = simulate(trace, name, cap)
            assert r["block_hit_ratio"] <= best["block_hit_ratio"] + 1e-12, name
            assert r["prefix_hit_ratio"] <= best["prefix_hit_ratio"] + 1e-12, name


def test_prefix_optimum_is_flagged_only_on_prefix_tree_traces():
    tree = Trace.from_requests([[1, 2, 3], [1, 2, 4], [1, 5]])
    not_tree = Trace.from_requests([[1, 2, 3], [9, 2, 4]])        # block 2 under two parents
    assert is_prefix_tree(tree) and not is_prefix_tree(not_tree)
    assert belady(tree, 2)["exact_prefix"] and not belady(not_tree, 2)["exact_prefix"]
    assert not belady(tree, 2, bypass=False)["exact_prefix"]


def test_belady_matches_libcachesim_access_for_access():
    lcs = pytest.importorskip("libcachesim")
    trace = _slice(read_trace(MOONCAKE), 600)
    nxt = next_use(trace.blocks).tolist()
    n = trace.n_accesses
    for cap in (round(0.05 * trace.unique_blocks), round(0.2 * trace.unique_blocks)):
        cache = lcs.Belady(cap)
        req = lcs.Request()
        req.obj_size = 1
        hits = 0
        for t, (key, nu) in enumerate(zip(trace.blocks.tolist(), nxt)):
            req.obj_id, req.clock_time = key, t
            req.next_access_vtime = nu if nu < n else 2 ** 62   # libCacheSim's "never"
            hits += cache.get(req)
        ours = belady(trace, cap, bypass=False)
        assert 0.05 < ours["block_hit_ratio"] < 0.95
        assert ours["hits"] == hits
        # Bypass can only help.
        assert belady(trace, cap)["hits"] >= hits


def test_gap_closed():
    assert gap_closed(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert gap_closed(0.2, 0.2, 0.4) == 0
    assert gap_closed(0.3, 0.4, 0.4) is None


def test_run_simulation_reports_the_optimum_and_the_gap_closed():
    trace = synthetic_trace(300, seed=3)
    out = run_simulation(trace, ["arc", "lru"], ["5%", "20%"])
    caps = sorted({r["capacity_blocks"] for r in out["results"]})
    assert [o["capacity_blocks"] for o in out["optimal"]] == caps
    for r in out["results"]:
        opt = next(o for o in out["optimal"] if o["capacity_blocks"] == r["capacity_blocks"])
        assert r["optimal_block_hit_ratio"] == opt["block_hit_ratio"] >= r["block_hit_ratio"]
        if r["policy"] == "lru":
            assert r["gap_closed"] == 0
        else:
            lru = next(x for x in out["results"]
                       if x["policy"] == "lru" and x["capacity_blocks"] == r["capacity_blocks"])
            assert r["gap_closed"] == pytest.approx(gap_closed(r["block_hit_ratio"], lru["block_hit_ratio"],
                                                               opt["block_hit_ratio"]))
    json.dumps(out)
    # The baseline is replayed on the side when it is not one of the policies asked for.
    alone = run_simulation(trace, ["arc"], ["5%"])
    assert [r["policy"] for r in alone["results"]] == ["arc"]
    assert [r["policy"] for r in alone["baseline"]] == ["lru"]
    assert alone["results"][0]["gap_closed"] == out["results"][0]["gap_closed"]
    assert "optimal" not in run_simulation(trace, ["arc"], ["5%"], optimal=False)


def test_cli_prints_the_optimum_and_plots_it(tmp_path, capsys):
    import argparse

    from tieredkv.sim import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--synthetic", "150", "--policy", "arc", "--capacity", "5%,20%", "--no-progress", "--jobs", "1",
            "--json", str(tmp_path / "o.json")]
    if _has_matplotlib():
        argv += ["--plot", str(tmp_path / "mrc.png")]
    assert main(parser.parse_args(argv)) == 0
    table = capsys.readouterr().out
    assert table.count("belady (optimum)") == 2 and "gap closed" in table
    assert "exact prefix optimum" in table
    out = json.loads((tmp_path / "o.json").read_text())
    assert len(out["optimal"]) == 2 and out["results"][0]["gap_closed"] is not None
    if _has_matplotlib():
        assert (tmp_path / "mrc.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
