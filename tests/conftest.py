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
_NOT_QUICK = ("slow", "procs", "soak", "gpu", "server")
#: Fixtures that start a store server (valkey-server) for the tests that use them; a parameter with a
#: true ``starts_server`` attribute (a tier factory) does too.
_SERVER_FIXTURES = {"valkey_url", "valkey_server", "mooncake_server"}
_ENGINE_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:vllm|sglang)\b|importorskip\(\s*[\"'](?:vllm|sglang)", re.M)


@cache
def _imports_an_engine(path: Path) -> bool:
    return path.suffix == ".py" and bool(_ENGINE_IMPORT.search(path.read_text()))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("markexpr", "").strip() == "quick" and collection_path.name.startswith("test_"):
        return _imports_an_engine(collection_path) or None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
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
