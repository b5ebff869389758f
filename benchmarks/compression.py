"""Compression of real bf16 KV: ratio, codec speed, and warm and remote restores with and without it.

The KV is a real model's: SmolLM2-135M-Instruct (``tieredkv.integrations.models``, the demo's model)
prefills ``--tokens`` tokens of this repository's docs; its K and V, cast to bf16, are cut into blocks of
``--chunk`` tokens (``KVSpec.from_hf_config``). ``--data normal`` uses bf16 patterns of normal floats
instead (no model, about the same ratio). Random bytes would not compress and say nothing.

Four measurements, each variant interleaved with the others round by round so that a change in the
machine's load hits all of them (the load average is printed beside every figure):

1. codecs: ratio and compress / decompress GB/s of one block at a time (``tieredkv.codec``), and the
   order-0 entropy bound of the byte planes;
2. warm restore: ``WarmTier.get_many`` of every block (``verify="always"``) from a tier written with
   ``compress`` none / zstd / lz4, page cache warm and cold (the slab files' pages dropped with
   ``POSIX_FADV_DONTNEED``, or the whole page cache with ``--drop-caches``, root only: it slows every
   other process on the machine);
3. remote restore: ``RemoteTier.get_many`` from a valkey-server on 127.0.0.1 (loopback: no network
   limit), per codec;
4. break-even: the device or link speed below which compression pays, ``B* = D (1 - 1/r)`` for the
   decode speed ``D`` and ratio ``r`` of table 1;
5. capacity: one disk budget (``--budget`` blocks of full slots) given to a warm tier of full slots
   (uncompressed, and zstd) and to compact tiers (``--slot-fractions``: slots of that share of a block,
   every block a zstd frame); all blocks are stored in order (LRU evicts the oldest), then the blocks
   held are counted, and the newest blocks that every tier holds are restored from each (page cache
   warm and cold): the same bytes end to end, so the times compare directly.

    python benchmarks/compression.py                       # smollm2, 2048 tokens, 64-token blocks
    python benchmarks/compression.py --data normal --json /tmp/compression.json
    python benchmarks/compression.py --tokens 4096 --only capacity   # 64 blocks, budget 32

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from warm_tier import drop_cache  # benchmarks/warm_tier.py: fdatasync + POSIX_FADV_DONTNEED per file

from tieredkv import KVSpec, chunk_keys
from tieredkv import codec as cd
from tieredkv.tier import PutResult

ROOT = Path(__file__).resolve().parents[1]
CODECS = ("none", "zstd", "lz4")
#: the remote tier also has zlib (its only codec before blosc2): the "before" of the comparison
REMOTE_CODECS = ("none", "zlib", "zstd", "lz4")


def load() -> float:
    return round(os.getloadavg()[0], 1)


# ---- the data -----------------------------------------------------------------------------------------
def smollm2_blocks(tokens: int, chunk: int) -> tuple[KVSpec, np.ndarray]:
    """Blocks of SmolLM2's bf16 KV for ``tokens`` tokens of the docs (real weights, real text)."""
    import torch

    from tieredkv.integrations.models import load_model
    from tieredkv.layout import model_to_blocks

    model, tok = load_model("smollm2")
    text = "".join(Path(p).read_text() for p in sorted(glob.glob(str(ROOT / "docs" / "*.md"))))
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    n = ids.shape[1] // chunk
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = cache.layers if hasattr(cache, "layers") else None
    ks = [layer.keys for layer in layers] if layers is not None else [kv[0] for kv in cache]
    vs = [layer.values for layer in layers] if layers is not None else [kv[1] for kv in cache]
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(ks, vs)]).to(torch.bfloat16)
    spec = KVSpec.from_hf_config(model.config, chunk_tokens=chunk, dtype="bfloat16",
                                 model_id=f"bench/compression-{os.getpid()}")
    blocks = np.empty((n, spec.block_bytes), np.uint8)
    model_to_blocks(spec, np.ascontiguousarray(kv.view(torch.int16).numpy()).view(spec.numpy_dtype), 0, blocks)
    return spec, blocks


def normal_blocks(tokens: int, chunk: int) -> tuple[KVSpec, np.ndarray]:
    """bf16 patterns of normal floats in SmolLM2's geometry."""
    spec = KVSpec(model_id=f"bench/compression-{os.getpid()}", num_layers=30, num_kv_heads=3, head_dim=64,
                  dtype="bfloat16", chunk_tokens=chunk)
    n = tokens // chunk
    f = np.random.default_rng(0).standard_normal(n * spec.block_bytes // 2).astype(np.float32)
    return spec, (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, spec.block_bytes)


def plane_entropy_bound(blocks: np.ndarray) -> float:
    """16 bits over the order-0 entropies of the high and low byte planes: what a per-plane entropy coder
    reaches without context."""
    v = blocks.reshape(-1).view(np.uint16)

    def h(x):
        c = np.bincount(x, minlength=256).astype(float)
        p = c[c > 0] / c.sum()
        return float(-(p * np.log2(p)).sum())

    return 16 / (h((v >> 8).astype(np.uint8)) + h((v & 255).astype(np.uint8)))


# ---- 1: codecs ------------------------------------------------------------------------------------------
def codec_table(spec: KVSpec, blocks: np.ndarray, repeats: int) -> list[dict]:
    names = ("zstd", "lz4", "zlib")
    comps = {n: cd.Compressor(n, spec.dtype_bytes) for n in names}
    sample = {n: blocks if n != "zlib" else blocks[:max(1, len(blocks) // 8)] for n in names}
    bodies = {n: [comps[n].compress(b) for b in sample[n]] for n in names}
    times: dict[str, dict[str, list]] = {n: {"c": [], "d": [], "load": []} for n in names}
    out = np.empty(spec.block_bytes, np.uint8)
    for _ in range(repeats):
        for n in names:
            t0 = time.perf_counter()
            for b in sample[n]:
                comps[n].compress(b)
            t1 = time.perf_counter()
            for body in bodies[n]:
                if body is not None:
                    cd.decompress_into(comps[n].id, body, out, spec.dtype_bytes)
            t2 = time.perf_counter()
            times[n]["c"].append(t1 - t0)
            times[n]["d"].append(t2 - t1)
            times[n]["load"].append(load())
    rows = []
    for n in names:
        raw = sample[n].nbytes
        stored = sum(len(b) if b is not None else spec.block_bytes for b in bodies[n])
        rows.append({"codec": n, "ratio": raw / stored, "blocks": len(sample[n]),
                     "compress_gbps": raw / min(times[n]["c"]) / 1e9,
                     "decompress_gbps": raw / min(times[n]["d"]) / 1e9,
                     "load": statistics.median(times[n]["load"])})
    return rows


# ---- 2: warm ----------------------------------------------------------------------------------------------
def _drop(tier_dir: str, everything: bool) -> None:
    if everything:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    drop_cache(glob.glob(os.path.join(tier_dir, "slab-*.bin")))


def warm_restores(spec: KVSpec, blocks: np.ndarray, keys, repeats: int, drop_caches: bool, work: str) -> dict:
    from tieredkv.warm import WarmTier

    n = len(blocks)
    tiers = {c: WarmTier(spec, os.path.join(work, f"warm-{c}"), (n + 2) * spec.block_bytes, compress=c,
                         verify="always") for c in CODECS}
    put_s: dict = {c: [] for c in CODECS}
    for _ in range(repeats):  # write_through's cost (write-behind pays it on its own thread)
        for c in CODECS:
            tiers[c].remove(keys)
            t0 = time.perf_counter()
            assert (tiers[c].put_many(keys, blocks) == PutResult.STORED).all()
            put_s[c].append(time.perf_counter() - t0)
    out = np.empty_like(blocks)
    res: dict = {c: {"hot": [], "cold": [], "load_hot": [], "load_cold": []} for c in CODECS}
    try:
        for _ in range(repeats):
            for c in CODECS:
                for state in ("cold", "hot"):
                    if state == "cold":
                        _drop(str(tiers[c].path), drop_caches)
                    out[:] = 0
                    t0 = time.perf_counter()
                    got = tiers[c].get_many(keys, out)
                    dt = time.perf_counter() - t0
                    assert got == n and np.array_equal(out, blocks), (c, got)
                    res[c][state].append(dt)
                    res[c][f"load_{state}"].append(load())
    finally:
        for t in tiers.values():
            t.close()
    summary = {}
    for c in CODECS:
        summary[c] = {
            "put_s": statistics.median(put_s[c]),
            **{f"{s}_s": statistics.median(res[c][s]) for s in ("hot", "cold")},
            **{f"load_{s}": statistics.median(res[c][f"load_{s}"]) for s in ("hot", "cold")},
        }
        for s in ("hot", "cold"):
            summary[c][f"{s}_vs_raw"] = summary["none"][f"{s}_s"] / summary[c][f"{s}_s"] if c != "none" else 1.0
    return summary


# ---- 5: capacity -----------------------------------------------------------------------------------------
def capacity(spec: KVSpec, blocks: np.ndarray, keys, budget: int, fractions: list[float], repeats: int,
             drop_caches: bool, work: str) -> dict:
    """Blocks held in ``budget`` full slots' worth of disk, and restores of the blocks all tiers hold."""
    from tieredkv.warm import WarmTier

    n = len(blocks)
    variants = {"none": {}, "zstd": {"compress": "zstd"},
                **{f"compact {f:g}": {"slot_fraction": f} for f in fractions}}
    disk = budget * spec.block_bytes
    tiers = {v: WarmTier(spec, os.path.join(work, f"cap-{i}"), disk, verify="always", **kw)
             for i, (v, kw) in enumerate(variants.items())}
    summary: dict = {}
    try:
        for v, t in tiers.items():
            refused = 0
            t0 = time.perf_counter()
            for b in range(0, n, 4):  # in order, as prompts arrive: LRU evicts the oldest
                refused += int((t.put_many(keys[b:b + 4], blocks[b:b + 4]) == PutResult.NO_SPACE).sum())
            held = t.contains_many(keys)
            slabs = glob.glob(os.path.join(str(t.path), "slab-*.bin"))
            summary[v] = {"held": int(held.sum()), "refused": refused, "slot_bytes": t.slot_bytes,
                          "slab_bytes": sum(os.path.getsize(p) for p in slabs),
                          "put_s": time.perf_counter() - t0, "load_put": load()}
        common = min(s["held"] for s in summary.values())
        tail = keys[n - common:]
        want = blocks[n - common:]
        out = np.empty_like(want)
        res: dict = {v: {"hot": [], "cold": [], "load_hot": [], "load_cold": []} for v in tiers}
        for _ in range(repeats):
            for v, t in tiers.items():
                for state in ("cold", "hot"):
                    if state == "cold":
                        _drop(str(t.path), drop_caches)
                    out[:] = 0
                    t0 = time.perf_counter()
                    got = t.get_many(tail, out)
                    res[v][state].append(time.perf_counter() - t0)
                    res[v][f"load_{state}"].append(load())
                    assert got == common and np.array_equal(out, want), (v, got)
    finally:
        for t in tiers.values():
            t.close()
    for v in tiers:
        summary[v].update({f"{s}_s": statistics.median(res[v][s]) for s in ("hot", "cold")})
        summary[v].update({f"load_{s}": statistics.median(res[v][f"load_{s}"]) for s in ("hot", "cold")})
        summary[v]["held_vs_raw"] = summary[v]["held"] / summary["none"]["held"]
        for s in ("hot", "cold"):
            summary[v][f"{s}_vs_raw"] = summary["none"][f"{s}_s"] / summary[v][f"{s}_s"]
    comp = cd.Compressor("zstd", spec.dtype_bytes)
    frames = np.array([16 + len(comp.compress(b) or b) for b in blocks]) / spec.block_bytes  # 16: frame header
    return {"budget_blocks": budget, "disk_bytes": disk, "restored": common, "variants": summary,
            "frame_fraction": {"min": float(frames.min()), "median": float(np.median(frames)),
                               "max": float(frames.max())}}


def print_capacity(cap: dict, spec: KVSpec, drop_caches: bool) -> None:
    cold = "whole page cache dropped" if drop_caches else "slab pages dropped (POSIX_FADV_DONTNEED)"
    print(f"\ncapacity: {cap['disk_bytes'] / 2**20:.1f} MiB of disk ({cap['budget_blocks']} full slots of "
          f"{spec.block_bytes / 2**20:.2f} MiB); restore of the {cap['restored']} newest blocks every tier holds, "
          f"verify=always (cold: {cold}); x = uncompressed time / this time")
    f = cap["frame_fraction"]
    print(f"zstd frames are {f['min']:.3f}-{f['max']:.3f} of a block (median {f['median']:.3f}): a compact "
          f"tier's slot_fraction must be at least the max (rounded up to 4 KiB) for none to be refused")
    print("tier          slot KiB  held  x held  refused  slab MiB  warm s    x     (load)   cold s    x     (load)")
    for v, r in cap["variants"].items():
        print(f"{v:13} {r['slot_bytes'] / 1024:8.0f} {r['held']:5} {r['held_vs_raw']:6.2f} {r['refused']:8} "
              f"{r['slab_bytes'] / 2**20:9.1f}  {r['hot_s']:7.4f} {r['hot_vs_raw']:5.2f} ({r['load_hot']:4})  "
              f"{r['cold_s']:7.4f} {r['cold_vs_raw']:5.2f} ({r['load_cold']})")


# ---- 3: remote -----------------------------------------------------------------------------------------
def remote_restores(spec: KVSpec, blocks: np.ndarray, keys, repeats: int) -> dict:
    from tieredkv.remote import RemoteTier
    from tieredkv.remote import testing as servers

    n = len(blocks)
    out = np.empty_like(blocks)
    res: dict = {c: {"get": [], "load": []} for c in REMOTE_CODECS}
    secret = os.urandom(32)  # values are MACed as in a real fleet
    summary: dict = {}
    with servers.ValkeyServer() as server:
        tiers = {c: RemoteTier(KVSpec.from_dict({**spec.to_dict(), "model_id": f"{spec.model_id}-{c}"}),
                               f"{server.url}?compress={c}&deadline_ms=60000", secret=secret) for c in REMOTE_CODECS}
        try:
            puts: dict = {c: [] for c in tiers}
            for _ in range(repeats):
                for c, t in tiers.items():
                    t.remove(keys_for(t.spec, n))
                    t0 = time.perf_counter()
                    assert (t.put_many(keys_for(t.spec, n), blocks) == PutResult.STORED).all()
                    puts[c].append(time.perf_counter() - t0)
            for c, t in tiers.items():
                summary[c] = {"put_s": statistics.median(puts[c]), "wire_bytes": t.counts["wire_bytes_in"] / repeats}
            for _ in range(repeats):
                for c, t in tiers.items():
                    out[:] = 0
                    t0 = time.perf_counter()
                    got = t.get_many(keys_for(t.spec, n), out)
                    res[c]["get"].append(time.perf_counter() - t0)
                    res[c]["load"].append(load())
                    assert got == n and np.array_equal(out, blocks), (c, got)
        finally:
            for t in tiers.values():
                t.close()
    for c in REMOTE_CODECS:
        summary[c].update(get_s=statistics.median(res[c]["get"]), load=statistics.median(res[c]["load"]),
                          ratio=blocks.nbytes / summary[c]["wire_bytes"])
        summary[c]["get_vs_raw"] = summary["none"]["get_s"] / summary[c]["get_s"] if c != "none" else 1.0
    return summary


def keys_for(spec: KVSpec, n: int):
    return chunk_keys(spec, np.arange(n * spec.chunk_tokens + 1) % 49_000)


def break_even(ratio: float, decode_bytes_per_s: float) -> float:
    """Device or link speed (bytes/s) below which a compressed restore is faster: reading ``S`` bytes at
    ``B`` takes ``S/B``; compressed, ``S/(rB)`` plus decoding at ``D``: ``S/D``. They meet at
    ``B* = D (1 - 1/r)`` (decoding after the transfer, not overlapped with it)."""
    return decode_bytes_per_s * (1 - 1 / ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", choices=("smollm2", "normal"), default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold reads drop the whole page cache (root; slows the machine for everyone)")
    ap.add_argument("--no-remote", action="store_true")
    ap.add_argument("--only", choices=("capacity",), help="run only this part (after the data is made)")
    ap.add_argument("--budget", type=int, help="capacity: disk budget in full slots (default: half the blocks)")
    ap.add_argument("--slot-fractions", default="0.75,0.72", help="capacity: compact tiers' slot fractions")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    spec, blocks = (smollm2_blocks if args.data == "smollm2" else normal_blocks)(args.tokens, args.chunk)
    keys = keys_for(spec, len(blocks))
    print(f"data: {args.data}, {len(blocks)} blocks of {spec.block_bytes / 2**20:.2f} MiB ({blocks.nbytes / 2**20:.1f} "
          f"MiB, {spec.num_layers} layers x {spec.num_kv_heads} kv heads x {spec.head_dim}, bf16) in "
          f"{time.perf_counter() - t0:.1f} s; byte-plane entropy bound {plane_entropy_bound(blocks):.3f}x; "
          f"blosc2 threads {cd.THREADS}; load {load()}")
    result: dict = {"data": args.data, "tokens": args.tokens, "chunk": args.chunk, "block_bytes": spec.block_bytes,
                    "blocks": len(blocks), "entropy_bound": plane_entropy_bound(blocks), "threads": cd.THREADS}

    if args.only == "capacity":
        run_capacity(args, spec, blocks, keys, result)
        return
    result["codecs"] = codec_table(spec, blocks, args.repeats)
    print("\ncodec  ratio  compress GB/s  decompress GB/s  (load)")
    for r in result["codecs"]:
        print(f"{r['codec']:5} {r['ratio']:6.3f} {r['compress_gbps']:13.2f} {r['decompress_gbps']:16.2f}  "
              f"({r['load']})")

    work = tempfile.mkdtemp(prefix="tieredkv-bench-compression-")
    try:
        warm = warm_restores(spec, blocks, keys, args.repeats, args.drop_caches, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["warm"] = warm
    cold = "whole page cache dropped" if args.drop_caches else "slab pages dropped (POSIX_FADV_DONTNEED)"
    print(f"\nwarm restore of {blocks.nbytes / 2**20:.1f} MiB, verify=always (cold: {cold}); x = raw time / this time")
    print("codec  put s   page cache warm: s   x     (load)   cold: s   x     (load)")
    for c, w in warm.items():
        print(f"{c:5} {w['put_s']:6.3f}  {w['hot_s']:18.4f} {w['hot_vs_raw']:5.2f} ({w['load_hot']:4})  "
              f"{w['cold_s']:8.4f} {w['cold_vs_raw']:5.2f} ({w['load_cold']})")
    result["break_even"] = {}
    print("break-even device or link speed, D (1 - 1/r) from the codec table (slower than it: compression pays)")
    for r in result["codecs"]:
        b = break_even(r["ratio"], r["decompress_gbps"] * 1e9)
        result["break_even"][r["codec"]] = b
        print(f"  {r['codec']}: {b / 1e9:.2f} GB/s ({b * 8 / 1e9:.1f} Gbit/s)")

    if not args.no_remote:
        remote = remote_restores(spec, blocks, keys, args.repeats)
        result["remote"] = remote
        print("\nremote restore from valkey on 127.0.0.1 (loopback); x = raw time / this time")
        print("codec  wire ratio  put s    get s    x     (load)")
        for c, r in remote.items():
            print(f"{c:5} {r['ratio']:10.3f} {r['put_s']:6.3f} {r['get_s']:8.4f} {r['get_vs_raw']:5.2f} ({r['load']})")
    run_capacity(args, spec, blocks, keys, result)
    result["load_end"] = load()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def run_capacity(args, spec: KVSpec, blocks: np.ndarray, keys, result: dict) -> None:
    work = tempfile.mkdtemp(prefix="tieredkv-bench-capacity-")
    try:
        result["capacity"] = capacity(spec, blocks, keys, args.budget or len(blocks) // 2,
                                      [float(f) for f in args.slot_fractions.split(",") if f],
                                      args.repeats, args.drop_caches, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_capacity(result["capacity"], spec, args.drop_caches)
    if args.only and args.json:
        result["load_end"] = load()
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
