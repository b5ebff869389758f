"""The compiled kernels (numba) write exactly what the numpy code writes: same decisions, same state.

Every registered policy runs the conformance workload and a Mooncake trace slice twice, kernels on
and off, and every word of the final state (per-slot fields, globals, ghosts) and every victim must
match; so processes with and without numba can share one segment.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_policies_conformance import NAMES, _workload

from tieredkv.policies import _jit
from tieredkv.sim import Trace, read_trace, simulate

needs_numba = pytest.mark.skipif(not _jit.enable(), reason="numba is not installed (pip install 'tieredkv[fast]')")

MOONCAKE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces", "mooncake_synthetic_trace.jsonl")


@needs_numba
@pytest.mark.parametrize("name", NAMES)
def test_kernels_decide_and_write_like_numpy(name, monkeypatch):
    fast_log, fast_arrays = _workload(name, seed=3, steps=300)
    monkeypatch.setattr(_jit, "ENABLED", False)
    slow_log, slow_arrays = _workload(name, seed=3, steps=300)
    assert fast_log == slow_log
    for field, arr in slow_arrays.items():
        assert np.array_equal(fast_arrays[field], arr), field


@pytest.fixture(scope="module")
def trace_slice():
    full = read_trace(MOONCAKE)
    return Trace.from_requests(full.request(i).tolist() for i in range(300))


@needs_numba
@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "prefix_aware:clock", "kv_aware"])
def test_replay_is_identical_with_and_without_kernels(name, trace_slice, monkeypatch):
    cap = round(0.05 * trace_slice.unique_blocks)
    states = []

    import tieredkv.sim.replay as replay
    orig = replay._Cache.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        states.append(self)

    monkeypatch.setattr(replay._Cache, "__init__", spy)
    fast = simulate(trace_slice, name, cap)
    monkeypatch.setattr(_jit, "ENABLED", False)
    slow = simulate(trace_slice, name, cap)
    for key in ("hits", "prefix_hits", "evictions"):
        assert fast[key] == slow[key], key
    a, b = states
    assert np.array_equal(a.block_at, b.block_at)
    for field in a.st.layout.slot_fields:
        assert np.array_equal(getattr(a.st, field), getattr(b.st, field)), field
    assert np.array_equal(a.st.globals_view(), b.st.globals_view())
    assert np.array_equal(a.st._gring, b.st._gring) and np.array_equal(a.st._gflag, b.st._gflag)
    assert np.array_equal(a.st._table.keys, b.st._table.keys)
    assert np.array_equal(a.st._table.refs, b.st._table.refs)


def test_policies_still_import_without_numba():
    """With numba missing, ``_jit`` says so and ``base`` takes the numpy path (checked in a fresh
    interpreter where importing numba fails)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['numba'] = None\n"
            "from tieredkv.policies import _jit\n"
            "assert not _jit.ENABLED and _jit.insert_common is None\n"
            "from tieredkv.sim import synthetic_trace, simulate\n"
            "print(simulate(synthetic_trace(50, seed=1), 'lru', 40)['hits'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from tieredkv.sim import synthetic_trace
    assert int(out.stdout.strip()) == simulate(synthetic_trace(50, seed=1), "lru", 40)["hits"]


@pytest.mark.procs
def test_a_serving_process_never_imports_numba_unless_asked():
    """The hot tier's live policies run the numpy path by default: numba is not even imported (an
    in-process vLLM engine fails on a loaded llvmlite, and every worker would compile the kernels).
    ``TIEREDKV_NUMBA=1`` turns the kernels on; the simulator turns them on by itself."""
    import subprocess
    import sys

    code = ("import os, sys, numpy as np\n"
            "from tieredkv import KVSpec, TieredCache\n"
            "from tieredkv.policies import _jit\n"
            "spec = KVSpec(model_id='jit', num_layers=1, num_kv_heads=1, head_dim=8, dtype='float32', chunk_tokens=4)\n"
            "name = f'/tieredkv-jit-{os.getpid()}'\n"
            "with TieredCache(spec, hot_bytes=1 << 20, hot_name=name) as cache:\n"
            "    cache.store(np.arange(64), np.ones((1, 2, 1, 64, 8), np.float32))\n"
            "    assert cache.lookup(np.arange(65)).tokens == 64\n"
            "    cache.hot.unlink()\n"
            "print(_jit.ENABLED, 'numba' in sys.modules)\n"
            "from tieredkv.sim import synthetic_trace, simulate\n"
            "simulate(synthetic_trace(20, seed=1), 'lru', 10)\n"
            "print(_jit.ENABLED, 'numba' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TIEREDKV_NUMBA", "TIEREDKV_NO_NUMBA")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False False", "True True"]
    asked = subprocess.run([sys.executable, "-c", "from tieredkv.policies import _jit; print(_jit.ENABLED)"],
                           capture_output=True, text=True, timeout=300, env={**env, "TIEREDKV_NUMBA": "1"})
    assert asked.stdout.strip() == "True", asked.stderr
