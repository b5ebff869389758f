"""Hot tier benchmark: bandwidth as a ratio to memcpy, match latency, scaling with processes and size.

    python benchmarks/hot_tier.py [--quick] [--json OUT]

Every speed figure is a ratio to a baseline measured in the same run on the same bytes:
``np.copyto`` between two private buffers holding the same number of blocks. Medians over repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time

import numpy as np

from tieredkv import HotTier, KVSpec, chunk_keys

SPECS = {
    # 64 KiB blocks: 8 layers x 2 x 1 head x 64 tokens x 32 dims x fp16
    "64KiB": KVSpec(model_id="bench/64k", num_layers=8, num_kv_heads=1, head_dim=32, dtype="float16"),
    # 1.75 MiB blocks: the seed's 7B geometry, 64 tokens (28 x 2 x 2 x 64 x 128 x fp16)
    "1.75MiB": KVSpec(model_id="bench/seed-7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16"),
}
SMALL = KVSpec(model_id="bench/small", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", chunk_tokens=4)


def _name() -> str:
    return f"/tieredkv-bench-{os.getpid()}-{secrets.token_hex(3)}"


def _median_time(fn, repeats: int) -> float:
    fn()  # warm: page faults, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompts_for(spec: KVSpec, n_prompts: int, blocks: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [chunk_keys(spec, rng.integers(0, 50_000, blocks * spec.chunk_tokens)) for _ in range(n_prompts)]


@contextlib.contextmanager
def segment_dir(path: str | None):
    """Make segments in ``path`` meanwhile (``TIEREDKV_SHM_DIR``; forked workers inherit it)."""
    if path is None:
        yield
        return
    old = os.environ.get("TIEREDKV_SHM_DIR")
    os.environ["TIEREDKV_SHM_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIEREDKV_SHM_DIR"]
        else:
            os.environ["TIEREDKV_SHM_DIR"] = old


def bandwidth(label: str, spec: KVSpec, n_slots: int, batch: int, repeats: int,
              shm_dir: str | None = None) -> dict:
    """get_many / put_many of ``batch`` blocks vs np.copyto of the same bytes between private buffers.

    ``shm_dir``: put the segment there (e.g. a tmpfs mounted ``huge=always``) instead of /dev/shm.
    """
    with segment_dir(shm_dir):
        return _bandwidth(label, spec, n_slots, batch, repeats)


def _bandwidth(label: str, spec: KVSpec, n_slots: int, batch: int, repeats: int) -> dict:
    name = _name()
    n_prompts = max(1, n_slots // batch)
    tier = HotTier(spec, n_slots=(n_prompts + 1) * batch, name=name)  # one batch of room for puts
    try:
        prompts = prompts_for(spec, n_prompts, batch)
        payload = np.ones((batch, spec.block_bytes), np.uint8)
        out = np.empty_like(payload)
        # A segment in use, not a fresh one: fill it, free everything, then store the prompts (each in
        # one call). Where slots come back matters: adjacent ones are read in one copy per run.
        filler = prompts_for(spec, n_prompts + 1, batch, seed=2)
        for ck in filler:
            tier.put_many(ck, payload)
        for ck in filler:
            tier.remove(ck)
        for ck in prompts:
            tier.put_many(ck, payload)
        src = np.ones((n_prompts * batch, spec.block_bytes), np.uint8)  # private, same working set
        i = iter(range(10**9))

        def tier_get():
            ck = prompts[next(i) % n_prompts]
            assert tier.get_many(ck, out) == batch

        def base_copy():
            k = next(i) % n_prompts
            np.copyto(out, src[k * batch:(k + 1) * batch])

        def base_store():
            k = next(i) % n_prompts
            np.copyto(src[k * batch:(k + 1) * batch], payload)

        fresh = prompts_for(spec, 1, batch, seed=1)[0]

        def tier_put():
            tier.put_many(fresh, payload)

        # Interleaved: each repeat times the tier and its baseline back to back, so that both see the
        # same machine load (on a shared host the load changes within seconds).
        samples: dict = {"get": [], "copy": [], "put": [], "store": []}
        tier_put()
        for fn in (tier_get, base_copy, base_store):
            fn()  # warm: page faults, caches
        for _ in range(repeats):
            tier.remove(fresh)  # untimed: frees the batch of room again
            for key, fn in (("copy", base_copy), ("get", tier_get), ("store", base_store), ("put", tier_put)):
                t0 = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - t0)
        t_get, t_copy, t_put, t_store = (statistics.median(samples[k]) for k in ("get", "copy", "put", "store"))
    finally:
        tier.unlink()
    return {"blocks": label, "block_bytes": spec.block_bytes, "batch": batch,
            "get_gbps": batch * spec.block_bytes / t_get / 1e9, "memcpy_gbps": batch * spec.block_bytes / t_copy / 1e9,
            "get_ratio": t_copy / t_get, "get_overhead_us_per_block": (t_get - t_copy) / batch * 1e6,
            "put_ratio": t_store / t_put, "put_overhead_us_per_block": (t_put - t_store) / batch * 1e6}


def match_latency(repeats: int) -> list[dict]:
    spec = SPECS["1.75MiB"]
    rows = []
    name = _name()
    tier = HotTier(spec, n_slots=64, name=name)
    try:
        for tokens in (4096, 131072):
            ids = np.random.default_rng(tokens).integers(0, 50_000, tokens)
            keys = chunk_keys(spec, ids)
            t_hash = _median_time(lambda ids=ids: chunk_keys(spec, ids), repeats)
            t_total = _median_time(lambda ids=ids: tier.match(chunk_keys(spec, ids)), repeats)
            rows.append({"prompt_tokens": tokens, "blocks": len(keys), "hash_ms": t_hash * 1e3,
                         "match_ms": t_total * 1e3})
    finally:
        tier.unlink()
    return rows


def _proc_reader(spec, name, batch, seconds, seed, results):
    tier = HotTier(spec, name=name, policy=None, create=False)
    prompts = prompts_for(spec, 8, batch, seed=0)
    out = np.empty((batch, spec.block_bytes), np.uint8)
    moved = 0
    end = time.perf_counter() + seconds
    k = seed
    while time.perf_counter() < end:
        moved += tier.get_many(prompts[k % 8], out) * spec.block_bytes
        k += 1
    tier.close()
    results.put(moved / seconds)


def processes(spec: KVSpec, batch: int, counts, seconds: float) -> list[dict]:
    """Aggregate get_many bandwidth with N reader processes on one segment."""
    ctx = mp.get_context("fork")
    name = _name()
    tier = HotTier(spec, n_slots=8 * batch, name=name)
    try:
        payload = np.ones((batch, spec.block_bytes), np.uint8)
        for ck in prompts_for(spec, 8, batch, seed=0):
            tier.put_many(ck, payload)
        rows = []
        for n in counts:
            q = ctx.Queue()
            procs = [ctx.Process(target=_proc_reader, args=(spec, name, batch, seconds, s, q)) for s in range(n)]
            for p in procs:
                p.start()
            rates = [q.get(timeout=seconds + 60) for _ in procs]
            for p in procs:
                p.join()
            rows.append({"processes": n, "aggregate_gbps": sum(rates) / 1e9, "per_process_gbps": sum(rates) / n / 1e9})
    finally:
        tier.unlink()
    return rows


def scaling(slot_counts, repeats: int) -> list[dict]:
    """Per-block cost of match, put (with eviction) and get as the segment grows."""
    spec = SMALL
    rows = []
    for n_slots in slot_counts:
        name = _name()
        tier = HotTier(spec, n_slots=n_slots, name=name)
        try:
            batch = 64
            rng = np.random.default_rng(n_slots)
            # Fill the segment completely.
            payload = np.ones((batch, spec.block_bytes), np.uint8)
            filled = 0
            while filled < n_slots:
                ck = chunk_keys(spec, rng.integers(0, 2**31, batch * spec.chunk_tokens))
                tier.put_many(ck, payload)
                filled += batch
            probe = [chunk_keys(spec, rng.integers(0, 2**31, batch * spec.chunk_tokens)) for _ in range(repeats + 1)]
            it = iter(probe * 4)
            t_put = _median_time(lambda tier=tier, it=it, payload=payload: tier.put_many(next(it), payload),
                                 repeats)  # full: every put evicts
            stored = probe[-1]
            out = np.empty_like(payload)
            t_get = _median_time(lambda tier=tier, stored=stored, out=out: tier.get_many(stored, out), repeats)
            t_match = _median_time(lambda tier=tier, stored=stored: tier.match(stored), repeats)
            rows.append({"slots": n_slots, "put_evict_us_per_block": t_put / batch * 1e6,
                         "get_us_per_block": t_get / batch * 1e6, "match_us_per_block": t_match / batch * 1e6,
                         "segment_mib": tier._map.size / 2**20})
        finally:
            tier.unlink()
    return rows


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    cells = [cols] + [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke-sized run (< 30 s)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = ap.parse_args(argv)
    quick = args.quick
    repeats = 5 if quick else 21
    report = {"quick": quick, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    print("bandwidth (ratio: tier time vs np.copyto of the same bytes between private buffers; >1 is faster)")
    report["bandwidth"] = [bandwidth("64KiB", SPECS["64KiB"], 256 if quick else 1024, 64, repeats),
                           bandwidth("1.75MiB", SPECS["1.75MiB"], 64 if quick else 128, 16, repeats)]
    print(table(report["bandwidth"], ["blocks", "batch", "get_gbps", "memcpy_gbps", "get_ratio",
                                      "get_overhead_us_per_block", "put_ratio", "put_overhead_us_per_block"]))
    print("\nmatch latency, hashing included")
    report["match"] = match_latency(repeats)
    print(table(report["match"], ["prompt_tokens", "blocks", "hash_ms", "match_ms"]))
    print("\nget_many with N processes on one segment (64 KiB blocks, batches of 64)")
    report["processes"] = processes(SPECS["64KiB"], 64, (1, 2) if quick else (1, 2, 8), 1.0 if quick else 3.0)
    print(table(report["processes"], ["processes", "aggregate_gbps", "per_process_gbps"]))
    print("\nper-block cost as the segment grows (256-byte blocks; the segment is full, so every put evicts)")
    report["scaling"] = scaling((1024, 65536) if quick else (1024, 65536, 1 << 20), repeats)
    print(table(report["scaling"], ["slots", "segment_mib", "match_us_per_block", "get_us_per_block",
                                    "put_evict_us_per_block"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
