"""KVSpec: the KV geometry of a model, its sizes, and the namespace it defines.

Everything that changes the bytes of a block is part of the spec, and so of the namespace fingerprint:
blocks of different namespaces never share a segment, a directory or a key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tieredkv.errors import InvalidInput
from tieredkv.model_identity import canonical_model_id, is_model_dir, local_model_id

#: dtype name -> (bytes per element, numpy dtype used to hold the raw elements).
#: bfloat16 and the fp8 formats have no numpy dtype: their bytes travel as uint16 / uint8.
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (4, np.dtype(np.float32)),
    "float16": (2, np.dtype(np.float16)),
    "bfloat16": (2, np.dtype(np.uint16)),
    "float8_e4m3fn": (1, np.dtype(np.uint8)),
    "float8_e5m2": (1, np.dtype(np.uint8)),
    "int8": (1, np.dtype(np.int8)),
}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}

#: Bump when the meaning of a key or block layout changes: old caches then never match.
KEY_FORMAT = 1
_SLUG_RE = re.compile(r"[^a-z0-9]+")


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(value: Any, *, what: str = "size") -> int:
    """A byte count from an int or a string such as ``"8G"``, ``"512M"``, ``"64KiB"``, ``"65536"``.

    Units are binary (``1G = 2**30``), as a KV cache is sized against RAM and /dev/shm.

    Raises:
        InvalidInput: not a non-negative integer or a number with a K/M/G/T suffix (``what`` names
            the argument in the message).
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise InvalidInput(f"{what} must be >= 0, got {value}")
        return int(value)
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidInput(f"{what} must be a byte count or a size like '512M' or '8G', got {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def normalize_dtype(dtype: Any) -> str:
    """Return the canonical dtype name for a string, numpy dtype or torch dtype."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise InvalidInput(f"unsupported KV dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return name


def sliding_window_extra(config: Mapping[str, Any], num_layers: int) -> str:
    """The namespace part of a model config's sliding window: ``"window=W:<pattern>"`` or ``""``.

    ``pattern`` has one letter per layer, ``s`` sliding, ``f`` full attention. A window changes the
    K/V of every layer after the first sliding one (their inputs attended over less), so it is part of
    the namespace. Read from ``layer_types`` when the config has it (transformers 5.x), else every
    layer slides when ``sliding_window`` is set and ``use_sliding_window`` is not False (Mistral).
    The HF integration and the vLLM connector both derive it here, so their blocks agree.
    """
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types:
        pattern = "".join("s" if "sliding" in str(t) else "f" for t in types)
    elif config.get("use_sliding_window") is False:
        pattern = ""
    else:
        pattern = "s" * num_layers
    if not window or "s" not in pattern:
        return ""
    return f"window={int(window)}:{pattern}"


def weights_extra(quantization: Any = None, overrides: Any = None) -> str:
    """The namespace part of what changes the weights' numbers beyond the model's files: ``""`` for none.

    ``quantization``: the weights' quantisation as the framework applies it (transformers'
    ``quantization_config``, a mapping; vLLM's ``ModelConfig.quantization``, a method name), which
    can be applied at load time to the same checkpoint; ``overrides``: config fields overridden at
    load time (vLLM's ``hf_overrides``: a RoPE scaling or theta changes every K). A model whose
    directory or name is the same but whose weights or RoPE differ this way computes other KV: its
    blocks are kept apart. The two frameworks name quantisations differently, so a quantised model's
    blocks are not shared between them (a miss, never wrong KV).

    Raises:
        InvalidInput: ``overrides`` is a callable (its effect cannot be named).
    """
    parts = []
    if quantization:
        if isinstance(quantization, Mapping):
            method = str(quantization.get("quant_method") or "custom")
            parts.append(f"quant={method}:{digest_of(dict(quantization))}")
        else:
            parts.append(f"quant={quantization}")
    if callable(overrides):
        raise InvalidInput("config overrides given as a callable (vLLM's hf_overrides): tieredkv cannot name "
                           "what it changes in the model's KV; give them as a dict")
    if overrides:
        parts.append(f"overrides={digest_of(dict(overrides))}")
    return ";".join(parts)


def digest_of(doc: Any) -> str:
    """16 hex digits naming a JSON-able document (keys sorted; what JSON cannot spell, by ``str``): how a
    namespace carries a config it cannot spell out."""
    return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True, default=str).encode())


#: Config fields that change the rotary embedding, so every K: a model built with one of them other than
#: its directory's ``config.json`` says computes other KV.
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rotary_pct",
               "rotary_emb_base", "max_position_embeddings")


def rope_overrides(config: Any, name: Any) -> dict | None:
    """The rotary-embedding fields a transformers config object holds otherwise than the config of the
    local model directory ``name`` it came from, as transformers loads that (``from_pretrained(dir,
    rope_scaling=...)`` changes them in memory, and the directory's files, which name the model, do
    not show it); None when there are none, or nothing to compare (not a config object, not a local
    directory, no transformers)."""
    if not hasattr(config, "to_dict") or not name or not is_model_dir(str(name)):
        return None
    try:
        from transformers import AutoConfig

        disk = AutoConfig.from_pretrained(str(name)).to_dict()
    except Exception:  # noqa: BLE001 (a directory transformers cannot read: nothing to compare against)
        return None
    mine = config.to_dict()
    out = {}
    for scope in (None, "text_config"):
        a = mine.get(scope) if scope else mine
        b = disk.get(scope) if scope else disk
        if not isinstance(a, Mapping) or not isinstance(b, Mapping):
            continue
        for field in ROPE_FIELDS:
            if a.get(field) != b.get(field):
                out[f"{scope}.{field}" if scope else field] = a.get(field)
    return out or None


def join_extra(*parts: str) -> str:
    """Namespace parts joined with ``;``, empty ones left out (so that none adds nothing)."""
    return ";".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVSpec:
    """The KV geometry of one model shard.

    Args:
        model_id: the model's name (and revision, if you pin one), e.g. ``"Qwen/Qwen2-7B@main"``.
        num_layers: decoder layers holding a KV cache.
        num_kv_heads: KV heads held by this shard (after GQA, after tensor parallelism).
        head_dim: elements per head.
        dtype: element type of the cached K/V (``"float16"``, ``"bfloat16"``, ``"float32"``, ...).
        chunk_tokens: tokens per cached block; only full chunks are cached.
        tp_rank, tp_size: tensor-parallel shard; each shard is its own namespace.
        extra: anything else that changes the bytes (a quantisation scheme, a RoPE scaling, ...).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    chunk_tokens: int = 64
    tp_rank: int = 0
    tp_size: int = 1
    extra: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise InvalidInput("model_id must be a non-empty string naming the model")
        for field in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise InvalidInput(f"{field} must be a positive integer, got {value!r}")
            object.__setattr__(self, field, int(value))
        rank = self.tp_rank
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < self.tp_size:
            raise InvalidInput(f"tp_rank must be an integer in [0, tp_size={self.tp_size}), got {rank!r}")
        object.__setattr__(self, "tp_rank", int(rank))
        if not isinstance(self.extra, str):
            # The namespace is derived from the fields' JSON: an arbitrary object has no stable bytes.
            raise InvalidInput(f"extra must be a string describing what else changes the bytes (e.g. "
                               f"\"awq-int4\"), got {type(self.extra).__name__}")

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that holds one element's bytes (uint16 for bfloat16)."""
        return DTYPES[self.dtype][1]

    @property
    def bytes_per_token(self) -> int:
        """layers x 2 (K and V) x kv_heads x head_dim x dtype bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: the K and V of ``chunk_tokens`` tokens, all layers."""
        return self.bytes_per_token * self.chunk_tokens

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, kv_heads, chunk_tokens, head_dim)``: the C-order layout of a block."""
        return (self.num_layers, 2, self.num_kv_heads, self.chunk_tokens, self.head_dim)

    # ---- namespace ---------------------------------------------------------------------------
    def namespace_bytes(self) -> bytes:
        """Canonical bytes of everything that changes a block's bytes (the key chain's seed)."""
        return self._namespace_bytes

    @functools.cached_property
    def _namespace_bytes(self) -> bytes:
        # Made once per spec (a frozen dataclass: its fields never change), not per lookup: asdict and
        # json cost ~10 us, a sixth of a warm lookup's bookkeeping.
        doc = dataclasses.asdict(self)
        doc["key_format"] = KEY_FORMAT
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the namespace; part of segment and directory names."""
        return xxhash.xxh3_64_hexdigest(self.namespace_bytes())

    @property
    def slug(self) -> str:
        """A short, safe rendering of the model id for names (no path separators, no odd chars)."""
        tail = self.model_id.replace("\\", "/").rstrip("/").split("/")[-1].split("@")[0]
        slug = _SLUG_RE.sub("-", tail.lower()).strip("-")[:24].strip("-")
        return slug or "model"

    @property
    def namespace(self) -> str:
        """``<slug>-<dtype>-tp<rank>of<size>-<fingerprint>``: a file and segment name component."""
        return f"{self.slug}-{self.dtype}-tp{self.tp_rank}of{self.tp_size}-{self.fingerprint}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> KVSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - names
        if unknown:
            raise InvalidInput(f"unknown KVSpec fields {sorted(unknown)}; valid fields: {sorted(names)}")
        return cls(**doc)

    # ---- from a model config -----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any, *, chunk_tokens: int = 64, dtype: Any = None,
                       model_id: str | None = None, tp_rank: int = 0, tp_size: int = 1) -> KVSpec:
        """Derive the spec from a HuggingFace config.

        Args:
            config: a transformers ``PretrainedConfig``, a dict, or a path to ``config.json`` or to the
                folder holding it.
            chunk_tokens: tokens per block.
            dtype: KV dtype; defaults to the config's ``torch_dtype``/``dtype``, else float16.
            model_id: defaults to the model's identity: for a local model directory (``config`` is
                its path, or ``_name_or_path`` names one) ``local_model_id`` of it, the same
                however the path is spelled and on vLLM's side too; else ``_name_or_path`` /
                ``name_or_path`` (a hub name), else the ``model_type``.
            tp_rank, tp_size: the shard this spec describes (kv heads are divided by tp_size).

        Raises:
            InvalidInput: the config lacks the geometry or is not a config at all.
        """
        source: Path | None = None
        if isinstance(config, (str, os.PathLike)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise InvalidInput(f"no config.json at {path}; pass a config object, a dict or a path")
            source = path.parent
            config = json.loads(path.read_text())
        loaded = config  # a transformers config object, as the model was built with
        if not isinstance(config, Mapping):
            to_dict = getattr(config, "to_dict", None)
            if to_dict is None:
                raise InvalidInput(f"cannot read a model config from {type(config).__name__}")
            config = to_dict()
        cfg = dict(config)
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = {**cfg, **dict(cfg["text_config"])}

        def pick(*names: str) -> Any:
            for name in names:
                if cfg.get(name) is not None:
                    return cfg[name]
            return None

        layers = pick("num_hidden_layers", "n_layer", "num_layers")
        heads = pick("num_attention_heads", "n_head")
        kv_heads = pick("num_key_value_heads", "num_kv_heads", "multi_query_group_num") or heads
        hidden = pick("hidden_size", "n_embd", "d_model")
        for name, value in (("num_hidden_layers", layers), ("num_attention_heads", heads),
                            ("num_key_value_heads", kv_heads), ("hidden_size", hidden),
                            ("head_dim", cfg.get("head_dim"))):
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)):
                raise InvalidInput(f"config field {name} must be an integer, got {value!r}; fix the "
                                   f"config (a JSON number, not a string)")
        head_dim = pick("head_dim") or (hidden // heads if hidden and heads else None)
        if not (layers and kv_heads and head_dim):
            raise InvalidInput("config lacks num_hidden_layers / num_key_value_heads / head_dim "
                               "(or hidden_size and num_attention_heads)")
        if not isinstance(tp_size, (int, np.integer)) or isinstance(tp_size, bool) or tp_size <= 0:
            raise InvalidInput(f"tp_size must be a positive integer, got {tp_size!r}")
        if kv_heads % tp_size:
            raise InvalidInput(f"{kv_heads} KV heads do not split over tp_size={tp_size}")
        if dtype is None:
            dtype = pick("torch_dtype", "dtype") or "float16"
        named = pick("_name_or_path", "name_or_path")
        if not model_id:
            if source is not None:  # the directory's own files decide, whatever name they carry
                model_id = local_model_id(source)
            elif named:
                model_id = canonical_model_id(str(named))
        name = model_id or cfg.get("model_type") or "model"
        if cfg.get("kv_lora_rank"):
            raise InvalidInput("an MLA model (kv_lora_rank in its config): transformers caches decompressed K and "
                               "V per head with different head sizes, which a KVSpec cannot describe; serve it "
                               "through the vLLM connector, which stores the latent")
        return cls(model_id=str(name), num_layers=int(layers), num_kv_heads=int(kv_heads) // tp_size,
                   head_dim=int(head_dim), dtype=dtype, chunk_tokens=chunk_tokens,
                   tp_rank=tp_rank, tp_size=tp_size,
                   extra=join_extra(sliding_window_extra(cfg, int(layers)),
                                    weights_extra(cfg.get("quantization_config"),
                                                  None if source is not None else rope_overrides(loaded, named))))
