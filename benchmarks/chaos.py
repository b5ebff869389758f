"""Chaos harness: worker processes hammer one TieredCache (hot + warm) while a killer SIGKILLs them.

    python benchmarks/chaos.py [--seconds 30] [--workers 8] [--kill-every 0.4] [--seed 0] [--json OUT]
    python benchmarks/chaos.py --seconds 600 --json soak.json     # soak: also RSS and /dev/shm flat

N workers (forkserver processes: none inherits an LMDB environment across fork) run random lookup /
load / store calls against one TieredCache over a small pool of prompts that share prefixes, under a
few tenant salts. Every block's bytes are a pure function of its key (``tieredkv.warm.testing.
payload_for``), so each worker checks every byte it loads without knowing who stored it, and a block
served across tenants (or from another prompt) shows up as wrong bytes. The parent is the killer: at
random moments it SIGKILLs a random worker (which may be inside a lock, mid-copy, mid-LMDB-commit)
and starts a new one in its place.

At the end the workers are stopped, the parent runs recovery and checks, then prints:

    operations          calls completed (lookup, load, store), summed over every incarnation
    kills / respawns    SIGKILLs sent and workers restarted
    recoveries          hot scrubs + slots/pins reclaimed from dead owners + warm claims reaped
    wrong_bytes         bytes that differed from what their key implies: loaded, or resident  (must be 0)
    over_bound          calls that took longer than --bound seconds (or never returned)      (must be 0)
    hot accounting      free + ready + writing-by-live-owners == capacity, after recover()   (must hold)
    warm verify         ``tieredkv.warm.admin.verify`` clean after the dead writers' claims are reaped
    errors              exceptions escaping a worker's call (a serving path must not raise)  (must be 0)

The exit status is 1 if any of those is violated. With ``--seconds >= 300`` (or ``--soak``) the run
also samples worker RSS and the bytes the run holds in /dev/shm and on disk, and fails if either
grows between the first and the last fifth of the run.

``run_chaos(...)`` is the same thing as a function returning the report (used by tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback

import numpy as np

from tieredkv import KVSpec, chunk_keys
from tieredkv.hot import segment as seg
from tieredkv.warm.admin import disk_bytes
from tieredkv.warm.testing import payload_for

#: 2 layers x 2 (K,V) x 2 heads x 16 tokens x 16 dims x fp16 = 4096-byte blocks: one page, one slot.
SPEC_ARGS = dict(model_id="chaos/tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                 chunk_tokens=16)
TENANTS = (b"", b"tenant-a", b"tenant-b")

# Per-worker row of shared int64 counters (written only by that worker; read by the parent).
FIELDS = ("ops", "lookups", "loads", "stores", "loaded_tokens", "stored_blocks", "wrong_bytes",
          "over_bound", "errors", "op_start_ns", "pid", "warm_recoveries", "max_op_ns")
F = {name: i for i, name in enumerate(FIELDS)}


# ---- prompts whose blocks are checkable by anyone ----------------------------------------------------
def make_prompt(rng: np.random.Generator, spec: KVSpec) -> np.ndarray:
    """A prompt from a small pool: one of 6 system prefixes, one of 12 continuations, a random tail.

    Prompts share prefixes (so blocks are hit, evicted, demoted and promoted) and end in a partial
    chunk at a random point (so hits stop at different depths).
    """
    C = spec.chunk_tokens
    system = int(rng.integers(6))
    cont = int(rng.integers(12))
    head = np.arange(system * 100_000, system * 100_000 + int(rng.integers(1, 4)) * C)
    body = np.arange(cont * 1_000 + 50_000_000, cont * 1_000 + 50_000_000 + int(rng.integers(0, 6)) * C)
    tail = rng.integers(0, 30_000, int(rng.integers(1, 2 * C)))
    return np.concatenate([head, body, tail]).astype(np.int64)


def kv_for(spec: KVSpec, tokens: np.ndarray, salt: bytes) -> np.ndarray:
    """A ``(layers, 2, kv_heads, n_tokens, head_dim)`` array whose chunk ``i`` holds
    ``payload_for(key_i)``; the trailing partial chunk is zeros."""
    keys = chunk_keys(spec, tokens, salt)
    C = spec.chunk_tokens
    kv = np.zeros((spec.num_layers, 2, spec.num_kv_heads, len(tokens), spec.head_dim), spec.numpy_dtype)
    blocks = payload_for(keys, spec.block_bytes).view(spec.numpy_dtype).reshape(len(keys), *spec.block_shape)
    for i in range(len(keys)):
        kv[:, :, :, i * C:(i + 1) * C, :] = blocks[i]
    return kv


def wrong_bytes_in(got: np.ndarray, expect: np.ndarray) -> int:
    a = np.ascontiguousarray(got).view(np.uint8)
    b = np.ascontiguousarray(expect).view(np.uint8)
    return int(np.count_nonzero(a != b))


# ---- the worker --------------------------------------------------------------------------------------
def worker_main(row_index: int, counters, stop, seg_name: str, warm_root: str, warm_bytes: int, seed: int,
                bound_s: float, err_dir: str) -> None:
    """Run random calls until ``stop.value`` is set; count everything in ``counters`` row ``row_index``."""
    from tieredkv import TieredCache

    row = np.frombuffer(counters.get_obj(), dtype=np.int64).reshape(-1, len(FIELDS))[row_index]
    row[F["pid"]] = os.getpid()
    spec = KVSpec(**SPEC_ARGS)
    rng = np.random.default_rng(seed)
    bound_ns = int(bound_s * 1e9)
    # Half the workers write every stored block behind to warm (the default), half demote on eviction:
    # both paths run, and are killed, against the same tiers.
    cache = TieredCache(spec, hot_bytes=None, hot_name=seg_name, warm_dir=warm_root, warm_bytes=warm_bytes,
                        lock_timeout_s=bound_s, demotion="write_behind" if row_index % 2 else "on_evict")
    try:
        while not stop.value:
            tokens = make_prompt(rng, spec)
            salt = TENANTS[int(rng.integers(len(TENANTS)))]
            r = rng.random()
            row[F["op_start_ns"]] = time.monotonic_ns()
            try:
                if r < 0.55:  # lookup + load, every byte checked
                    hit = cache.lookup(tokens, salt=salt)
                    out = np.zeros((spec.num_layers, 2, spec.num_kv_heads, len(tokens), spec.head_dim),
                                   spec.numpy_dtype)
                    n = cache.load(hit, out)
                    if n:
                        expect = kv_for(spec, tokens[:n], salt)
                        row[F["wrong_bytes"]] += wrong_bytes_in(out[:, :, :, :n], expect)
                    if n > hit.tokens or n % spec.chunk_tokens:
                        row[F["wrong_bytes"]] += 1  # loaded more than the hit, or a partial block
                    row[F["lookups"]] += 1
                    row[F["loads"]] += 1
                    row[F["loaded_tokens"]] += n
                elif r < 0.9:  # store (skips what is present or being written)
                    row[F["stored_blocks"]] += cache.store(tokens, kv_for(spec, tokens, salt), salt=salt)
                    row[F["stores"]] += 1
                else:  # lookup only
                    hit = cache.lookup(tokens, salt=salt)
                    if hit.tokens >= len(tokens):
                        row[F["wrong_bytes"]] += 1  # a hit must leave one token to compute
                    row[F["lookups"]] += 1
            except Exception:  # noqa: BLE001 - counted and reported: a serving call must not raise
                row[F["errors"]] += 1
                with open(os.path.join(err_dir, f"err-{os.getpid()}.txt"), "a") as f:
                    f.write(traceback.format_exc() + "\n")
            took = time.monotonic_ns() - int(row[F["op_start_ns"]])
            row[F["op_start_ns"]] = 0
            row[F["max_op_ns"]] = max(int(row[F["max_op_ns"]]), took)
            if took > bound_ns:
                row[F["over_bound"]] += 1
            row[F["ops"]] += 1
            if cache.warm is not None:
                row[F["warm_recoveries"]] = cache.warm._counts["recoveries"]
    finally:
        cache.close()


# ---- measurements for the soak -----------------------------------------------------------------------
def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def held_bytes(seg_name: str, warm_root: str, worker_pids: set[int]) -> dict:
    """Bytes this run holds: its segment (and any temporary segment of its workers) in /dev/shm, and
    its warm tier files on disk (allocated blocks, not apparent sizes)."""
    shm = 0
    stray = 0
    for entry in os.scandir("/dev/shm"):
        name = entry.name
        if name == seg_name.lstrip("/") or seg.temp_owner(name) in worker_pids:
            try:
                shm += entry.stat().st_blocks * 512
            except FileNotFoundError:
                continue
            stray += name != seg_name.lstrip("/")
    return {"shm_bytes": shm, "stray_tmp_segments": stray, "warm_disk_bytes": disk_bytes(warm_root)}


# ---- end-of-run checks ----------------------------------------------------------------------------------
def check_hot_resident(hot) -> dict:
    """Every READY slot of the hot tier holds exactly the bytes its key implies."""
    from tieredkv.hot.segment import READY
    from tieredkv.keys import ChunkKeys

    rec = hot._slots
    ready = np.flatnonzero(rec["state"] == READY)
    keys = rec["key"][ready].copy()
    # payload_for reads only the keys; parents and tokens do not enter the bytes.
    ck = ChunkKeys(keys, np.zeros_like(keys), np.zeros((len(keys), hot.spec.chunk_tokens), np.uint32))
    expect = payload_for(ck, hot.spec.block_bytes)
    wrong = int(np.count_nonzero(hot._data[ready] != expect))
    return {"hot_resident_blocks": len(ready), "hot_resident_wrong_bytes": wrong}


def check_warm_resident(spec: KVSpec, warm_root: str) -> dict:
    """Read back every block the warm index holds (checksummed read) and compare it with its key's
    payload. Opening the tier reaps the claims of writers that were killed before committing."""
    from tieredkv.keys import ChunkKeys
    from tieredkv.warm import WarmTier
    from tieredkv.warm import index as ix

    with WarmTier(spec, warm_root) as t:
        reaped = t._counts["recoveries"]

        def records(txn):
            return [(k, v) for k, v in txn.cursor(db=t._index.blocks)]

        items = t._index.read(records)
        rec_dtype = ix.record_dtype(spec.chunk_tokens)
        wrong = unreadable = 0
        out = np.zeros((1, spec.block_bytes), np.uint8)
        for k, v in items:
            r = np.frombuffer(v, dtype=rec_dtype)
            keys = ChunkKeys(np.frombuffer(k, dtype="<u8").reshape(1, 2), r["parent"].copy(), r["tokens"].copy())
            if t.get_many(keys, out) != 1:
                unreadable += 1  # removed meanwhile or failed its checksum: counted by the tier
                continue
            wrong += int(np.count_nonzero(out[0] != payload_for(keys, spec.block_bytes)[0]))
        corrupt = t.stats().corrupt
    return {"warm_resident_blocks": len(items), "warm_resident_wrong_bytes": wrong,
            "warm_unreadable": unreadable, "warm_corrupt_found": corrupt, "warm_claims_reaped_at_end": reaped}


# ---- the run ---------------------------------------------------------------------------------------------
class _Fleet:
    """The workers of a chaos run: spawned, watched (calls past the bound, workers that exited by
    themselves), killed and respawned; each finished worker's counter row folded into ``totals``.

    Args:
        ctx: the multiprocessing context.
        workers: worker processes alive at any time.
        bound_s: a call running longer than this is a violation.
        say: progress messages.
        args_for: ``args_for(i, stop, counters, incarnation)``: the arguments of ``worker_main``.
    """

    def __init__(self, ctx, workers: int, bound_s: float, say, args_for):
        self.ctx, self.workers, self.bound_s, self.say, self.args_for = ctx, workers, bound_s, say, args_for
        self.counters = ctx.Array(ctypes.c_int64, workers * len(FIELDS), lock=True)
        self.rows = np.frombuffer(self.counters.get_obj(), dtype=np.int64).reshape(workers, len(FIELDS))
        # A plain shared byte, not an Event: Event.is_set() takes a semaphore that a worker killed inside
        # it would hold for good, and every other worker would block on it.
        self.stop_flag = ctx.RawValue(ctypes.c_int8, 0)
        self.totals = dict.fromkeys(FIELDS, 0)
        self.totals["max_op_ns"] = 0
        self.procs: list = [None] * workers
        self.kills = self.respawns = self.unexpected_exits = self.stuck = 0
        self._incarnation = 0
        self._flagged: set[tuple[int, int]] = set()

    def spawn(self, i: int) -> None:
        self._incarnation += 1
        p = self.ctx.Process(target=worker_main, name=f"chaos-worker-{i}",
                             args=self.args_for(i, self.stop_flag, self.counters, self._incarnation))
        p.start()
        self.procs[i] = p

    def harvest(self, i: int) -> None:
        """Fold a finished worker's row into the totals and clear it for its successor."""
        row, totals = self.rows[i], self.totals
        for name in FIELDS:
            if name == "max_op_ns":
                totals[name] = max(totals[name], int(row[F[name]]))
            elif name not in ("op_start_ns", "pid"):
                totals[name] += int(row[F[name]])
        if row[F["op_start_ns"]] and time.monotonic_ns() - row[F["op_start_ns"]] > self.bound_s * 1e9:
            totals["over_bound"] += 1  # killed while stuck in a call past the bound
        row[:] = 0

    def respawn(self, i: int) -> None:
        self.harvest(i)
        self.spawn(i)
        self.respawns += 1

    def watch(self) -> None:
        """A call running past the bound is a violation (possible deadlock): count it once. A worker
        that exited by itself crashed (workers only end when stopped or killed): respawn it."""
        now_ns = time.monotonic_ns()
        for i in range(self.workers):
            t0 = int(self.rows[i][F["op_start_ns"]])
            if t0 and now_ns - t0 > self.bound_s * 1e9 and (i, t0) not in self._flagged:
                self._flagged.add((i, t0))
                self.stuck += 1
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                self.unexpected_exits += 1
                self.say(f"worker {i} (pid {p.pid}) exited by itself with {p.exitcode}")
                self.respawn(i)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            self.kills += 1
        self.respawn(i)

    def pids(self) -> set[int]:
        return {p.pid for p in self.procs if p.pid}

    def stop(self) -> None:
        """Each worker finishes its call and closes its cache; one that does not is stuck."""
        self.stop_flag.value = 1
        for i, p in enumerate(self.procs):
            p.join(self.bound_s + 5)
            if p.exitcode is None:
                self.stuck += 1
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
            elif p.exitcode != 0:
                self.unexpected_exits += 1
            self.harvest(i)

    def kill_all(self) -> None:
        self.stop_flag.value = 1
        for p in self.procs:
            if p is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)


def run_chaos(seconds: float = 30.0, workers: int = 8, *, kill_every_s: float = 0.4, seed: int = 0,
              bound_s: float = 10.0, hot_slots: int = 48, warm_slots: int = 192, soak: bool | None = None,
              sample_every_s: float = 2.0, workdir: str | None = None, log=None) -> dict:
    """Run the chaos workload and return the report (see the module docstring).

    Args:
        seconds: how long the workers run under the killer.
        workers: worker processes alive at any time.
        kill_every_s: mean time between SIGKILLs (exponentially distributed moments).
        bound_s: a call slower than this counts as a violation (a deadlock would exceed it).
        hot_slots, warm_slots: tier sizes; small, so eviction, demotion and promotion run constantly.
        soak: also require flat RSS and held bytes (default: ``seconds >= 300``).
        workdir: where the warm tier goes (a fresh directory under it; removed afterwards).

    Returns:
        The report dict; ``report["violations"]`` lists every failed check (empty: all good).
    """
    from tieredkv import TieredCache, policies
    from tieredkv.warm import admin

    soak = seconds >= 300 if soak is None else soak
    say = log or (lambda msg: None)
    spec = KVSpec(**SPEC_ARGS)
    rng = np.random.default_rng(seed)
    run_id = f"{os.getpid()}-{secrets.token_hex(3)}"
    seg_name = f"/tieredkv-chaos-{run_id}"
    base = tempfile.mkdtemp(prefix=f"rel_chaos_{run_id}_", dir=workdir)
    warm_root = os.path.join(base, "warm")
    err_dir = os.path.join(base, "errors")
    os.makedirs(err_dir)
    engine = policies.make("lru")
    state_bytes = policies.StateLayout.for_policy(engine, hot_slots).nbytes
    hot_bytes = seg.Layout.compute(spec, hot_slots, state_bytes).total_bytes
    warm_bytes = warm_slots * 4096

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "lmdb", "posix_ipc", "tieredkv.cache", "tieredkv.warm"])
    report: dict = {"seconds": seconds, "workers": workers, "kill_every_s": kill_every_s, "seed": seed,
                    "bound_s": bound_s, "hot_slots": hot_slots, "warm_slots": warm_slots, "soak": soak,
                    "segment": seg_name, "warm_dir": warm_root}
    samples: list[dict] = []
    fleet = _Fleet(ctx, workers, bound_s, say,
                   lambda i, stop, counters, incarnation: (i, counters, stop, seg_name, warm_root, warm_bytes,
                                                           seed * 1_000_003 + incarnation, bound_s, err_dir))
    totals = fleet.totals

    parent = TieredCache(spec, hot_bytes=hot_bytes, hot_name=seg_name, warm_dir=warm_root, warm_bytes=warm_bytes)
    started = time.monotonic()
    try:
        for i in range(workers):
            fleet.spawn(i)
        deadline = started + seconds
        next_kill = started + float(rng.exponential(kill_every_s))
        next_sample = started
        while (now := time.monotonic()) < deadline:
            fleet.watch()
            if now >= next_kill:
                fleet.kill(int(rng.integers(workers)))
                next_kill = now + float(rng.exponential(kill_every_s))
            if now >= next_sample:
                pids = fleet.pids()
                rss = [r for r in (rss_bytes(pid) for pid in pids) if r]
                samples.append({"t": round(now - started, 2), "rss_max": max(rss, default=0),
                                "rss_median": int(np.median(rss)) if rss else 0,
                                **held_bytes(seg_name, warm_root, pids)})
                next_sample = now + sample_every_s
            time.sleep(0.005)
        fleet.stop()
        elapsed = time.monotonic() - started

        # ---- checks ----
        hot = parent.hot
        hot_stats = hot.stats()
        census_before = hot.slot_census()
        recovered = hot.recover()
        census = hot.slot_census()
        resident = check_hot_resident(hot)
        cache_counters = parent.stats()
        parent.close()
        warm_check = check_warm_resident(spec, warm_root)
        verify = admin.verify(os.path.join(warm_root, spec.namespace))
        pids_end: set[int] = set()
        final_held = held_bytes(seg_name, warm_root, pids_end)
    finally:
        fleet.kill_all()
        parent.close()

    errors_text = []
    for fn in sorted(os.listdir(err_dir)):
        with open(os.path.join(err_dir, fn)) as f:
            errors_text.append(f.read())
    totals["over_bound"] += fleet.stuck
    recoveries = {"hot_scrubs": int(hot_stats.extra["scrubs"]) + 0,
                  "hot_reclaimed_slots": int(hot_stats.extra["reclaimed"]) + recovered["reclaimed_slots"],
                  "warm_claims_reaped": totals["warm_recoveries"] + warm_check["warm_claims_reaped_at_end"]}
    report.update({
        "elapsed_s": round(elapsed, 1),
        "operations": totals["ops"], "lookups": totals["lookups"], "loads": totals["loads"],
        "stores": totals["stores"], "loaded_tokens": totals["loaded_tokens"],
        "stored_blocks": totals["stored_blocks"],
        "kills": fleet.kills, "respawns": fleet.respawns, "unexpected_exits": fleet.unexpected_exits,
        "recoveries": sum(recoveries.values()), "recovery_detail": recoveries,
        "wrong_bytes": totals["wrong_bytes"] + resident["hot_resident_wrong_bytes"]
        + warm_check["warm_resident_wrong_bytes"],
        "wrong_bytes_loaded": totals["wrong_bytes"],
        "over_bound": totals["over_bound"], "max_op_ms": round(totals["max_op_ns"] / 1e6, 1),
        "errors": totals["errors"], "error_samples": errors_text[:3],
        "hot_census_before_recover": census_before, "hot_census": census,
        "hot_accounting_ok": (census["free"] + census["ready"] + census["writing_live"] == census["capacity"]
                              and census["writing_dead"] == 0 and census["pinned"] == 0
                              and sum(census_before[k] for k in ("free", "ready", "writing_live", "writing_dead"))
                              == census_before["capacity"]),
        **resident, **warm_check,
        "warm_verify_ok": bool(verify["ok"]), "warm_verify": {k: verify[k] for k in
                                                               ("blocks_checked", "blocks_ok", "dead_claims", "meta")},
        "warm_verify_bad_blocks": len(verify["bad_blocks"]),
        "cache_counters": {k: cache_counters[k] for k in ("lookups", "hit_tokens", "hot_hit_tokens",
                                                          "warm_hit_tokens", "promotions", "demotions",
                                                          "lost_blocks", "warm_errors")},
        "hot_evictions": hot_stats.evictions, "hot_torn_reads": int(hot_stats.extra["torn_reads"]),
        "samples": samples, "final_held": final_held,
    })
    violations = []
    if report["wrong_bytes"]:
        violations.append(f"{report['wrong_bytes']} wrong bytes")
    if report["over_bound"]:
        violations.append(f"{report['over_bound']} calls over the {bound_s} s bound")
    if report["errors"]:
        violations.append(f"{report['errors']} calls raised")
    if fleet.unexpected_exits:
        violations.append(f"{fleet.unexpected_exits} workers exited by themselves")
    if not report["hot_accounting_ok"]:
        violations.append(f"hot slot accounting broken: {census_before} -> {census}")
    if not report["warm_verify_ok"] or warm_check["warm_unreadable"]:
        violations.append(f"warm verify: {report['warm_verify']}, unreadable {warm_check['warm_unreadable']}")
    if final_held["stray_tmp_segments"]:
        violations.append(f"{final_held['stray_tmp_segments']} temporary segments left in /dev/shm")
    if report["operations"] == 0:
        violations.append("no operation completed")
    if soak:
        violations += _flatness(samples)
    report["violations"] = violations
    report["ok"] = not violations
    try:
        import posix_ipc

        posix_ipc.unlink_shared_memory(seg_name)
    except Exception:  # noqa: BLE001 - already gone
        pass
    shutil.rmtree(base, ignore_errors=True)
    return report


def _flatness(samples: list[dict]) -> list[str]:
    """Compare the first and the last fifth of the samples: RSS and held bytes must not grow."""
    if len(samples) < 10:
        return [f"only {len(samples)} samples: run longer to judge flatness"]
    k = max(2, len(samples) // 5)
    first, last = samples[1:k + 1], samples[-k:]  # skip t=0 (workers still starting)
    out = []
    rss0, rss1 = max(s["rss_max"] for s in first), max(s["rss_max"] for s in last)
    if rss1 > rss0 * 1.25 + (16 << 20):
        out.append(f"worker RSS grew: {rss0 >> 20} MiB -> {rss1 >> 20} MiB")
    for key, slack in (("shm_bytes", 0), ("warm_disk_bytes", 4 << 20)):
        a, b = max(s[key] for s in first), max(s[key] for s in last)
        if b > a + slack:
            out.append(f"{key} grew: {a} -> {b}")
    return out


def summary(r: dict) -> str:
    c = r["hot_census"]
    lines = [
        f"chaos: {r['workers']} workers, {r['elapsed_s']} s, kill every ~{r['kill_every_s']} s, seed {r['seed']}",
        f"  operations        {r['operations']}  (lookups {r['lookups']}, loads {r['loads']}, stores {r['stores']}; "
        f"loaded tokens {r['loaded_tokens']}, stored blocks {r['stored_blocks']})",
        f"  kills             {r['kills']}  (respawns {r['respawns']}, exits by themselves {r['unexpected_exits']})",
        f"  recoveries        {r['recoveries']}  {r['recovery_detail']}",
        f"  wrong bytes       {r['wrong_bytes']}  (loaded {r['wrong_bytes_loaded']}, resident hot "
        f"{r['hot_resident_wrong_bytes']} of {r['hot_resident_blocks']} blocks, resident warm "
        f"{r['warm_resident_wrong_bytes']} of {r['warm_resident_blocks']} blocks)",
        f"  over {r['bound_s']} s bound   {r['over_bound']}  (slowest call {r['max_op_ms']} ms)",
        f"  errors            {r['errors']}",
        f"  hot slots         free {c['free']} + ready {c['ready']} + writing(live) {c['writing_live']} = "
        f"{c['free'] + c['ready'] + c['writing_live']} of {c['capacity']} (dead writers {c['writing_dead']}, "
        f"pinned {c['pinned']}); before recover: {r['hot_census_before_recover']}",
        f"  warm verify       {'clean' if r['warm_verify_ok'] else 'NOT CLEAN'} {r['warm_verify']}",
        f"  traffic           {r['cache_counters']}, hot evictions {r['hot_evictions']}",
    ]
    if r["soak"] and r["samples"]:
        s0, s1 = r["samples"][1 if len(r["samples"]) > 1 else 0], r["samples"][-1]
        lines.append(f"  soak              worker RSS max {s0['rss_max'] >> 20} -> {s1['rss_max'] >> 20} MiB, "
                     f"shm {s0['shm_bytes']} -> {s1['shm_bytes']} B, warm disk {s0['warm_disk_bytes']} -> "
                     f"{s1['warm_disk_bytes']} B")
    lines.append("  result            " + ("OK" if r["ok"] else "VIOLATIONS: " + "; ".join(r["violations"])))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=0.4, help="mean seconds between SIGKILLs")
    ap.add_argument("--bound", type=float, default=10.0, help="seconds a call may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hot-slots", type=int, default=48)
    ap.add_argument("--warm-slots", type=int, default=192)
    ap.add_argument("--soak", action="store_true", help="check RSS/held bytes flatness (default: seconds >= 300)")
    ap.add_argument("--dir", default=None, help="parent directory of the run's warm tier")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    report = run_chaos(args.seconds, args.workers, kill_every_s=args.kill_every, seed=args.seed,
                       bound_s=args.bound, hot_slots=args.hot_slots, warm_slots=args.warm_slots,
                       soak=True if args.soak else None, workdir=args.dir,
                       log=lambda m: print(m, file=sys.stderr))
    print(summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
