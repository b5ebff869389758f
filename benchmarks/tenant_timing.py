"""Does a lookup's time depend on whether another tenant's blocks are resident? (prompt-cache timing
side channel, CVE-2025-46570)

    python benchmarks/tenant_timing.py [--rounds 2000] [--blocks 16] [--json OUT]

Tenant A looks up a prompt that it never stored, in two states of the cache:

    absent    nobody stored this prompt
    resident  tenant B stored the very same tokens (under B's salt) in the hot tier and the warm tier

If the salt isolates tenants, A's lookup misses in both states, and its time must not tell them apart.
The two states are measured interleaved (ABAB...) in one process, on one pair of tiers, to cancel
drift. Prints median and p99 of each and their ratio; a ratio near 1.00 means no signal.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
import time

import numpy as np
import posix_ipc

from tieredkv import KVSpec, TieredCache, chunk_keys

SPEC = KVSpec(model_id="bench/tenant", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)


def measure(rounds: int = 2000, blocks: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    name = f"/tieredkv-timing-{os.getpid()}-{secrets.token_hex(3)}"
    root = tempfile.mkdtemp(prefix="rel_timing_")
    n_tokens = blocks * SPEC.chunk_tokens + 1
    times = {"absent": [], "resident": []}
    try:
        with TieredCache(SPEC, hot_bytes=64 << 20, hot_name=name, warm_dir=root, warm_bytes=64 << 20,
                         demotion="write_through") as c:
            kv = np.ones((SPEC.num_layers, 2, SPEC.num_kv_heads, n_tokens, SPEC.head_dim), np.float16)
            # Pairs of prompts of the same shape: one stored by tenant B, one never stored.
            pairs = []
            for _ in range(64):
                stored = rng.integers(0, 30_000, n_tokens)
                absent = rng.integers(0, 30_000, n_tokens)
                c.store(stored, kv, salt=b"tenant-B")
                pairs.append((stored, absent))
            for r in range(rounds):
                stored, absent = pairs[r % len(pairs)]
                pair = (("resident", stored), ("absent", absent))
                order = pair if r % 2 else pair[::-1]
                for label, tokens in order:
                    t0 = time.perf_counter_ns()
                    hit = c.lookup(tokens, salt=b"tenant-A")
                    times[label].append(time.perf_counter_ns() - t0)
                    if hit.tokens:
                        raise AssertionError("tenant A hit tenant B's blocks")
            # Sanity: tenant B itself does hit (the blocks really are resident, in both tiers).
            assert c.lookup(pairs[0][0], salt=b"tenant-B").tokens == blocks * SPEC.chunk_tokens
            assert c.warm.match(chunk_keys(SPEC, pairs[0][0][:-1], b"tenant-B")) == blocks
    finally:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shutil.rmtree(root, ignore_errors=True)
    out = {"rounds": rounds, "blocks": blocks}
    for label, xs in times.items():
        a = np.asarray(xs[len(xs) // 10:]) / 1000.0  # drop the first 10% (warm-up), in microseconds
        out[label] = {"median_us": round(float(np.median(a)), 2), "p99_us": round(float(np.percentile(a, 99)), 2),
                      "mean_us": round(float(a.mean()), 2)}
    out["median_ratio_resident_over_absent"] = round(out["resident"]["median_us"] / out["absent"]["median_us"], 3)
    out["p99_ratio_resident_over_absent"] = round(out["resident"]["p99_us"] / out["absent"]["p99_us"], 3)
    # A permutation check of the medians: how often does a random relabelling differ as much?
    both = np.concatenate([times["absent"], times["resident"]]).astype(float)
    obs = abs(np.median(times["resident"]) - np.median(times["absent"]))
    perm_rng = np.random.default_rng(1)
    n = len(times["absent"])
    shuffles = (perm_rng.permutation(both) for _ in range(500))
    exceed = sum(abs(np.median(p[:n]) - np.median(p[n:])) >= obs for p in shuffles)
    out["permutation_p_value"] = round((exceed + 1) / 501, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    r = measure(args.rounds, args.blocks)
    for label in ("absent", "resident"):
        s = r[label]
        print(f"{label:9s} median {s['median_us']:8.2f} us   p99 {s['p99_us']:8.2f} us   mean {s['mean_us']:8.2f} us")
    print(f"ratio resident/absent: median {r['median_ratio_resident_over_absent']}, p99 "
          f"{r['p99_ratio_resident_over_absent']}; permutation p-value of the median difference "
          f"{r['permutation_p_value']} ({r['rounds']} rounds, {r['blocks']}-block prompts)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
