"""Sizing and benefit estimate (the sizing rule of docs/architecture.md, "Targets").

KV bytes per token = layers x 2 x kv_heads x head_dim x dtype bytes. With ``workers`` processes each
serving ``concurrency`` requests that share a ``prefix_tokens`` system prompt, every request holds its
own copy of the prefix's KV unless the copies are shared; the upper bound on what sharing removes is
prefix tokens x concurrent requests x bytes per token (one copy must remain: the exact saving is that
minus one copy).
"""

from __future__ import annotations

from tieredkv.spec import KVSpec


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
    if prefill_ms_per_token is not None:
        doc["prefill_saved_ms_per_request"] = prefix_tokens * prefill_ms_per_token
    return doc
