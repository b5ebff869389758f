"""A local model directory has one model id however its path is spelled (``dir``, ``dir/``, ``./dir``, an
absolute path, a symlink), on the HF side and on vLLM's, and another model's weights never share it."""

from __future__ import annotations

import os
import shutil

import pytest

from tieredkv import KVSpec
from tieredkv.model_identity import canonical_model_id, local_model_id


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tieredkv.integrations.models import save_random_model, tiny_llama_config

    # head_dim 32 and 2 KV heads: a geometry vLLM's CPU attention accepts.
    return save_random_model(tiny_llama_config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2),
                             tmp_path_factory.mktemp("models") / "tiny-llama")


def spellings(model_dir: str, tmp_path) -> list[str]:
    link = tmp_path / "link-to-model"
    if not link.is_symlink():
        link.symlink_to(model_dir)
    rel = os.path.relpath(model_dir)
    return [model_dir, model_dir + "/", model_dir + "//", rel, "./" + rel, str(link)]


def test_every_spelling_of_a_path_is_one_model_id(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(model_dir))
    ids = {local_model_id(p) for p in spellings(model_dir, tmp_path)}
    assert len(ids) == 1
    (ident,) = ids
    assert ident.startswith("tiny-llama@local-")
    specs = {KVSpec.from_hf_config(p, chunk_tokens=32) for p in spellings(model_dir, tmp_path)}
    assert len(specs) == 1 and next(iter(specs)).model_id == ident
    assert next(iter(specs)).slug == "tiny-llama"                    # names stay readable
    assert canonical_model_id("Qwen/Qwen2-7B") == "Qwen/Qwen2-7B"    # a hub name is its own identity


def test_other_weights_or_config_are_another_model(model_dir, tmp_path):
    """A copy of the same files is the same model (another host's path, the remote tier); one changed
    weight byte, or a changed config.json (rope settings change every K), is another."""
    copy = tmp_path / "tiny-llama"
    shutil.copytree(model_dir, copy)
    assert local_model_id(copy) == local_model_id(model_dir)
    weights = copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    assert local_model_id(copy) != local_model_id(model_dir)
    shutil.copy(os.path.join(model_dir, "model.safetensors"), weights)
    assert local_model_id(copy) == local_model_id(model_dir)
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"rope_theta"', '"rope_theta_x"'))
    assert local_model_id(copy) != local_model_id(model_dir)


def test_hf_worker_and_vllm_engine_of_one_local_model_share_blocks(model_dir, tmp_path, monkeypatch):
    """vLLM's own ``ModelConfig`` for ``--model dir/`` and an HF model loaded from ``dir`` give one spec:
    the same namespace, hence the same keys for the same tokens."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1")
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from tieredkv import chunk_keys
    from tieredkv.integrations import vllm as tv
    from tieredkv.integrations.hf import spec_for_model

    monkeypatch.chdir(os.path.dirname(model_dir))
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, attn)])

    def engine_spec(model: str) -> KVSpec:
        cfg = VllmConfig(model_config=ModelConfig(model=model, dtype="float32", skip_tokenizer_init=True,
                                                  max_model_len=256),
                         cache_config=CacheConfig(block_size=32), device_config=DeviceConfig("cpu"))
        return tv.spec_from_vllm(cfg, kv_config, chunk_tokens=64)[0]

    engines = [engine_spec(model_dir + "/"), engine_spec(os.path.basename(model_dir))]
    hf = spec_for_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), chunk_tokens=64)
    assert engines[0] == engines[1] == hf
    tokens = list(range(200))
    assert chunk_keys(engines[0], tokens).keys.tobytes() == chunk_keys(hf, tokens).keys.tobytes()
    assert engines[0].model_id == local_model_id(model_dir)
    assert tv.spec_from_vllm(VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32",
                                                                 skip_tokenizer_init=True, max_model_len=256),
                                        cache_config=CacheConfig(block_size=32), device_config=DeviceConfig("cpu")),
                             kv_config, chunk_tokens=64, model_id="mine")[0].model_id == "mine"  # an explicit id wins
