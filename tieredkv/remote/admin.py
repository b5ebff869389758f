"""Administration of a remote store: what it holds per namespace, and a scrub of every value
(``tieredkv ls --remote URL``, ``tieredkv stats --remote URL``, ``tieredkv verify --remote URL``).

These calls raise ``RemoteUnavailable`` when the store does not answer: an operator asked for them.
Listing needs a store that can enumerate names (Valkey's SCAN); Mooncake Store cannot, so ``ls`` and
``verify`` say so and ``stats`` shows what its client knows.
"""

from __future__ import annotations

import collections

from tieredkv.remote.store import Store, open_store, parse_url
from tieredkv.remote.value import FORMAT_VERSION, check_value

#: Values fetched per round trip while scrubbing.
VERIFY_BATCH = 64


def connect(url: str) -> Store:
    """A store client for ``url`` (tier options in the query string are ignored here)."""
    from tieredkv.remote.tier import TIER_OPTIONS

    scheme, host, port, options = parse_url(url)
    return open_store(scheme, host, port, {k: v for k, v in options.items() if k not in TIER_OPTIONS})


def _split(name: str) -> tuple[str, str, str] | None:
    """``(fingerprint, key hex, confirm hex)`` of a block's name, or None."""
    parts = name.split(":")
    if (len(parts) != 4 or parts[0] != f"tkv{FORMAT_VERSION}" or len(parts[1]) != 16 or len(parts[2]) != 32
            or len(parts[3]) != 16):
        return None
    return parts[1], parts[2], parts[3]


def namespaces(url: str) -> dict:
    """Blocks per namespace fingerprint in the store, and the server's own numbers."""
    store = connect(url)
    try:
        doc = {"url": store.url, "server": store.info()}
        counts: collections.Counter[str] = collections.Counter()
        for name in store.scan(f"tkv{FORMAT_VERSION}:"):
            parts = _split(name)
            counts[parts[0] if parts else "(unparsable names)"] += 1
        doc["namespaces"] = [{"fingerprint": fp, "blocks": n} for fp, n in counts.most_common()]
        return doc
    finally:
        store.close()


def verify(url: str, repair: bool = False) -> dict:
    """Fetch and check every tieredkv value in the store; with ``repair``, delete the bad ones.

    Returns ``{"url", "checked", "bad": [{"name", "reason"}], "removed", "ok"}``.
    """
    store = connect(url)
    try:
        names = list(store.scan(f"tkv{FORMAT_VERSION}:"))
        bad: list[dict] = []
        checked = 0
        for start in range(0, len(names), VERIFY_BATCH):
            batch = names[start:start + VERIFY_BATCH]

            def sink(i: int, value, batch=batch) -> None:
                nonlocal checked
                if value is None:  # evicted or removed since the scan: nothing to check
                    return
                checked += 1
                parts = _split(batch[i])
                reason = "unparsable name" if parts is None else check_value(value, *parts)
                if reason:
                    bad.append({"name": batch[i], "reason": reason})

            store.get_many(batch, 1 << 31, sink)
        removed = store.delete_many([b["name"] for b in bad]) if repair and bad else 0
        return {"url": store.url, "checked": checked, "bad": bad, "removed": removed, "ok": not bad}
    finally:
        store.close()
