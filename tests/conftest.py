"""Shared fixtures: tiny specs and unique segment names (always unlinked)."""

from __future__ import annotations

import os
import re
import secrets
from functools import cache
from pathlib import Path

import posix_ipc
import pytest

from tieredkv import KVSpec

# ---- the quick set: `python -m pytest -q -m quick` -----------------------------------------------------
# The inner loop: every test that is not slow, starts no processes and no store server, needs no GPU,
# and is not in a module that imports vLLM or SGLang (their imports alone take about 10 s). With
# `-m quick` those modules are not even imported. The full suite runs all of it too.
_NOT_QUICK = ("slow", "procs", "soak", "gpu", "server", "engine")
#: Fixtures that start a store server (valkey-server) for the tests that use them; a parameter with a
#: true ``starts_server`` attribute (a tier factory) does too.
_SERVER_FIXTURES = {"valkey_url", "valkey_server", "mooncake_server"}
_ENGINE_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:vllm|sglang)\b|importorskip\(\s*[\"'](?:vllm|sglang)", re.M)


# ---- the full suite on pytest-xdist: `python -m pytest -q -n 2 --dist loadfile` (README, .ci/run) ----------
#: The modules that start real vLLM engines (marked ``engine`` here). Under ``--dist loadfile`` they are
#: one unit of work, sent first to one worker, so their engines start one after another: two engines
#: at once would each spread over every core and gain nothing, and their start-ups are the suite's
#: longest chain (about 6 minutes on 2 cores). The other worker meanwhile runs the other modules, a
#: whole module at a time (their module-scoped fixtures are made once), the modules with the most
#: tests first, except vLLM's own connector tests: one test of about 2 minutes, sent second so that it
#: does not end the run alone.
ENGINE_MODULES = frozenset({"test_vllm_engine.py", "test_vllm_families.py", "test_vllm_safety_engine.py",
                            "test_vllm_try.py"})
_ENGINE_UNIT = "vllm-engines"
_FIRST_UNITS = (_ENGINE_UNIT, "tests/test_vllm_upstream.py")


def pytest_configure(config: pytest.Config) -> None:
    # TIEREDKV_SOAK=1 runs the soak too: the default deselection (pyproject's addopts, -m 'not soak')
    # would otherwise drop it before its own check of the variable is reached.
    if os.environ.get("TIEREDKV_SOAK") and config.option.markexpr == "not soak":
        config.option.markexpr = ""


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist (-p no:xdist) it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with the engine modules as one unit, first in the queue.

    (pytest-xdist's own ``--dist loadgroup`` would express this with ``xdist_group`` marks, but with
    pytest 9.2 it silently stops grouping: it renames node ids, which pytest no longer allows.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    class EngineFirst(OrderedDict):
        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            if key in _FIRST_UNITS:
                for first in reversed(_FIRST_UNITS):
                    if first in self:
                        self.move_to_end(first, last=False)

    class EnginesInOneUnit(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = EngineFirst()

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _ENGINE_UNIT if Path(path).name in ENGINE_MODULES else path

    return EnginesInOneUnit(config, log)


@cache
def _imports_an_engine(path: Path) -> bool:
    return path.suffix == ".py" and bool(_ENGINE_IMPORT.search(path.read_text()))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("markexpr", "").strip() == "quick" and collection_path.name.startswith("test_"):
        return _imports_an_engine(collection_path) or None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ENGINE_MODULES:
            item.add_marker(pytest.mark.engine)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (_SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or any(getattr(v, "starts_server", False) for v in params.values())):
            item.add_marker(pytest.mark.server)
        if not (any(item.get_closest_marker(m) for m in _NOT_QUICK) or _imports_an_engine(item.path)):
            item.add_marker(pytest.mark.quick)

# A remote tier refuses to start without the fleet's secret: the test fleet has its own, given the way
# operators give it (the environment; processes the tests spawn inherit it).
os.environ.setdefault("TIEREDKV_REMOTE_SECRET", secrets.token_hex(32))


@pytest.fixture
def tiny_spec() -> KVSpec:
    """2 layers x 2 (K,V) x 1 head x 4 tokens x 8 dims x fp32 = 512-byte blocks."""
    return KVSpec(model_id="test/tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32",
                  chunk_tokens=4)


@pytest.fixture
def namespace():
    """A model id of its own per test (``(tag, made)``): append each spec built under it to ``made``;
    their hot segments are removed afterwards."""
    tag = f"test-hf-{secrets.token_hex(5)}"
    made: list[KVSpec] = []
    yield tag, made
    from tieredkv.demo import drop_hot_tier

    for spec in made:
        drop_hot_tier(spec)


@pytest.fixture
def seg_name():
    """A fresh segment name, unlinked after the test whatever happened."""
    name = f"/tieredkv-test-{os.getpid()}-{secrets.token_hex(4)}"
    yield name
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
