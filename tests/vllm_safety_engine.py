"""One vLLM engine process for tests/test_vllm_safety_engine.py (a script, not a test module).

``python tests/vllm_safety_engine.py JOB.json``: an engine on ``job["model"]`` (CPU, float32, block size
32, LoRA enabled for rank-8 adapters), with ``FlakyConnector`` (the TieredKVConnector plus a fault this
test injects) when ``job["extra"]`` is a dict, runs ``job["steps"]`` in order and writes one
``{"name", "tokens", "cached"}`` record per generating step to ``job["out"]``. A step is a prompt
(``tokens``, optional ``lora``: an index into ``job["adapters"]``), or an action: ``reset_local``
(vLLM's own prefix cache only), ``reset_all`` (``reset_prefix_cache(reset_connector=True)``) or
``lose_next_load`` (the next load of the tiers loses every chunk after the first and leaves garbage
in the pages it did not fill, as an eviction between lookup and load plus a half-written page would).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: While this file exists, the worker's next load loses its chunks after the first (then removes it).
FLAG_ENV = "TIEREDKV_TEST_LOSE_FLAG"


def _flaky_class() -> Any:
    import torch

    from tieredkv.integrations.vllm import TieredKVConnector, TieredKVMetadata

    class FlakyConnector(TieredKVConnector):
        """The connector, whose worker side loses a planned load once on request (the test's fault)."""

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            flag = os.environ.get(FLAG_ENV, "")
            meta = self._get_connector_metadata()
            planned = isinstance(meta, TieredKVMetadata) and any(p.hit.blocks > 1 for p in meta.loads)
            if not (flag and planned and os.path.exists(flag)):
                return super().start_load_kv(forward_context, **kwargs)
            os.unlink(flag)
            # What the failed load leaves in the pages it does not fill: garbage, not zeros or stale KV.
            # Written into all of the plans' blocks first; the load overwrites the ones it fills (with
            # load_mode="layer" on its thread, while the forward runs).
            planned = sorted({b for plan in meta.loads for ids in plan.block_ids for b in ids if b})
            N = self._block_size
            junk = torch.full((self.spec.num_layers, 2, self.spec.num_kv_heads, len(planned) * N,
                               self.spec.head_dim), 3.0, dtype=self._paged.dtype)
            self._paged.write(planned, junk, 0)
            for plan in meta.loads:
                lost = plan.hit.keys[1:]
                self.cache.hot.remove(lost)
                if self.cache.warm is not None:
                    self.cache.warm.remove(lost)
            self._fault_fired = True
            super().start_load_kv(forward_context, **kwargs)

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors = super().get_block_ids_with_load_errors()
            if getattr(self, "_fault_fired", False):
                self._fault_fired = False
                assert errors, "the injected fault made no load fail"
            return errors

    return FlakyConnector


def __getattr__(name: str) -> Any:  # vLLM imports the class by name from this module
    if name == "FlakyConnector":
        return _flaky_class()
    raise AttributeError(name)


def run(job: dict) -> list[dict]:
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                      VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")  # the engine core imports us
    os.environ[FLAG_ENV] = job["flag"]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = {}
    if job.get("extra") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="FlakyConnector", kv_connector_module_path="vllm_safety_engine",
            kv_role="kv_both", kv_connector_extra_config=job["extra"], kv_load_failure_policy="recompute")
    llm = LLM(model=job["model"], skip_tokenizer_init=True, max_model_len=1024, enforce_eager=True,
              dtype="float32", block_size=32, max_num_seqs=2, enable_prefix_caching=True, enable_lora=True,
              max_lora_rank=8, max_loras=2, **kwargs)
    params = SamplingParams(max_tokens=job.get("max_tokens", 8), temperature=0.0, detokenize=False)
    adapters = [LoRARequest(lora_name=f"adapter-{i}", lora_int_id=i + 1, lora_path=path)
                for i, path in enumerate(job.get("adapters", []))]
    results = []
    for step in job["steps"]:
        if step.get("action") == "reset_local":
            assert llm.reset_prefix_cache()
        elif step.get("action") == "reset_all":
            assert llm.reset_prefix_cache(reset_connector=True)
        elif step.get("action") == "lose_next_load":
            open(job["flag"], "w").close()
        else:
            lora = adapters[step["lora"]] if step.get("lora") is not None else None
            out = llm.generate([{"prompt_token_ids": step["tokens"]}], params, use_tqdm=False, lora_request=lora)[0]
            results.append({"name": step["name"], "tokens": list(out.outputs[0].token_ids),
                            "cached": out.num_cached_tokens, "flag_left": os.path.exists(job["flag"])})
    return results


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    with open(sys.argv[1]) as f:
        job = json.load(f)
    records = run(job)
    with open(job["out"], "w") as f:
        json.dump(records, f)
