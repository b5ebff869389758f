"""One vLLM engine process for tests/test_vllm_engine.py (a script, not a test module).

``python tests/vllm_engine.py JOB.json`` starts an engine on ``job["model"]`` (CPU, float32, block size
32), with the TieredKVConnector when ``job["extra"]`` is a dict (its ``kv_connector_extra_config``),
runs ``job["steps"]`` one after another (greedy, ``job["max_tokens"]`` new tokens each) and writes one
``{"name", "tokens", "cached"}`` record per step to ``job["out"]``. Engine starts are the slow part, so
a job runs several checks on one engine.

With ``job["trace"]`` (a path) the engine runs ``RecordingConnector``: the connector, which appends
one JSON line per engine step with loads to that file: the loads' tokens, the layers the forward
waited for (in call order) and how many layers the loader had written when each wait began.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: The file ``RecordingConnector`` appends to (set for the engine core process it runs in).
TRACE_ENV = "TIEREDKV_TEST_LOAD_TRACE"


def _recording_class() -> Any:
    from tieredkv.integrations.vllm import TieredKVConnector, TieredKVMetadata

    class RecordingConnector(TieredKVConnector):
        """The connector, recording how the engine drives its loads (worker side)."""

        _trace: dict | None = None

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            super().start_load_kv(forward_context, **kwargs)
            meta = self._get_connector_metadata()
            if isinstance(meta, TieredKVMetadata) and meta.loads:
                self._trace = {"mode": self._load_mode, "tokens": sum(p.hit.tokens for p in meta.loads),
                               "waits": []}

        def wait_for_layer_load(self, layer_name: str) -> None:
            trace, job = self._trace, self._loader._job if self._loader is not None else None
            ready = job.layers_ready if job is not None else None  # layers written when the forward asked
            super().wait_for_layer_load(layer_name)
            if trace is not None:
                trace["waits"].append([layer_name, ready])

        def wait_for_save(self) -> None:
            if self._trace is not None:
                with open(os.environ[TRACE_ENV], "a") as f:
                    f.write(json.dumps(dict(self._trace, layers=list(self._layer_names))) + "\n")
                self._trace = None
            super().wait_for_save()

    return RecordingConnector


def __getattr__(name: str) -> Any:  # vLLM imports the class by name from this module
    if name == "RecordingConnector":
        return _recording_class()
    raise AttributeError(name)


def run(job: dict) -> list[dict]:
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                      VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if job.get("extra") is not None:
        name, module = "TieredKVConnector", "tieredkv.integrations.vllm"
        if job.get("trace"):
            os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")  # the core imports us
            os.environ[TRACE_ENV] = job["trace"]
            name, module = "RecordingConnector", "vllm_engine"
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module,
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
    sys.path.insert(0, HERE)
    with open(sys.argv[1]) as f:
        job = json.load(f)
    records = run(job)
    with open(job["out"], "w") as f:
        json.dump(records, f)
