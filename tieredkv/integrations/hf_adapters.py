"""The identity of the PEFT adapters (LoRA, IA3, ...) a transformers model runs with.

An adapter changes the K/V a model computes for the same tokens whenever it touches a layer at or
below an attention's K/V projections, so KV computed under one adapter must never be restored under
another, or under the base model. ``adapter_identity`` returns bytes that name what is active right
now: which adapters, on which modules, with which weights. ``CachedPrefill`` folds them into every
chunk's key, so each adapter (and each version of its weights) gets its own prefixes and the base
model keeps its own.

The weights are hashed on every call, not remembered by tensor identity: an edit through
``param.data`` does not move a tensor's version counter, so nothing cheaper can prove that the weights
are still the ones a key was made from. Hashing runs at xxh3 speed (several GB/s); a LoRA of rank 16
on q/k/v/o of a 7B model is about 70 MiB.

Only adapters injected by ``peft`` (a ``PeftModel``, or ``model.load_adapter`` in transformers, which
uses peft's layers) are seen. Weights changed any other way (``merge_and_unload``, a fine-tune saved
under the base model's name) are a different model: give it its own ``model_id`` (see
``spec_for_model``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import xxhash

from tieredkv.errors import InvalidInput

__all__ = ["adapter_identity"]


def _adapter_layers(model: Any) -> list[tuple[str, Any]]:
    """The modules peft injected into ``model`` (empty when peft was never imported: then none can be)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, flat (copied to the host when it lives on a device)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


def _feed(h: Any, value: bytes) -> None:
    """Feed one length-prefixed field: the encoding stays injective whatever the bytes are."""
    h.update(len(value).to_bytes(8, "little"))
    h.update(value)


def _feed_tensors(h: Any, attr: str, part: Any, seen: dict[tuple, int] | None = None) -> None:
    """Feed the tensors of ``part`` (a tensor, or a module's state) under ``attr``: each one's name,
    dtype and shape, then its bytes. With ``seen``, a tensor already fed in this call (one shared by
    many layers) is fed as its index there instead of its bytes again."""
    tensors = part.state_dict() if isinstance(part, torch.nn.Module) else {"": part}
    for key in sorted(tensors):
        t = tensors[key]
        _feed(h, f"{attr}.{key}:{t.dtype}:{tuple(t.shape)}".encode())
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()), tuple(t.shape),
                 t.dtype)
        if seen is not None and where in seen:
            _feed(h, f"={seen[where]}".encode())
            continue
        if seen is not None:
            seen[where] = len(seen)
        h.update(_tensor_bytes(t))


def _refuse_unkeyable(model: Any) -> None:
    """Raise if ``model`` runs a peft adapter that injects no tuner layer: prompt learning (prompt,
    prefix, p-tuning: virtual tokens ahead of every prompt, which the chunk keys never see) or an
    adaption prompt (extra attention over learnt prompts). Such KV has no weights here to key it by,
    so it is not cached (it would be restored for the base model and the base model's for it)."""
    configs = getattr(model, "peft_config", None)
    active = getattr(model, "active_adapter", None)  # a PeftModel's: a name (transformers': a method)
    if not isinstance(configs, dict) or not isinstance(active, str) or getattr(model, "_adapters_disabled", False):
        return
    config = configs.get(active)
    if getattr(config, "is_prompt_learning", False) or getattr(config, "is_adaption_prompt", False):
        kind = getattr(getattr(config, "peft_type", None), "value", type(config).__name__)
        raise InvalidInput(f"peft adapter {active!r} ({kind}) changes the KV through virtual tokens or "
                           f"prompts no chunk key can name: CachedPrefill does not cache it (run it "
                           f"without a cache, or inside `with model.disable_adapter():` for the base model)")


def adapter_identity(model: Any) -> bytes | None:
    """Bytes naming the adapters active in ``model`` and their weights, or ``None`` for none.

    ``None`` means the model computes exactly what its base weights compute: no peft layer, or every
    peft layer disabled (``with model.disable_adapter():``). Otherwise a 16-byte
    digest over, for each peft layer in module order: its path, the adapters that act in its forward
    (the active ones, and the merged ones, which live in the base weights), and for each of those the
    bytes, dtype and shape of every tensor the adapter holds there plus its other settings (rank,
    alpha, scaling, ...; tensors among them, such as VeRA's shared projections, by their bytes).
    Merged or not, an adapter has one identity: merging adds the same product to the base weights
    that the unmerged forward adds to its output (up to rounding).

    Args:
        model: a transformers model, a ``PeftModel`` or anything with ``named_modules``.

    Raises:
        InvalidInput: the active adapter is a prompt-learning or adaption-prompt one (its KV cannot be
            keyed; ``_refuse_unkeyable``).
    """
    _refuse_unkeyable(model)
    h = xxhash.xxh3_128()
    acting = 0
    seen: dict[tuple, int] = {}  # tensors of other_param_names already hashed in this call
    for path, layer in _adapter_layers(model):
        # A disabled layer runs its base weights (peft unmerges merged adapters before such a forward).
        merged = list(getattr(layer, "merged_adapters", []) or [])
        names = [] if layer.disable_adapters else sorted(set(layer.active_adapters) | set(merged))
        if not names:
            continue
        acting += 1
        _feed(h, path.encode())
        for adapter in names:
            _feed(h, adapter.encode())
            for attr in layer.adapter_layer_names:
                holder = getattr(layer, attr, None)
                if holder is None or adapter not in holder:
                    continue
                _feed_tensors(h, attr, holder[adapter])
            for attr in layer.other_param_names:
                settings = getattr(layer, attr, None)  # a dict, or a BufferDict/ModuleDict/ParameterDict
                if not isinstance(settings, (dict, torch.nn.Module)):
                    continue
                table: Any = settings
                if adapter not in table:
                    continue
                value = table[adapter]
                if isinstance(value, (torch.Tensor, torch.nn.Module)):
                    # Tensors here change the KV too (VeRA's shared projections, a BufferDict; index
                    # tensors, whose repr would abbreviate): hashed by their bytes, once per call.
                    _feed_tensors(h, attr, value, seen)
                else:
                    _feed(h, f"{attr}={value!r}".encode())
    return h.digest() if acting else None
