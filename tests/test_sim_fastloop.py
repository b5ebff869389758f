"""The compiled replay loop (``tieredkv.sim.fastloop``) ends where the request-by-request replay ends.

For every policy the loop takes, on slices of both Mooncake traces at several capacities: the same
hits, prefix hits and evictions (so hit ratios equal to the last digit), and the same state word for
word (every slot field, global and ghost word, the block id <-> slot maps and the free slots) as the
request-by-request replay through the numpy policy code, which is what the hot tier runs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tieredkv.sim.replay as replay
from tieredkv.policies import _jit
from tieredkv.sim import Trace, fastloop, read_trace, simulate

pytestmark = pytest.mark.skipif(not _jit.enable(), reason="numba is not installed (pip install 'tieredkv[fast]')")

TRACES = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces")
POLICIES = ["lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc"]


def _slice(kind: str, n: int) -> Trace:
    full = read_trace(os.path.join(TRACES, f"mooncake_{kind}_trace.jsonl"))
    return Trace.from_requests((full.request(i).tolist() for i in range(n)), name=f"{kind}[:{n}]")


@pytest.fixture(scope="module")
def traces():
    return {"synthetic": _slice("synthetic", 600), "conversation": _slice("conversation", 900)}


def _replay_both(trace, name, capacity, monkeypatch):
    """(compiled result, its _Cache, request-by-request numpy result, its _Cache)."""
    caches, used = [], []
    orig_init, orig_run = replay._Cache.__init__, fastloop.run

    def spy_init(self, *a, **k):
        orig_init(self, *a, **k)
        caches.append(self)

    def spy_run(*a, **k):
        out = orig_run(*a, **k)
        used.append(out is not None)
        return out

    monkeypatch.setattr(replay._Cache, "__init__", spy_init)
    monkeypatch.setattr(fastloop, "run", spy_run)
    fast = simulate(trace, name, capacity)
    assert used == [True], "the compiled loop did not run"
    monkeypatch.setattr(_jit, "ENABLED", False)  # the numpy path: no kernels, no compiled loop
    slow = simulate(trace, name, capacity)
    monkeypatch.setattr(_jit, "ENABLED", True)
    assert used == [True]
    return fast, caches[0], slow, caches[1]


def _assert_same_state(a, b):
    for field in a.st.layout.slot_fields:
        assert np.array_equal(getattr(a.st, field), getattr(b.st, field)), field
    assert np.array_equal(a.st.globals_view(), b.st.globals_view())
    assert np.array_equal(a.st._gw, b.st._gw)
    assert np.array_equal(a.st._table.keys, b.st._table.keys)
    assert np.array_equal(a.st._table.refs, b.st._table.refs)
    assert np.array_equal(a.slot_of, b.slot_of) and np.array_equal(a.block_at, b.block_at)
    assert a.free == b.free and a.evictions == b.evictions


@pytest.mark.parametrize("kind", ["synthetic", "conversation"])
@pytest.mark.parametrize("name", POLICIES)
def test_compiled_loop_replays_like_the_numpy_policies(name, kind, traces, monkeypatch):
    trace = traces[kind]
    for fraction in (0.01, 0.05, 0.2):
        cap = max(1, round(fraction * trace.unique_blocks))
        fast, a, slow, b = _replay_both(trace, name, cap, monkeypatch)
        assert fast["evictions"] > 0
        for key in ("hits", "prefix_hits", "evictions", "block_hit_ratio", "prefix_hit_ratio"):
            assert fast[key] == slow[key], (key, cap)
        _assert_same_state(a, b)


@pytest.mark.parametrize("name", POLICIES)
def test_compiled_loop_at_tiny_capacities(name, traces, monkeypatch):
    """One and two slots: requests longer than the cache, S3-FIFO without ghost room, ARC's bounds."""
    trace = Trace.from_requests(traces["synthetic"].request(i).tolist() for i in range(150))
    for cap in (1, 2, 7):
        fast, a, slow, b = _replay_both(trace, name, cap, monkeypatch)
        assert (fast["hits"], fast["prefix_hits"]) == (slow["hits"], slow["prefix_hits"])
        _assert_same_state(a, b)


def test_repeated_ids_in_a_request_replay_request_by_request(monkeypatch):
    """The loop assumes distinct ids per request (what ``Trace.from_requests`` makes); a trace built
    around that falls back to the request-by-request replay, with the same result."""
    blocks = np.array([0, 1, 0, 2, 3, 3, 1, 4], dtype=np.int64)
    trace = Trace("repeats", blocks, np.array([0, 3, 6, 8], dtype=np.int64))
    cache = replay._Cache(replay.policies.make("lru"), 3, trace.unique_blocks)
    assert fastloop.run(cache, trace) is None
    fast = simulate(trace, "lru", 3)
    monkeypatch.setattr(_jit, "ENABLED", False)
    assert simulate(trace, "lru", 3)["hits"] == fast["hits"]


def test_progress_counts_every_request(traces):
    trace = traces["synthetic"]
    done: list[int] = []
    result = simulate(trace, "s3fifo", 50, progress=done.append)
    assert sum(done) == trace.n_requests and len(done) > 10
    assert result["hits"] == simulate(trace, "s3fifo", 50)["hits"]


def test_only_policies_with_kernels_for_every_hook_take_the_loop(monkeypatch):
    from tieredkv import policies
    from tieredkv.policies.order import oldest

    assert all(fastloop.supports(policies.make(n)) for n in POLICIES)
    for other in ("prefix_aware", "cost_aware", "kv_aware", "prefix_aware:lru"):
        assert not fastloop.supports(policies.make(other))

    class MyLRU(policies.EvictionPolicy):   # a subclass may change any hook: request by request
        name = "my_lru_fastloop_test"

        def choose(self, st, n, candidates):
            return oldest(st.last_access, n, candidates)

    assert not fastloop.supports(MyLRU())
    monkeypatch.setattr(_jit, "ENABLED", False)
    assert not fastloop.supports(policies.make("lru"))


def test_kernel_cache_is_keyed_by_the_kernels_sources(tmp_path):
    """numba checks a cached function against its own file only, though it carries the code of the
    kernels it calls from other files; ``_jit.compiler`` names every cache entry after a digest of
    the kernel sources (and the caller's), so an edit anywhere compiles afresh."""
    src = tmp_path / "caller.py"
    names = []
    for text in ("a = 1\n", "a = 2\n", "a = 1\n"):
        src.write_text(text)

        def kernel(x):
            return x + 1

        compiled = _jit.compiler(str(src))(kernel)
        assert compiled(1) == 2
        names.append(kernel.__qualname__)
    assert names[0] != names[1] and names[0] == names[2]
    assert names[0].startswith("test_kernel_cache_is_keyed_by_the_kernels_sources.<locals>.kernel_")


def test_the_command_line_says_when_the_loop_compiles_first(tmp_path, traces):
    """A first replay after an install compiles the loop for about a minute without progress, so
    ``tieredkv simulate`` says so beforehand: with an empty numba cache for the loop's policies, not
    for policies that replay request by request, and not once the loop is compiled in this process."""
    import subprocess
    import sys

    probe = "from tieredkv.sim import fastloop; print(fastloop.needs_compiling(%r))"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    said = {names: subprocess.run([sys.executable, "-c", probe % (list(names),)], env=env, capture_output=True,
                                  text=True, check=True).stdout.strip()
            for names in (("lru",), ("kv_aware",), ("kv_aware", "arc"))}
    assert said == {("lru",): "True", ("kv_aware",): "False", ("kv_aware", "arc"): "True"}
    simulate(traces["synthetic"], "lru", 64)  # compiles or loads the loop here
    assert not fastloop.needs_compiling(["lru"])
