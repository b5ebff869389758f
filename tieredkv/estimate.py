"""Sizing and benefit estimate: what a shared prefix costs per copy, and what sharing it saves.

KV bytes per token = layers x 2 x kv_heads x head_dim x dtype bytes. With ``workers`` processes each
serving ``concurrency`` requests that share a ``prefix_tokens`` system prompt, every request holds its
own copy of the prefix's KV unless the copies are shared; an upper bound on what sharing
removes is prefix tokens x concurrent requests x bytes per token (one copy must remain: the exact
saving is that minus one copy).

It also says what to configure: ``hot_bytes``, the size of a segment that holds the shared prefix once
plus every concurrent request's own full chunks (so that no running request's blocks push out
another's), metadata included; and the size to give ``/dev/shm`` (Docker ``--shm-size``, a Kubernetes
memory-backed ``emptyDir``): twice ``hot_bytes``, rounded up to 64 MiB, so that a resized or upgraded
segment can be created while the old one is still mapped by workers that have not restarted yet
(docs/deploy.md).
"""

from __future__ import annotations

from tieredkv import policies
from tieredkv.hot.segment import Layout
from tieredkv.spec import KVSpec

_SHM_ROUND = 64 << 20


def estimate(spec: KVSpec, *, prompt_tokens: int, prefix_tokens: int, concurrency: int, workers: int,
             prefill_ms_per_token: float | None = None) -> dict:
    """Sizes in bytes for one deployment shape.

    Args:
        spec: the model's KV geometry.
        prompt_tokens: tokens per request (prefix included).
        prefix_tokens: tokens of the prefix every request shares.
        concurrency: concurrent requests per worker.
        workers: worker processes.
        prefill_ms_per_token: if given, the prefill time that sharing saves per request is estimated.

    Returns:
        Sizes in bytes: KV per request / worker / in total, with and without sharing, plus
        ``hot_blocks``, ``hot_bytes`` (what to pass to ``TieredCache``) and ``shm_size_bytes`` (what
        ``/dev/shm`` needs).
    """
    for name, value in (("prompt_tokens", prompt_tokens), ("prefix_tokens", prefix_tokens),
                        ("concurrency", concurrency), ("workers", workers)):
        if value < 0 or (name in ("concurrency", "workers") and value == 0):
            raise ValueError(f"{name} must be {'positive' if name in ('concurrency', 'workers') else '>= 0'}")
    if prefix_tokens > prompt_tokens:
        raise ValueError("prefix_tokens cannot exceed prompt_tokens")
    bpt = spec.bytes_per_token
    requests = concurrency * workers
    prefix_bytes = prefix_tokens * bpt
    doc: dict[str, float] = {
        "bytes_per_token": bpt,
        "block_bytes": spec.block_bytes,
        "kv_per_request_bytes": prompt_tokens * bpt,
        "kv_per_worker_bytes": prompt_tokens * bpt * concurrency,
        "kv_total_bytes": prompt_tokens * bpt * requests,
        "prefix_kv_bytes": prefix_bytes,
        "concurrent_requests": requests,
        "duplicate_prefix_bytes": prefix_bytes * requests,          # the upper bound
        "saved_by_sharing_bytes": prefix_bytes * (requests - 1),     # one copy stays
        "kv_total_shared_bytes": prompt_tokens * bpt * requests - prefix_bytes * (requests - 1),
    }
    C = spec.chunk_tokens
    prefix_blocks = prefix_tokens // C
    hot_blocks = max(1, prefix_blocks + requests * (prompt_tokens // C - prefix_blocks))
    engine = policies.make("lru")

    def policy_bytes(n: int) -> int:
        return policies.StateLayout.for_policy(engine, n).nbytes

    hot_bytes = Layout.compute(spec, hot_blocks, policy_bytes(hot_blocks)).total_bytes
    # A segment sized in bytes gets the most slots that fit, found by a coarse search that may stop a
    # little short: grow the size until that search gives every block counted here a slot.
    while (short := hot_blocks - Layout.slots_for(spec, hot_bytes, policy_bytes)) > 0:
        hot_bytes += short * Layout.compute(spec, 1, policy_bytes(1)).slot_bytes + (1 << 16)
    doc["hot_blocks"] = hot_blocks
    doc["hot_bytes"] = hot_bytes
    doc["shm_size_bytes"] = -(-2 * hot_bytes // _SHM_ROUND) * _SHM_ROUND
    if prefill_ms_per_token is not None:
        doc["prefill_saved_ms_per_request"] = prefix_tokens * prefill_ms_per_token
    return doc
