"""The vLLM connector's loads, layer by layer, beside the forward (torch and numpy only: no vLLM import).

A load has two copies: the tier copy (``TieredCache.load``: the hit's blocks, each holding every layer
of one chunk, into a staging buffer ``(layers, 2, kv_heads, tokens, head_dim)``) and the paged copy
(``PagedKV.write``: one layer at a time into the request's vLLM blocks). Attention layer ``l`` needs
layer ``l`` of every block, and a tieredkv block holds all layers, so the tier copy of the whole hit
comes first; the paged copies then run in model order, and the forward's layer ``l`` waits only for
its own::

    loader thread   |tier copy, all plans|paged l0|paged l1|paged l2| ... |paged lL-1|
    forward                      (embed) |wait l0 |attn l0 |wait l1 |attn l1| ...
                                         ^ the first layer waits for the tier copy + its paged copy

On the CPU a step with one plan whose blocks are all in the top level (a hot-tier hit, the common case)
skips the staging buffer: the loader thread reads the hit as runs of the hot tier's own memory, pinned
(``TieredCache.load_runs``), and writes each layer from there into the pages (``paged.Chunks``), one
copy instead of two. When the hit is one run of slots (a prefix stored in one call), each layer is
released as soon as it is written, so the forward's layer 0 waits only for its own layer::

    loader thread   |pin|l0|l1|l2| ... |lL-1|unpin|
    forward             |wait l0|attn l0|wait l1|attn l1| ...

A hit in several runs is written run by run and released whole at the end. Other steps (several plans,
a lower level's blocks, a hybrid model's state, a CUDA cache) take the path above.

``mode="layer"`` runs a step's loads on one background thread: ``start`` returns at once,
``wait_layer(l)`` blocks until layer ``l`` of every planned block is written (or known failed), and
``finish`` waits for all of it and returns the blocks that could not be filled. On the CPU this
overlaps because both copies are numpy copies, which release the GIL (benchmarks/vllm_ttft.py
measures how far the forward's Python thread keeps running during them). ``mode="sync"`` runs the same
job inside ``start``. Both give the same pages and the same failed blocks.

On a CUDA device the staging buffer lives on the device: ``TieredCache.load`` DMAs the hot segment's
rows straight into it (``tieredkv.cuda.DeviceRestore``: no CPU copy into pinned host memory), and the
paged copies are device-to-device. The job runs on a stream of its own; each layer records an event
that ``wait_layer`` makes the caller's stream wait for, and ``finish`` makes the caller's stream wait
for the whole job (the caller's later reads of the pages, saves included, are ordered after it).

A failure never raises into the engine: blocks a tier copy did not fill (evicted since the lookup,
damaged, an I/O error), and every block of a plan whose paged copy raised, are reported by
``finish``; the layers are still released in order, so a forward never hangs on a failed load.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tieredkv.integrations.paged import Chunks, PagedKV

logger = logging.getLogger(__name__)

#: How loads run: ``layer`` (a background thread, the forward waits per layer) or ``sync`` (all of a
#: step's loads finish in ``start_load_kv``, before the forward).
LOAD_MODES = ("layer", "sync")

#: The block id vLLM hands for positions a group does not keep (outside a sliding window).
NULL_BLOCK = 0


def leading_nulls(ids: Sequence[int]) -> int:
    """How many of ``ids`` lead with the null block (a sliding window's dropped blocks lead)."""
    n = 0
    while n < len(ids) and ids[n] == NULL_BLOCK:
        n += 1
    return n


@dataclasses.dataclass
class _Job:
    """One step's loads: the plans, how far each one's tier copy got, and how many layers are written."""

    plans: list[Any]
    done: list[int]  # per plan: leading vLLM blocks the tier copy filled
    layers_ready: int = 0
    finished: bool = False
    errors: set[int] = dataclasses.field(default_factory=set)
    failed: set[str] = dataclasses.field(default_factory=set)  # requests with a block left unfilled
    events: list[Any] = dataclasses.field(default_factory=list)  # CUDA: one per layer written


class LayerLoader:
    """Restores a step's load plans into the paged cache, layer by layer (see the module docstring).

    A plan (the connector's ``LoadPlan``) has ``req_id``, ``hit`` (a ``PrefixHit`` that
    ``TieredCache.load`` restores from token 0), ``skip_tokens`` (leading tokens of the hit already in
    vLLM's cache, not copied) and ``block_ids`` (per KV cache group, the vLLM blocks receiving the hit's
    tokens from ``skip_tokens`` on; ``NULL_BLOCK`` where a sliding group keeps nothing).

    Args:
        cache: the worker's ``TieredCache``.
        paged: the engine's paged cache.
        group_of_layer: for each layer index (model order), the index of its KV cache group in a plan's
            ``block_ids``.
        layer_index: layer name -> layer index (the names vLLM passes to ``wait_for_layer_load``).
        mode: one of ``LOAD_MODES``. A loader built for ``layer`` may be set to ``sync`` (``loader.mode``)
            between steps; a ``sync`` loader has no thread.
        after_copy: called as ``after_copy(plan, loaded_tokens)`` after each plan's tier copy (on the
            loader's thread); False fails the plan (every block recomputed). A hybrid model restores
            its recurrent state there.
    """

    def __init__(self, cache: Any, paged: PagedKV, group_of_layer: Sequence[int], layer_index: dict[str, int],
                 mode: str = "layer", *, after_copy: Callable[[Any, int], bool] | None = None):
        if mode not in LOAD_MODES:
            raise ValueError(f"load mode {mode!r}: choose one of {LOAD_MODES}")
        self.cache = cache
        self.paged = paged
        self.mode = mode
        self._after_copy = after_copy
        self._group_of_layer = list(group_of_layer)
        self._layer_index = dict(layer_index)
        self._cuda = paged.device.type == "cuda"
        self._stream = torch.cuda.Stream(paged.device) if self._cuda else None
        self._buffer: torch.Tensor | None = None  # staging for the tier copies, grown, never shrunk
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_errors: set[int] = set()  # failed blocks of a job ``start`` had to finish early
        self._failed: set[str] = set()  # requests of finished jobs with a block left unfilled (take_failed)
        self._thread: threading.Thread | None = None
        if mode == "layer":
            self._thread = threading.Thread(target=self._serve, name="tieredkv-loads", daemon=True)
            self._thread.start()

    # ---- the forward's side ------------------------------------------------------------------------
    def start(self, plans: Sequence[Any]) -> None:
        """Begin this step's loads (in ``sync`` mode: do them). A job still running is finished first."""
        if self._job is not None:
            self._pending_errors = self.finish()  # a step whose wait_for_save never ran
        if not plans:
            return
        job = _Job(plans=list(plans), done=[0] * len(plans))
        if self._cuda:  # the pages may still be in use by work queued before this step: order after it
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.paged.device))
        with self._cond:
            self._job = job
        if self.mode == "sync" or self._thread is None or not self._thread.is_alive():
            self._run(job)  # (no thread after a fork: the loads are done here, as in sync mode)
        else:
            self._jobs.put(job)

    def wait_layer(self, layer_name: str) -> None:
        """Block until layer ``layer_name`` of every planned block is written or known failed (a name
        this loader does not restore, or a step without loads, returns at once)."""
        job = self._job
        index = self._layer_index.get(layer_name)
        if job is None or index is None:
            return
        with self._cond:
            self._cond.wait_for(lambda: job.layers_ready > index or job.finished)
        if self._cuda and index < len(job.events):
            torch.cuda.current_stream(self.paged.device).wait_event(job.events[index])

    def finish(self) -> set[int]:
        """Wait for the step's loads to end; return the vLLM block ids they could not fill (and those
        of a job ``start`` finished early). Idempotent: a second call returns an empty set."""
        errors, self._pending_errors = self._pending_errors, set()
        job = self._job
        if job is None:
            return errors
        with self._cond:
            self._cond.wait_for(lambda: job.finished)
            self._job = None
        if self._cuda:
            assert self._stream is not None
            torch.cuda.current_stream(self.paged.device).wait_stream(self._stream)
        self._failed |= job.failed
        return errors | job.errors

    def take_failed(self) -> set[str]:
        """The requests of the jobs finished since the last call that have a block left unfilled (their
        blocks are also in what ``finish`` returned)."""
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        """Finish any running job and stop the thread (idempotent)."""
        self.finish()
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    # ---- the loader thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(job)

    def _run(self, job: _Job) -> None:
        try:
            if self._cuda:  # the thread's device and stream are its own (both are per thread)
                with torch.cuda.device(self.paged.device), torch.cuda.stream(self._stream):
                    self._copy(job)
            else:
                self._copy(job)
        except Exception:  # every block becomes a recompute (and `finally` never leaves the forward waiting)
            logger.exception("tieredkv: loads failed; vLLM recomputes their blocks")
            job.done = [0] * len(job.plans)
        finally:
            for plan, done in zip(job.plans, job.done):
                unfilled = {b for ids in plan.block_ids for b in ids[done:] if b != NULL_BLOCK}
                job.errors |= unfilled
                if unfilled:
                    job.failed.add(plan.req_id)
            self._release(job, len(self._group_of_layer), finished=True)

    def _release(self, job: _Job, layers: int, finished: bool = False) -> None:
        """Let the forward past the first ``layers`` layers (never fewer than already released)."""
        with self._cond:
            job.layers_ready = max(job.layers_ready, layers)
            job.finished = job.finished or finished
            self._cond.notify_all()

    def _copy(self, job: _Job) -> None:
        if self._copy_direct(job):
            return
        N = self.paged.block_size
        staged = self._stage(job)
        for i, (plan, host) in enumerate(zip(job.plans, staged)):  # the tier copies
            try:
                loaded = self.cache.load(plan.hit, _cache_out(host, self.cache.spec.dtype))
                done = max(loaded - plan.skip_tokens, 0) // N
                if self._after_copy is not None and not self._after_copy(plan, loaded):
                    done = 0
                job.done[i] = done  # (set last: a raise above leaves the plan at 0, all recomputed)
            except Exception:  # this plan is recomputed; the others still load
                logger.exception("tieredkv: load for request %s failed; vLLM recomputes it", plan.req_id)
        for layer, group in enumerate(self._group_of_layer):  # the paged copies, in the forward's order
            for i, (plan, host) in enumerate(zip(job.plans, staged)):
                ids = plan.block_ids[group][:job.done[i]]
                skip = leading_nulls(ids)
                try:
                    self.paged.write(ids[skip:], host, plan.skip_tokens + skip * N, layers=(layer,))
                except Exception:
                    logger.exception("tieredkv: load for request %s failed; vLLM recomputes it", plan.req_id)
                    job.done[i] = 0
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
                job.events.append(event)
            self._release(job, layer + 1)

    def _copy_direct(self, job: _Job) -> bool:
        """The step's one plan straight from the top level's memory into the pages (the module
        docstring); False, with nothing done, where that path does not apply."""
        paged, cache = self.paged, self.cache
        if self._cuda or len(job.plans) != 1 or self._after_copy is not None or not hasattr(cache, "load_runs"):
            return False
        plan, N, C = job.plans[0], paged.block_size, cache.spec.chunk_tokens
        if C % N or plan.skip_tokens % N or paged.chunk_bytes(C) != cache.spec.block_bytes \
                or not _same_dtype(paged.dtype, cache.spec.dtype):
            return False
        whole, calls = plan.hit.blocks, [0]

        def write(first_token: int, rows: Any) -> None:
            calls[0] += 1
            # The whole hit in one run, on the first call: each layer is done once written. (A tier that
            # retries a read after damage calls again; what it wrote first stays released.)
            early = calls[0] == 1 and first_token == 0 and len(rows) == whole
            chunks = Chunks(rows, first_token, C)
            end = first_token + len(rows) * C
            for layer, group in enumerate(self._group_of_layer):
                ids = plan.block_ids[group]
                a = max(first_token - plan.skip_tokens, 0) // N
                part = ids[a:max(end - plan.skip_tokens, 0) // N]
                skip = leading_nulls(part)
                paged.write(part[skip:], chunks, plan.skip_tokens + (a + skip) * N, layers=(layer,))
                if early:
                    self._release(job, layer + 1)

        try:
            loaded = cache.load_runs(plan.hit, write)
        except Exception:  # this plan is recomputed (``_run`` reports its blocks, releases every layer)
            logger.exception("tieredkv: load for request %s failed; vLLM recomputes it", plan.req_id)
            return True
        if loaded is None:
            return False
        job.done[0] = max(loaded - plan.skip_tokens, 0) // N
        return True

    def _stage(self, job: _Job) -> list[torch.Tensor]:
        """One contiguous ``(layers, 2, kv_heads, hit tokens, head_dim)`` view per plan, all in one kept
        buffer (pinned host memory is not needed: on CUDA it is device memory, filled by DMA)."""
        paged = self.paged
        per_token = len(self._group_of_layer) * 2 * paged.kv_heads * paged.head_dim
        sizes = [plan.hit.tokens * per_token for plan in job.plans]
        need = max(sum(sizes), 1)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None  # drop the old one before allocating the larger one
            self._buffer = torch.empty(need, dtype=paged.dtype, device=paged.device)
        out, at = [], 0
        for plan, size in zip(job.plans, sizes):
            out.append(self._buffer[at:at + size].view(len(self._group_of_layer), 2, paged.kv_heads,
                                                       plan.hit.tokens, paged.head_dim))
            at += size
        return out


def _same_dtype(pages: torch.dtype, spec_dtype: str) -> bool:
    """Whether pages of ``pages`` hold values of the spec's dtype (fp8 pages are registered as uint8)."""
    if pages == torch.uint8:
        return spec_dtype in ("float8_e4m3fn", "float8_e5m2")
    return str(pages).removeprefix("torch.") == spec_dtype


def _cache_out(buf: torch.Tensor, dtype: str) -> Any:
    """The staging view ``TieredCache.load`` takes: fp8 pages travel as uint8 (the connector's
    ``register_kv_caches``); on the CPU they go as numpy bytes, on a device as the spec's fp8 dtype."""
    if buf.dtype != torch.uint8:
        return buf
    return buf.numpy() if buf.device.type == "cpu" else buf.view(getattr(torch, dtype))
