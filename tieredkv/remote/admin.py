"""Administration of a remote store: what it holds per namespace, and a scrub of every value
(``tieredkv ls --remote URL``, ``tieredkv stats --remote URL``, ``tieredkv verify --remote URL``).

These calls raise ``RemoteUnavailable`` when the store does not answer: an operator asked for them.
Listing needs a store that can enumerate names (Valkey's SCAN); Mooncake Store cannot, so ``ls`` and
``verify`` say so and ``stats`` shows what its client knows.
"""

from __future__ import annotations

import collections

from tieredkv.remote.auth import FleetKey, load_key
from tieredkv.remote.store import Store, open_store, parse_url
from tieredkv.remote.value import FORMAT_VERSION, check_value

#: Values fetched per round trip while scrubbing.
VERIFY_BATCH = 64


def connect(url: str, with_key: bool = False) -> tuple[Store, FleetKey | None]:
    """A store client for ``url`` (tier options in the query string are ignored here), and with
    ``with_key`` the fleet key (from the URL's ``secret_file`` or the environment, as for the tier)."""
    from tieredkv.remote.tier import TIER_OPTIONS

    scheme, host, port, options = parse_url(url)
    key = load_key(options) if with_key else None
    return open_store(scheme, host, port, {k: v for k, v in options.items() if k not in TIER_OPTIONS}), key


def _split(name: str) -> tuple[str, str] | None:
    """``(namespace tag, name digest hex)`` of a block's name, or None."""
    parts = name.split(":")
    if len(parts) != 3 or parts[0] != f"tkv{FORMAT_VERSION}" or len(parts[1]) != 16 or len(parts[2]) != 32:
        return None
    return parts[1], parts[2]


def shown(name: str) -> str:
    """A name as text that any terminal and JSON can take (bytes that are not UTF-8 as ``\\xNN``)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def namespaces(url: str) -> dict:
    """Blocks per namespace tag in the store, and the server's own numbers. Needs no secret: a tag is a
    keyed digest of the namespace (``FleetKey.namespace_tag`` maps a spec to it)."""
    store, _ = connect(url)
    try:
        doc = {"url": store.url, "server": store.info()}
        counts: collections.Counter[str] = collections.Counter()
        for name in store.scan(f"tkv{FORMAT_VERSION}:"):
            parts = _split(name)
            counts[parts[0] if parts else "(unparsable names)"] += 1
        doc["namespaces"] = [{"tag": tag, "blocks": n} for tag, n in counts.most_common()]
        return doc
    finally:
        store.close()


def verify(url: str, repair: bool = False) -> dict:
    """Fetch and check every tieredkv value in the store (its MAC under the fleet key, its name, its
    lengths); with ``repair``, delete the bad ones.

    Returns ``{"url", "checked", "bad": [{"name", "reason"}], "removed", "ok"}``.

    Raises:
        InvalidInput: no fleet secret (see ``tieredkv.remote.auth``): a MAC cannot be checked without it.
    """
    store, key = connect(url, with_key=True)
    assert key is not None
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
                reason = "unparsable name" if parts is None else check_value(value, parts[1], key)
                if reason:
                    bad.append({"name": shown(batch[i]), "reason": reason, "_raw": batch[i]})

            store.get_many(batch, 1 << 31, sink)
        removed = store.delete_many([b.pop("_raw") for b in bad]) if repair and bad else 0
        for b in bad:
            b.pop("_raw", None)
        return {"url": store.url, "checked": checked, "bad": bad, "removed": removed, "ok": not bad}
    finally:
        store.close()
