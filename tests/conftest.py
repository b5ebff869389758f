"""Shared fixtures: tiny specs and unique segment names (always unlinked)."""

from __future__ import annotations

import os
import secrets

import posix_ipc
import pytest

from tieredkv import KVSpec

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
