"""Helpers shared by tests (importable as ``helpers``: tests/ is on sys.path)."""

from __future__ import annotations

import os

import numpy as np
import posix_ipc

from tieredkv import KVSpec


def payload_for(spec: KVSpec, keys) -> np.ndarray:
    """Blocks whose bytes are derived from their keys: any mix-up shows up byte for byte."""
    raw = np.ascontiguousarray(keys.keys).view(np.uint8).reshape(len(keys), 16)
    reps = -(-spec.block_bytes // 16)
    out = np.tile(raw, (1, reps))[:, : spec.block_bytes]
    # Make every 16-byte lane differ too, so a shifted copy is caught.
    out = out ^ (np.arange(spec.block_bytes, dtype=np.uint32) % 251).astype(np.uint8)
    return np.ascontiguousarray(out)


def kv_for(spec: KVSpec, tokens, salt: bytes = b"") -> np.ndarray:
    """A (layers, 2, kv_heads, n_tokens, head_dim) KV array whose every full chunk's bytes are derived
    from that chunk's key (the trailing partial chunk is zeros). Compare as bytes: raw bytes may
    spell NaNs."""
    from tieredkv import chunk_keys

    tokens = np.asarray(tokens)
    keys = chunk_keys(spec, tokens, salt)
    kv = np.zeros((spec.num_layers, 2, spec.num_kv_heads, len(tokens), spec.head_dim), spec.numpy_dtype)
    blocks = payload_for(spec, keys).view(spec.numpy_dtype).reshape(len(keys), *spec.block_shape)
    C = spec.chunk_tokens
    for i in range(len(keys)):
        kv[:, :, :, i * C:(i + 1) * C, :] = blocks[i]
    return kv


def flip(path, offset: int) -> None:
    """Invert one byte of a file in place (damage on disk)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


class LazyModule:
    """A module imported on first attribute access.

    Test modules that need torch or transformers bind them with this, so that collecting them (every
    run collects every module) imports neither; only the tests that use them pay for the import.
    """

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr: str):
        # pytest probes every module-level object (``__test__``, its fixture and mark attributes)
        # while collecting: answer those without importing.
        if attr.startswith("_") or attr == "pytestmark":
            raise AttributeError(attr)
        if self._module is None:
            import importlib

            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


def unlink_segments_matching(token: str) -> None:
    """Unlink every segment in /dev/shm whose name contains ``token`` (a test's own names)."""
    for entry in os.listdir("/dev/shm"):
        if token in entry:
            try:
                posix_ipc.unlink_shared_memory("/" + entry)
            except posix_ipc.ExistentialError:
                pass
