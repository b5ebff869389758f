"""One tensor-parallel rank for tests/test_vllm_safety.py (spawned; imports as little as it can)."""

from __future__ import annotations

import types
from typing import Any


def agree_rank(rank: int, port: int, flags: list[bool], out: Any) -> None:
    """Join a 2-process gloo group standing in for vLLM's TP group and report what the ranks agree on."""
    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps

    from tieredkv.integrations.vllm import _agree_across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.get_tp_group = lambda: types.SimpleNamespace(cpu_group=dist.group.WORLD)
    out.put((rank, _agree_across_ranks(flags, 2)))
    dist.destroy_process_group()
