"""The arrays a ``TieredCache`` is handed: checks, and where their bytes go.

``TieredCache.store`` reads a model-layout KV array (``host_source``: numpy, or a torch tensor on the
CPU or a GPU, copied to the host first); ``TieredCache.load`` writes one (``Placement.placer``): numpy
and CPU tensors through ``layout.blocks_to_model`` (a large run in two halves on two threads when a CPU
is free), CUDA tensors by DMA straight out of the hot segment
(registered with CUDA once) and a re-layout on the GPU (``tieredkv/cuda.py``). Nothing here knows
tiers or levels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv.errors import InvalidPayload
from tieredkv.halves import Halves
from tieredkv.layout import blocks_to_chunks, blocks_to_model, model_chunks, overlaps_itself
from tieredkv.spec import KVSpec

#: ``place(rows, at_token, shared)``: copy ``(k, block_bytes)`` uint8 rows of blocks into the load's
#: destination at ``at_token``, in the model layout; ``shared``: the rows are the hot segment's own
#: memory (a CUDA destination registers them for DMA), not a staging buffer.
Placer = Callable[[np.ndarray, int, bool], None]


class Placement:
    """Where one cache's loads go: checks ``out`` and builds its ``Placer``; keeps, across loads, the
    CUDA registration of the hot segment and a device staging buffer (``close`` releases both).

    Args:
        spec: the cache's KV spec (dtype and shape of the arrays).
    """

    def __init__(self, spec: KVSpec):
        self.spec = spec
        self.host_registry: Any = None   # tieredkv.cuda.HostRegistry, on the first load into CUDA
        self._device_stage: Any = None   # kept device staging buffer of those loads
        self._halves = Halves("tieredkv-place")  # the second thread of large placements into host memory

    def placer(self, out: Any, min_tokens: int) -> tuple[Placer, Callable[[int], None]]:
        """``place`` (see ``Placer``) for ``out``, and ``finish(n)`` to call once ``n`` tokens are in
        place. Checks ``out`` first.

        Raises:
            InvalidPayload: ``out`` has another dtype or shape, holds fewer than ``min_tokens`` tokens, is
                read-only, overlaps itself, requires grad or lives on the meta device.
        """
        spec = self.spec
        if isinstance(out, np.ndarray):
            if out.dtype != spec.numpy_dtype:
                raise InvalidPayload(f"out dtype {out.dtype} != the spec's {spec.dtype} (numpy {spec.numpy_dtype})")
            if not out.flags.writeable:
                raise InvalidPayload("out is read-only")
            check_array(spec, out, "out", min_tokens)
            check_no_overlap(out)
            return host_placer(spec, out, self._halves), lambda n: None
        if torch_or_none(out) is None:
            raise InvalidPayload(f"out must be a numpy array or a torch tensor, got {type(out).__name__}")
        if not _torch_dtype_ok(spec, out):
            raise InvalidPayload(f"out dtype {out.dtype} != the spec's {spec.dtype}")
        check_array(spec, out, "out", min_tokens)
        _check_device(out, "out")
        if out.requires_grad:
            raise InvalidPayload("out requires grad: autograd cannot track a cache restore; allocate it "
                                 "without requires_grad (or pass out.detach(), which shares its memory)")
        check_no_overlap(out)
        if out.device.type == "cpu":
            return host_placer(spec, numpy_of(out, spec.numpy_dtype), self._halves), lambda n: None
        return self._cuda_placer(out)

    def host(self, out: Any) -> np.ndarray | None:
        """``out`` (already checked by ``placer``) as the numpy array its bytes live in, when it is in
        host memory (numpy, a CPU tensor); None for a device tensor."""
        if isinstance(out, np.ndarray):
            return out
        return None if on_device(out) else numpy_of(out, self.spec.numpy_dtype)

    def _cuda_placer(self, out: Any) -> tuple[Placer, Callable[[int], None]]:
        # Hot rows are DMA'd straight out of the segment (registered once), other rows through the
        # driver; the re-layout runs on the GPU into a kept device staging buffer.
        from tieredkv import cuda

        if self.host_registry is None:
            self.host_registry = cuda.HostRegistry()
        registry = self.host_registry
        device = cuda.DeviceRestore(self.spec, out, self._device_stage)

        def place(rows: np.ndarray, at_token: int, shared: bool) -> None:
            if shared:
                registry.register(rows)
            device.place(rows, at_token)

        def finish(n: int) -> None:
            device.finish()
            self._device_stage = device.stage

        return place, finish

    def close(self) -> None:
        """Unregister the hot segment from CUDA (call before it is unmapped); drop the device buffer;
        stop the placement thread."""
        if self.host_registry is not None:
            self.host_registry.unregister_all()
        self._device_stage = None
        self._halves.close()


def on_device(out: Any) -> bool:
    """Whether ``out`` is a torch tensor on a device other than the CPU."""
    return torch_or_none(out) is not None and out.device.type != "cpu"


def host_source(spec: KVSpec, kv: Any) -> np.ndarray:
    """``kv`` (numpy, or a torch tensor anywhere) as a host numpy array in the model layout.

    Raises:
        InvalidPayload: another dtype or shape, or not an array.
    """
    if isinstance(kv, np.ndarray):
        if kv.dtype != spec.numpy_dtype:
            raise InvalidPayload(f"kv dtype {kv.dtype} != the spec's {spec.dtype} (numpy {spec.numpy_dtype})")
        check_array(spec, kv, "kv", 0)
        return kv
    if torch_or_none(kv) is None:
        raise InvalidPayload(f"kv must be a numpy array or a torch tensor, got {type(kv).__name__}")
    if not _torch_dtype_ok(spec, kv):
        raise InvalidPayload(f"kv dtype {kv.dtype} != the spec's {spec.dtype}")
    check_array(spec, kv, "kv", 0)
    _check_device(kv, "kv")
    if kv.device.type != "cpu":
        kv = kv.detach().to("cpu")
    return numpy_of(kv.detach(), spec.numpy_dtype)


def host_placer(spec: KVSpec, target: np.ndarray, halves: Halves | None = None) -> Placer:
    """A ``Placer`` into a host array in the model layout. With ``halves``, a large placement (a run of hot
    blocks) is copied in two halves on two threads when a CPU is free (``Halves.split``)."""
    C = spec.chunk_tokens
    whole = target.shape[3] // C
    chunks: list[np.ndarray] = []  # target's whole chunks, viewed once (on the first place)

    def place(rows: np.ndarray, at_token: int, shared: bool) -> None:
        first, within = divmod(at_token, C)
        if within or first + len(rows) > whole:
            blocks_to_model(spec, rows, target, at_token)
            return
        if not chunks:
            chunks.append(model_chunks(spec, target))
        if halves is None:
            blocks_to_chunks(spec, rows, chunks[0], first)
        else:  # disjoint chunks of the target: halves may be copied at once
            halves.split(len(rows), spec.block_bytes,
                         lambda a, b: blocks_to_chunks(spec, rows[a:b], chunks[0], first + a))

    return place


def check_array(spec: KVSpec, arr: Any, what: str, min_tokens: int) -> None:
    """Raise ``InvalidPayload`` unless ``arr`` is shaped like the spec's model layout, ``>= min_tokens``."""
    s = spec
    if arr.ndim != 5 or arr.shape[:3] != (s.num_layers, 2, s.num_kv_heads) or arr.shape[4] != s.head_dim:
        raise InvalidPayload(f"{what} must be shaped (num_layers={s.num_layers}, 2, num_kv_heads="
                             f"{s.num_kv_heads}, n_tokens, head_dim={s.head_dim}), got {tuple(arr.shape)}")
    if arr.shape[3] < min_tokens:
        raise InvalidPayload(f"{what} holds {arr.shape[3]} tokens; the hit needs {min_tokens}")


def check_no_overlap(out: Any) -> None:
    """Raise ``InvalidPayload`` if two indices of ``out`` share memory (``as_strided``, ``expand``)."""
    if isinstance(out, np.ndarray):
        strides, size = out.strides, out.itemsize
    else:  # torch counts strides in elements
        size = out.element_size()
        strides = tuple(st * size for st in out.stride())
    if overlaps_itself(tuple(out.shape), strides, size):
        raise InvalidPayload(f"out has overlapping strides (byte strides {strides}, as made by as_strided "
                             "or expand): restored tokens would overwrite each other; pass an array with "
                             "one element per index")


def torch_or_none(obj: Any):
    """The torch module if ``obj`` is a torch tensor (torch is imported only then), else None."""
    if type(obj).__module__.split(".")[0] != "torch":
        return None
    import torch

    return torch if isinstance(obj, torch.Tensor) else None


def numpy_of(t: Any, numpy_dtype: np.dtype) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (any strides); bfloat16 is viewed as uint16, the float8
    types as uint8 (numpy has neither).

    Raises:
        InvalidPayload: ``t`` is not a plain strided tensor (sparse, or a lazily negated view).
    """
    import torch

    if t.layout != torch.strided or t.is_neg() or t.is_conj():
        raise InvalidPayload(f"a {t.layout} tensor{' (a lazily negated view)' if t.is_neg() else ''} holds no "
                             "plain array of values; pass a dense tensor (.to_dense(), .resolve_neg())")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
    elif t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool):
        t = t.view(torch.uint8)  # float8_e4m3fn, float8_e5m2, ...: numpy has no such type
    arr = t.numpy()
    return arr.view(numpy_dtype) if arr.dtype != numpy_dtype else arr


def _torch_dtype_ok(spec: KVSpec, t: Any) -> bool:
    return str(t.dtype).removeprefix("torch.") == spec.dtype


def _check_device(t: Any, what: str) -> None:
    if t.device.type == "meta":
        raise InvalidPayload(f"{what} is on the meta device, which holds no data; pass a CPU or CUDA tensor")
