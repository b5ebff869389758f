"""Restoring blocks into CUDA tensors: DMA straight out of the hot segment, the re-layout on the GPU.

```
hot slots (shared memory, registered with cudaHostRegister once per process)
   │  one host-to-device DMA per run of adjacent slots (the copy engine reads the segment itself)
   ▼
device staging (k blocks, contiguous) ──permute on the GPU──► out[:, :, :, at:at + k*C, :]
```

Without registration the CPU would first copy every block into a pinned staging buffer (a memcpy at
host-memory speed), then the GPU would copy that: the CPU copy dominates a restore. With the segment
registered, the only host-side work is queueing the copy and waiting for it. The wait is required: a
block is pinned in the hot tier only while its sink runs, so the DMA must have finished before the sink
returns (the hot tier re-checks the block's generation and unpins right after).

Rows that do not come from a registered mapping (warm blocks read into a staging buffer) take the same
path; torch then copies them through the driver's own pinned buffer, which is still one CPU copy fewer
than staging them by hand.

Imported only when a CUDA tensor is passed to ``TieredCache.load``; torch is required then.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from tieredkv.spec import KVSpec

#: Device staging is allocated up to this size; longer runs are copied in pieces.
MAX_STAGE_BYTES = 256 << 20


def _root(arr: np.ndarray) -> np.ndarray:
    """The array that owns the memory ``arr`` views (for a view of a shared-memory mapping: the whole
    mapping)."""
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr


class HostRegistry:
    """Host mappings registered with CUDA (``cudaHostRegister``), so copies out of them are DMA.

    Registration pins the pages for the life of the registration; ``unregister_all`` must run before the
    mappings are unmapped (``TieredCache.close`` does it before closing the hot tier).
    """

    def __init__(self) -> None:
        self._ptrs: dict[int, int] = {}  # address -> bytes
        self._failed: set[int] = set()

    def register(self, view: np.ndarray) -> bool:
        """Register the mapping ``view`` belongs to; True when it is (or already was) registered."""
        import torch

        root = _root(view)
        ptr, size = root.ctypes.data, root.nbytes
        if ptr in self._ptrs:
            return True
        if ptr in self._failed:
            return False
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            self._failed.add(ptr)
            warnings.warn(f"tieredkv: cudaHostRegister of the hot segment ({size >> 20} MiB) failed "
                          f"(error {int(err)}; RLIMIT_MEMLOCK?): restores into CUDA tensors copy through "
                          "the driver's staging instead", RuntimeWarning, stacklevel=3)
            return False
        self._ptrs[ptr] = size
        return True

    def unregister_all(self) -> None:
        """Undo every registration (idempotent)."""
        if not self._ptrs:
            return
        import torch

        cudart = torch.cuda.cudart()
        for ptr in list(self._ptrs):
            cudart.cudaHostUnregister(ptr)
            del self._ptrs[ptr]


class DeviceRestore:
    """Places ``(k, block_bytes)`` host rows into a CUDA tensor in the model layout ``(L, 2, H, T, D)``.

    Args:
        spec: the cache's spec.
        out: the destination, a CUDA tensor of the spec's dtype.
        stage: a kept device buffer to reuse (uint8, on ``out``'s device), or None.
    """

    def __init__(self, spec: KVSpec, out: Any, stage: Any = None):
        import torch

        self.spec = spec
        self.out = out
        self.torch = torch
        self.stream = torch.cuda.current_stream(out.device)
        self.stage = stage if stage is not None and stage.device == out.device else None

    def _stage_for(self, nbytes: int):
        if self.stage is None or self.stage.numel() < nbytes:
            self.stage = None
            self.stage = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.out.device)
        return self.stage[:nbytes]

    def place(self, rows: np.ndarray, at_token: int) -> None:
        """Copy blocks ``rows`` into ``out[:, :, :, at_token:at_token + k*C, :]``; the host rows are no
        longer read when this returns."""
        # Name the stream: a caller on another thread (the warm tier's sink once ran on a hashing thread)
        # would otherwise copy on its own current stream while ``finish`` waits on the caller's.
        with self.torch.cuda.stream(self.stream):
            self._place(rows, at_token)

    def _place(self, rows: np.ndarray, at_token: int) -> None:
        spec, torch = self.spec, self.torch
        bb, C = spec.block_bytes, spec.chunk_tokens
        per = max(1, min(len(rows), MAX_STAGE_BYTES // bb))
        for a in range(0, len(rows), per):
            part = rows[a:a + per]
            k = len(part)
            stage = self._stage_for(k * bb)
            if part.strides == (bb, 1) or k == 1:
                stage.copy_(torch.from_numpy(part.reshape(-1)), non_blocking=True)
            else:  # rows of padded slots: one contiguous DMA per block
                for j in range(k):
                    stage[j * bb:(j + 1) * bb].copy_(torch.from_numpy(part[j]), non_blocking=True)
            # The rows may be recycled as soon as we return: the DMA must be done.
            self.stream.synchronize()
            blocks = stage.view(self.out.dtype).view(k, *spec.block_shape)
            at = at_token + a * C
            dst = self.out[:, :, :, at:at + k * C, :].unflatten(3, (k, C))
            dst.copy_(blocks.permute(1, 2, 3, 0, 4, 5), non_blocking=True)

    def finish(self) -> None:
        """Wait until every placed block is in ``out``."""
        self.stream.synchronize()
