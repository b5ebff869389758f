"""CachedPrefill on sliding-window models (Mistral: every layer; Gemma 3: sliding and full layers
interleaved), and the families it refuses (MLA; linear-attention layers in a model type hf_state has
not verified: hybrid models are tested in test_hf_hybrid.py). Tiny random-weight models built in
code; a restored prefix gives the logits of a full prefill (float32, within 1e-5) and the same greedy
tokens, for a prompt several windows long."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from test_hf import full_logits, greedy_reference, prompt

from helpers import LazyModule
from tieredkv.errors import InvalidInput

pytestmark = pytest.mark.slow
torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_models = LazyModule("tieredkv.integrations.models")

CHUNK, WINDOW = 16, 24


@pytest.mark.parametrize("config", ["tiny_mistral_config", "tiny_gemma3_config"])
def test_a_prefix_longer_than_the_window_is_restored_exactly(config):
    from tieredkv import TieredCache

    torch.set_num_threads(1)
    model = hf_models.random_model(getattr(hf_models, config)(sliding_window=WINDOW, initializer_range=0.2))
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=f"test-hf-sliding-{uuid.uuid4().hex[:8]}")
    pattern = "sfsf" if "gemma" in config else "ss"
    assert spec.extra == f"window={WINDOW}:{pattern}"  # the window is part of the namespace
    ids = prompt(6 * CHUNK + 5, seed=3)
    with TieredCache(spec, hot_bytes=64 * spec.block_bytes + (1 << 20), hot_name=f"/{spec.model_id}") as cache:
        try:
            runner = hf.CachedPrefill(model, cache)
            first = runner.prefill(ids)
            assert first.cached_tokens == 0 and first.stored_blocks == 6
            again = runner.prefill(ids)
            assert again.cached_tokens == 6 * CHUNK  # four windows before the tail
            ref = full_logits(model, ids)
            assert torch.allclose(again.logits[0, -1], ref[0, -1], atol=1e-5, rtol=0)
            assert runner.decode(runner.prefill(ids), 8) == greedy_reference(model, ids, 8)
            # The control: the same blocks zero-filled are restored too, and change the logits.
            hit = cache.lookup(ids[0].numpy())
            cache.hot.remove(hit.keys)
            cache.hot.put_many(hit.keys, np.zeros((len(hit.keys), spec.block_bytes), np.uint8))
            zeroed = runner.prefill(ids)
            assert zeroed.cached_tokens == 6 * CHUNK
            assert not torch.allclose(zeroed.logits[0, -1], ref[0, -1], atol=1e-3)
        finally:
            cache.unlink_hot()


def test_mla_and_linear_attention_are_refused_by_name():
    with pytest.raises(InvalidInput, match="MLA model.*decompressed K and V"):
        hf.spec_for_model(hf_models.random_model(hf_models.tiny_deepseek_v3_config(num_hidden_layers=1)))
    model = hf_models.random_model(hf_models.tiny_gemma3_config())
    model.config.layer_types = ["linear_attention", "full_attention"] * 2
    with pytest.raises(InvalidInput, match=r"\['linear_attention'\].*not verified.*not per-token K/V"):
        hf.CachedPrefill(model, None)
