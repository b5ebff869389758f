"""Adapter identity covers the tensors a peft layer keeps under ``other_param_names``: VeRA's shared
random projections (``vera_A``/``vera_B``, a ``BufferDict`` every layer points at) and the like
(RandLoRA's bases, FourierFT's and SHiRA's index tensors). They change the KV as much as the trained
vectors do; before, only plain ``dict`` entries were seen (by ``repr``, which also abbreviates large
tensors), so an edited projection kept the identity and the old KV was restored.

A tiny random-weight Llama under a real peft VeRA adapter, against a real hot tier.
"""

from __future__ import annotations

import pytest
from test_hf import CHUNK, full_logits, open_cache, prompt

from helpers import LazyModule

pytestmark = pytest.mark.slow
torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_models = LazyModule("tieredkv.integrations.models")
hf_adapters = LazyModule("tieredkv.integrations.hf_adapters")
peft = LazyModule("peft")

N = 4 * CHUNK + 5


def test_edited_shared_projection_misses(namespace, tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = peft.get_peft_model(hf_models.random_model(hf_models.tiny_llama_config(), seed=0, dtype=torch.float32),
                                peft.VeraConfig(r=4, target_modules=["k_proj", "v_proj"], init_weights=False))
    model.eval()
    ids = prompt(N)
    with open_cache(model, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(model, cache)
        assert runner.prefill(ids).stored_blocks == 4
        before = full_logits(model, ids)
        identity = hf_adapters.adapter_identity(model)
        layer = model.base_model.model.model.layers[0].self_attn.k_proj
        layer.vera_A["default"].mul_(3.0)  # the projection all VeRA layers share, edited in place
        after = full_logits(model, ids)
        assert (after - before).abs().max().item() > 1e-3  # control: the KV really changed
        assert hf_adapters.adapter_identity(model) != identity
        res = runner.prefill(ids)
        assert res.cached_tokens == 0
        assert (res.logits.float() - after[:, -1:].float()).abs().max().item() <= 1e-5
