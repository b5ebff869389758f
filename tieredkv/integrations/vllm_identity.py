"""What a vLLM request's KV depends on besides its token ids, as per-chunk extra bytes for the keys.

vLLM's own prefix cache keys a block by its tokens *and* the block's "extra keys"
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``): the request's LoRA adapter (name and
path), each multimodal item whose placeholder tokens overlap the block (its identifier, the content
hash unless the client gave its own uuid, and its offset relative to the block), the hash of the
block's prompt embeddings, and the cache salt. Two requests with the same token ids but another
adapter, another image or other embeddings have other KV. ``chunk_extras`` asks vLLM's function for
each tieredkv chunk (a run of whole vLLM blocks) and encodes the answer injectively, so a chunk's key
depends on what vLLM's block hashes depend on; the cache salt is left out (tieredkv folds it into the
first key already, as the HF integration does). One thing is added: the digest of a local adapter's
files (``_adapter_files``), since the tiers outlive an engine and its names for adapters. A chunk with
no extra keys keeps the plain token key: text before an image still shares.

Whatever cannot be keyed exactly raises ``Unkeyable`` and the connector neither looks the request up
nor stores it: an extra key of a type this module does not know (a later vLLM may add one), a
multimodal item without an identifier, or a prompt mixing token ids and embeddings.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from tieredkv.keys import as_tokens
from tieredkv.model_identity import is_model_dir, local_adapter_digest


class Unkeyable(Exception):
    """The request's KV depends on something the chunk keys cannot express exactly."""


def _encode(value: Any, out: bytearray) -> None:
    """Append a tagged, length-prefixed form of ``value`` (two different values never give one form)."""
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        data = str(value).encode()
        out += b"i" + struct.pack("<I", len(data)) + data
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        out += b"b" + struct.pack("<I", len(data)) + data
    elif isinstance(value, (tuple, list)):
        out += b"t" + struct.pack("<I", len(value))
        for item in value:
            _encode(item, out)
    else:
        raise Unkeyable(f"vLLM extra key of type {type(value).__name__} ({value!r:.80}) has no exact encoding")


def encode_extra_keys(keys: Any) -> bytes:
    """The bytes of one chunk's extra keys (a tuple of vLLM's tagged tuples).

    Raises:
        Unkeyable: a value of a type with no exact encoding.
    """
    out = bytearray(b"vllm-extra-keys/1")
    _encode(keys, out)
    return bytes(out)


def request_tokens(request: Any) -> np.ndarray:
    """The token ids vLLM hashes a prompt's blocks by: the prompt's ids, or zeros for a prompt given as
    embeddings only (vLLM's placeholder ids; the embeddings' hashes then tell prompts apart).

    Raises:
        Unkeyable: a prompt mixing token ids and embeddings.
    """
    if getattr(request, "prompt_is_token_ids", None) is not None:
        raise Unkeyable("a prompt mixing token ids and prompt embeddings")
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        n = int(getattr(request, "num_prompt_tokens", 0) or 0)
        return np.zeros(n, dtype="<u4")
    return as_tokens(ids)


def _has_extras(request: Any) -> bool:
    return bool(getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                or getattr(request, "prompt_embeds", None) is not None)


def chunk_extras(request: Any, n_chunks: int, chunk_tokens: int) -> list[bytes | None] | None:
    """Extra bytes for each of the first ``n_chunks`` chunks of ``request``'s prompt, or ``None`` when
    no chunk has any (a plain text prompt: its keys are the plain token keys).

    Raises:
        Unkeyable: the request's KV depends on something that cannot be keyed exactly.
    """
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    if not _has_extras(request):
        # A tripwire for identities a later vLLM adds: over the whole prompt, vLLM must see nothing
        # beyond the cache salt, which the root key already holds.
        if n_chunks and _without_salt(_extra_keys(generate_block_hash_extra_keys, request, 0,
                                                  n_chunks * chunk_tokens)):
            raise Unkeyable("vLLM reports extra keys this module does not know for a plain prompt")
        return None
    adapter = _adapter_files(request)
    out: list[bytes | None] = []
    for i in range(n_chunks):
        keys = _without_salt(_extra_keys(generate_block_hash_extra_keys, request, i * chunk_tokens,
                                         (i + 1) * chunk_tokens)) + adapter
        out.append(encode_extra_keys(keys) if keys else None)
    return out if any(e is not None for e in out) else None


def _adapter_files(request: Any) -> tuple[Any, ...]:
    """``(("lora_files", digest),)`` for a LoRA adapter in a local directory, else ``()``.

    vLLM names an adapter by its name and path, which is enough inside one engine. Across engines and
    restarts (the tiers outlive both) an adapter retrained or replaced in place keeps both: its files'
    digest (``model_identity.local_adapter_digest``, as the base model's files name it) tells them apart.

    Raises:
        Unkeyable: the adapter's directory cannot be read.
    """
    lora = getattr(request, "lora_request", None)
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", None) if lora is not None else None
    if not path or not is_model_dir(path, "adapter_config.json"):
        return ()
    try:
        return (("lora_files", local_adapter_digest(path)),)
    except OSError as e:
        raise Unkeyable(f"the LoRA adapter at {path} cannot be read ({e})") from None


def _extra_keys(generate: Any, request: Any, start: int, end: int) -> tuple[Any, ...]:
    for feature in getattr(request, "mm_features", None) or ():
        if getattr(feature, "identifier", None) is None:
            raise Unkeyable("a multimodal item without an identifier")
    keys, _ = generate(request, start, end, 0)
    return tuple(keys or ())


def _without_salt(keys: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(k for k in keys if not (isinstance(k, tuple) and k and k[0] == "cache_salt"))
