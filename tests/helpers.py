"""Helpers shared by tests (importable as ``helpers``: tests/ is on sys.path)."""

from __future__ import annotations

import numpy as np

from tieredkv import KVSpec


def payload_for(spec: KVSpec, keys) -> np.ndarray:
    """Blocks whose bytes are derived from their keys: any mix-up shows up byte for byte."""
    raw = np.ascontiguousarray(keys.keys).view(np.uint8).reshape(len(keys), 16)
    reps = -(-spec.block_bytes // 16)
    out = np.tile(raw, (1, reps))[:, : spec.block_bytes]
    # Make every 16-byte lane differ too, so a shifted copy is caught.
    out = out ^ (np.arange(spec.block_bytes, dtype=np.uint32) % 251).astype(np.uint8)
    return np.ascontiguousarray(out)
