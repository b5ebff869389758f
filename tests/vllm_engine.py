"""One vLLM engine process for tests/test_vllm_engine.py (a script, not a test module).

``python tests/vllm_engine.py JOB.json`` starts an engine on ``job["model"]`` (CPU, float32, block size
32), with the TieredKVConnector when ``job["extra"]`` is a dict (its ``kv_connector_extra_config``),
runs ``job["steps"]`` one after another (greedy, ``job["max_tokens"]`` new tokens each) and writes one
``{"name", "tokens", "cached"}`` record per step to ``job["out"]``. Engine starts are the slow part, so
a job runs several checks on one engine.
"""

from __future__ import annotations

import json
import os
import sys


def run(job: dict) -> list[dict]:
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                      VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if job.get("extra") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector", kv_connector_module_path="tieredkv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=job["extra"], kv_load_failure_policy="recompute")
    llm = LLM(model=job["model"], skip_tokenizer_init=True, max_model_len=1024, enforce_eager=True,
              dtype="float32", block_size=32, max_num_seqs=2, enable_prefix_caching=True, **kwargs)
    params = SamplingParams(max_tokens=job.get("max_tokens", 8), temperature=0.0, detokenize=False)
    results = []
    for step in job["steps"]:
        prompt = {"prompt_token_ids": step["tokens"]}
        if step.get("salt"):
            prompt["cache_salt"] = step["salt"]
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        results.append({"name": step["name"], "tokens": list(out.outputs[0].token_ids),
                        "cached": out.num_cached_tokens})
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    records = run(job)
    with open(job["out"], "w") as f:
        json.dump(records, f)
