"""CachedPrefill refuses peft adapters whose KV no key can name: prompt learning (prompt tuning,
prefix tuning, p-tuning: virtual tokens the cache never sees, ahead of every prompt) and adaption
prompts (LLaMA-Adapter: extra attention over learnt prompts). Such an adapter injects no tuner layer,
so it has no weights to hash into a chunk's key: before the refusal, KV the base model stored was
restored under it (wrong logits), and its own KV would have been stored under the base model's keys.
With the adapter disabled the model is the base model again, and caches as one.

A tiny random-weight Llama under real peft wrappers, against a real hot tier.
"""

from __future__ import annotations

import pytest
from test_hf import CHUNK, full_logits, open_cache, prompt

from helpers import LazyModule

pytestmark = pytest.mark.slow
torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_models = LazyModule("tieredkv.integrations.models")
errors = LazyModule("tieredkv.errors")
peft = LazyModule("peft")

N = 4 * CHUNK + 5


def _config(kind: str):
    if kind == "prompt_tuning":
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    if kind == "prefix_tuning":
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    return peft.AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=4, adapter_layers=1)


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning", "adaption_prompt"])
def test_virtual_token_adapters_are_refused(kind, namespace, tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(3)
    model = peft.get_peft_model(hf_models.random_model(hf_models.tiny_llama_config(), seed=0,
                                                       dtype=torch.float32), _config(kind))
    if kind == "adaption_prompt":  # its gates start at zero (no effect): open them, as training would
        for name, p in model.named_parameters():
            if "adaption_gate" in name:
                p.data.fill_(1.0)
    model.eval()
    ids = prompt(N)
    with open_cache(model, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(model, cache)
        with model.disable_adapter():  # the base model: caches and hits as usual
            assert runner.prefill(ids).stored_blocks == 4
            res = runner.prefill(ids)
            assert res.cached_tokens == 4 * CHUNK
            ref = full_logits(model, ids)[:, -1:]
            assert (res.logits.float() - ref.float()).abs().max().item() <= 1e-5
        # Control: the adapter really changes what the model computes, so a restore would be wrong.
        with model.disable_adapter():
            plain = full_logits(model, ids)
        assert (full_logits(model, ids)[:, -1:] - plain[:, -1:]).abs().max().item() > 1e-3
        with pytest.raises(errors.InvalidInput, match=f"(?i){kind}"):
            runner.prefill(ids)
        assert cache.hot.stats().used_blocks == 4  # the refused call stored nothing
