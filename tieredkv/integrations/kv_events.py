"""KV events for routers: tieredkv's tiers announced in vLLM's own event types and wire format.

KV-aware routers (llm-d's precise prefix scorer, NVIDIA Dynamo, AIBrix) route a request to the engine
that holds its prefix, from the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events vLLM
publishes over ZMQ. Blocks in tieredkv's tiers are as local to every engine of the host as its own CPU
cache, so they are announced too::

    engine A worker ── cache.store ──► journal: STORED(hot, key)          (tieredkv.journal, per host)
    engine A scheduler ── NOTED(key -> vLLM hashes, tokens, parent) ──►    journal
    any reader ── Announcer ──► BlockStored(hashes, medium=CPU, locality=LOCAL, ownership=tieredkv-hot)
                                 BlockRemoved(...) when a tier evicts a block this reader announced
                                 AllBlocksCleared when a tier is cleared

Readers: ``ConnectorEvents`` (``TieredKVConnector.take_events``: vLLM's scheduler publishes them with
its own events), ``TierEvents`` (``TieredKVTier.take_events``: ``OffloadingEvent`` for vLLM's offloading
connector), and ``Exporter`` (``python -m tieredkv.integrations.kv_events``: a process of its own that
publishes the host's journal on vLLM's ZMQ/msgpack wire format). Media: hot is ``CPU``, warm is
``STORAGE`` (vLLM's medium for disk; there is no ``DISK`` constant in vLLM 0.32), the remote tier is
``STORAGE`` with ``locality="REMOTE"``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingEvent,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)

from tieredkv import journal as jr
from tieredkv.cache import HOT, REMOTE, WARM, TieredCache

logger = logging.getLogger(__name__)

#: Per tier: vLLM's medium string, its ``Medium``, the locality relative to the host, and ``ownership``.
MEDIUM = {HOT: MEDIUM_CPU, WARM: MEDIUM_STORAGE, REMOTE: MEDIUM_STORAGE}
OFFLOAD_MEDIUM = {HOT: Medium.CPU, WARM: Medium.STORAGE, REMOTE: Medium.STORAGE}
LOCALITY = {HOT: Locality.LOCAL, WARM: Locality.LOCAL, REMOTE: Locality.REMOTE}
OWNERSHIP = {HOT: "tieredkv-hot", WARM: "tieredkv-warm", REMOTE: "tieredkv-remote"}

#: Note kinds (first byte): a connector's chunk description (a msgpack'ed ``BlockStored``), or a
#: vLLM ``OffloadKey`` (``TieredKVTier``'s blocks).
_STORED_NOTE, _OFFLOAD_NOTE = b"S", b"K"
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(BlockStored)


# ---- notes: what a journal reader needs to describe a block ---------------------------------------------
def chunk_notes(request: Any, n_chunks: int, chunk_tokens: int, block_size: int,
                generation: bytes = b"") -> list[bytes]:
    """One note per full chunk of ``request``'s prompt: the chunk's vLLM block hashes, its parent hash,
    tokens, LoRA and per-block extra keys (the fields vLLM's own ``BlockStored`` carries), tagged with
    the engine's key generation (empty until a ``reset_cache``)."""
    hashes = list(getattr(request, "block_hashes", None) or [])
    per = chunk_tokens // block_size
    n_chunks = min(n_chunks, len(hashes) // per)
    tokens = list(request.prompt_token_ids or [])
    lora = getattr(request, "lora_request", None)
    notes = []
    mm_idx = 0
    for i in range(n_chunks):
        extra = []
        for b in range(i * per, (i + 1) * per):
            keys, mm_idx = generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, mm_idx)
            extra.append(keys)
        event = BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[i * per:(i + 1) * per]],
            parent_block_hash=maybe_convert_block_hash(hashes[i * per - 1]) if i else None,
            token_ids=tokens[i * chunk_tokens:(i + 1) * chunk_tokens], block_size=block_size,
            lora_id=lora.adapter_id if lora is not None else None, medium=None,
            lora_name=lora.name if lora is not None else None, extra_keys=to_event_extra_keys(extra), group_idx=0)
        notes.append(_STORED_NOTE + bytes([len(generation)]) + generation + _ENCODER.encode(event))
    return notes


def offload_note(key: bytes) -> bytes:
    """The note of a ``TieredKVTier`` block: vLLM's ``OffloadKey`` itself."""
    return _OFFLOAD_NOTE + bytes(key)


def note_generation(note: bytes) -> bytes | None:
    """The key generation a connector's note was written under (None: not a connector's note)."""
    return note[2:2 + note[1]] if note[:1] == _STORED_NOTE and len(note) > 1 else None


def _stored(note: bytes) -> BlockStored | None:
    kind, body = note[:1], note[1:]
    if kind == _STORED_NOTE:
        return _DECODER.decode(body[1 + body[0]:])
    if kind == _OFFLOAD_NOTE:  # what vLLM's offloading connector announces for a key it cannot describe
        key = OffloadKey(body)
        return BlockStored(block_hashes=[maybe_convert_block_hash(BlockHash(get_offload_block_hash(key)))],
                           parent_block_hash=None, token_ids=[], block_size=0, lora_id=None, medium=None,
                           lora_name=None, group_idx=get_offload_group_idx(key))
    return None


# ---- the announcer: journal records -> announcements, once per (block, tier) ------------------------------
Announcement = tuple[str, int, bytes]  # ("stored" | "removed" | "cleared", tier, note)


class Announcer:
    """Turns journal records (and blocks a reader found itself) into announcements.

    A block is announced stored once per tier until that tier evicts it; a removal is announced only
    for a block this announcer announced. Stores whose note has not been seen yet wait for it (the
    worker's ``STORED`` and the scheduler's ``NOTED`` come from different processes, in either order).
    Memory is bounded: at most ``max_blocks`` notes, announced blocks and waiting stores each (the
    oldest are forgotten first). An announced block keeps its own note, so its removal can always be
    described; an announced block forgotten to make room is announced removed then (a router that
    skips a block still held loses a hit; one told of a block that is gone routes to a miss).
    """

    def __init__(self, max_blocks: int = 1 << 20, generation: bytes | None = None):
        self.max_blocks = max_blocks
        #: Only connector notes of this key generation are used (None: every note, as the exporter does).
        self.generation = generation
        self._notes: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        #: key -> (tier bits, the note it was announced with)
        self._announced: collections.OrderedDict[bytes, tuple[int, bytes]] = collections.OrderedDict()
        self._waiting: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    @staticmethod
    def _bounded(d: collections.OrderedDict, key: bytes, value, limit: int) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > limit:
            d.popitem(last=False)

    def _store(self, key: bytes, tier: int, out: list[Announcement]) -> None:
        bits, _ = self._announced.get(key, (0, b""))
        if bits & (1 << tier):
            return
        note = self._notes.get(key)
        if note is None:
            self._bounded(self._waiting, key, self._waiting.get(key, 0) | (1 << tier), self.max_blocks)
            return
        self._announced[key] = (bits | (1 << tier), note)
        self._announced.move_to_end(key)
        out.append(("stored", tier, note))
        while len(self._announced) > self.max_blocks:  # forgotten: the router must not count on it
            _, (gone, gone_note) = self._announced.popitem(last=False)
            out.extend(("removed", t, gone_note) for t in (HOT, WARM, REMOTE) if gone & (1 << t))

    def feed(self, records: Iterable[jr.Record]) -> list[Announcement]:
        """Announcements for journal records, in order."""
        out: list[Announcement] = []
        for rec in records:
            if rec.op == jr.CLEARED:
                out.extend(self.cleared())
                continue
            for i, key in enumerate(rec.key_bytes()):
                if rec.op == jr.NOTED:
                    gen = note_generation(rec.notes[i])
                    if self.generation is not None and gen is not None and gen != self.generation:
                        continue  # keys of another generation: this reader's requests never match them
                    self._bounded(self._notes, key, rec.notes[i], self.max_blocks)
                    bits = self._waiting.pop(key, 0)
                    for tier in (HOT, WARM, REMOTE):
                        if bits & (1 << tier):
                            self._store(key, tier, out)
                elif rec.op == jr.STORED:
                    self._store(key, rec.tier, out)
                elif rec.op == jr.EVICTED:
                    waiting = self._waiting.get(key, 0) & ~(1 << rec.tier)  # the other tiers' copies wait on
                    if waiting:
                        self._waiting[key] = waiting
                    else:
                        self._waiting.pop(key, None)
                    bits, note = self._announced.get(key, (0, b""))
                    if bits & (1 << rec.tier):
                        if bits == 1 << rec.tier:
                            del self._announced[key]
                        else:
                            self._announced[key] = (bits & ~(1 << rec.tier), note)
                        out.append(("removed", rec.tier, note))
        return out

    def knows(self, key: bytes) -> bool:
        """Whether a description of ``key`` (of this announcer's generation) has been read."""
        return key in self._notes

    def found(self, keys: Sequence[bytes], tiers: Sequence[int], notes: Sequence[bytes]) -> list[Announcement]:
        """Announcements for blocks a reader found in its tiers itself (a lookup hit)."""
        out: list[Announcement] = []
        for key, tier, note in zip(keys, tiers, notes):
            self._bounded(self._notes, key, note, self.max_blocks)
            self._store(key, int(tier), out)
        return out

    def cleared(self) -> list[Announcement]:
        """Forget every announced block: one ``("cleared", -1, b"")`` if any was announced."""
        had = bool(self._announced)
        self._announced.clear()
        self._waiting.clear()
        return [("cleared", -1, b"")] if had else []

    def regenerate(self, generation: bytes) -> list[Announcement]:
        """The reader's keys changed (a ``reset_cache``): nothing announced or described so far can
        serve it any more."""
        self.generation = generation
        self._notes.clear()
        return self.cleared()


def to_kv_events(announcements: Iterable[Announcement]) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """vLLM KV events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) for announcements."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for op, tier, note in announcements:
        if op == "cleared":
            events.append(AllBlocksCleared())
            continue
        stored = _stored(note)
        if stored is None:
            continue
        medium, locality, owner = MEDIUM[tier], LOCALITY[tier].value, OWNERSHIP[tier]
        if op == "stored":
            events.append(msgspec.structs.replace(stored, medium=medium, locality=locality, ownership=owner))
        else:
            events.append(BlockRemoved(block_hashes=stored.block_hashes, medium=medium, group_idx=stored.group_idx,
                                       locality=locality, ownership=owner))
    return events


def to_offloading_events(announcements: Iterable[Announcement]) -> list[OffloadingEvent]:
    """vLLM ``OffloadingEvent`` for announcements of ``TieredKVTier`` blocks (``OffloadKey`` notes)."""
    events: list[OffloadingEvent] = []
    for op, tier, note in announcements:
        if op == "cleared" or note[:1] != _OFFLOAD_NOTE:
            continue
        events.append(OffloadingEvent(keys=[OffloadKey(note[1:])], medium=OFFLOAD_MEDIUM[tier], removed=op == "removed",
                                      locality=LOCALITY[tier], ownership=OWNERSHIP[tier]))
    return events


# ---- readers ------------------------------------------------------------------------------------------------
def poll(reader: jr.JournalReader, announcer: Announcer) -> list[Announcement]:
    """Announcements for the records ``reader`` gained since its last poll. Whole journal files it never
    saw (rotated away between two polls) may have held evictions the router can no longer be told of
    one by one: everything announced so far is announced cleared first."""
    lost = reader.lost_files
    records = reader.poll()
    out = announcer.cleared() if reader.lost_files > lost else []
    if out:
        logger.warning("tieredkv: %d journal file(s) rotated away unread; announced blocks cleared",
                       reader.lost_files - lost)
    return out + announcer.feed(records)


class _JournalEvents:
    """A journal reader and an announcer over a cache with an attached journal."""

    def __init__(self, cache: TieredCache, generation: bytes | None = None):
        journal = cache.journal
        if journal is None:
            raise ValueError("the cache has no journal (open it with journal=True)")
        self.cache = cache
        self.journal = journal
        self.reader = jr.JournalReader(journal.path)
        self.announcer = Announcer(generation=generation)
        self._local: list[Announcement] = []
        self._lock = threading.Lock()

    def _take(self) -> list[Announcement]:
        with self._lock:
            local, self._local = self._local, []
            return local + poll(self.reader, self.announcer)

    def close(self) -> None:
        """Close the journal reader (the journal itself belongs to the cache)."""
        self.reader.close()


class ConnectorEvents(_JournalEvents):
    """``TieredKVConnector``'s events (scheduler side): the host journal plus this engine's lookup hits."""

    def __init__(self, cache: TieredCache, block_size: int):
        super().__init__(cache, generation=b"")
        self.block_size = block_size

    def note_request(self, request: Any, keys: Any, where: Sequence[int] = ()) -> None:
        """Describe the full chunks of ``request`` (their ``keys``) in the journal, so whichever process
        stores them, every reader can announce them with vLLM's hashes; announce the ``where[i]`` tier
        of the leading chunks this engine found in the tiers."""
        notes = chunk_notes(request, len(keys), self.cache.spec.chunk_tokens, self.block_size,
                            self.announcer.generation or b"")
        if not notes:
            return
        keys = keys[:len(notes)]
        key_bytes = [bytes(k) for k in keys]
        # Chunks some engine described already (a shared prefix) are not written again.
        fresh = [i for i, k in enumerate(key_bytes) if not self.announcer.knows(k)]
        try:
            if fresh:
                self.journal.append(jr.NOTED, HOT, keys if len(fresh) == len(keys) else keys.take(np.asarray(fresh)),
                                    [notes[i] for i in fresh])
        except OSError as e:
            logger.warning("tieredkv: the host journal failed (%s); blocks are not announced", e)
        n = min(len(where), len(notes))
        if n:
            found = self.announcer.found(key_bytes[:n], list(where[:n]), notes[:n])
            with self._lock:
                self._local.extend(found)

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """vLLM KV events since the last call."""
        return to_kv_events(self._take())

    def sync_generation(self, generation: bytes) -> None:
        """Follow the connector's key generation: after its ``reset_cache`` no block stored before can
        serve it, so ``AllBlocksCleared`` is announced (for this engine only: the blocks still serve the
        host's other engines, whose readers are unaffected) and only notes of the new generation count."""
        if generation != self.announcer.generation:
            with self._lock:
                self._local.extend(self.announcer.regenerate(generation))


class TierEvents(_JournalEvents):
    """``TieredKVTier``'s events: ``OffloadingEvent`` for chunks stored, found and evicted on the host."""

    def note_store(self, keys: Any, offload_keys: Sequence[bytes]) -> None:
        try:
            self.journal.append(jr.NOTED, HOT, keys, [offload_note(k) for k in offload_keys])
        except OSError as e:
            logger.warning("tieredkv: the host journal failed (%s); chunks are not announced", e)

    def found(self, key: Any, offload_key: bytes, tier: int) -> None:
        found = self.announcer.found([bytes(key)], [tier], [offload_note(offload_key)])
        with self._lock:
            self._local.extend(found)

    def take(self) -> list[OffloadingEvent]:
        return to_offloading_events(self._take())


# ---- the exporter: a host's journals on vLLM's ZMQ wire format --------------------------------------------
class Exporter:
    """Publish the tier changes of a host's journals as vLLM ``KVEventBatch`` messages on ZMQ.

    Uses vLLM's own ``ZmqEventPublisher``: multipart ``(topic, seq as 8-byte big-endian, msgpack batch)``
    on a PUB socket, with the optional replay ROUTER socket, exactly what a router subscribing to a vLLM
    engine reads. Stores of blocks no engine described (no ``NOTED`` record) are not published.

    Args:
        journals: journal files (``/dev/shm/<segment>.journal``).
        endpoint: the PUB endpoint (``tcp://*:5557`` binds all interfaces).
        replay_endpoint: the ROUTER endpoint for replays, or None.
        topic: the topic every message carries.
        data_parallel_rank: stamped on every batch (what a router keys engines by, with the endpoint).
    """

    def __init__(self, journals: Sequence[str], endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 topic: str = "", data_parallel_rank: int = 0):
        self.readers = [jr.JournalReader(p) for p in journals]
        self.announcer = Announcer()
        self.publisher = ZmqEventPublisher(data_parallel_rank, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                           topic=topic)
        self.published = 0

    def step(self) -> int:
        """Publish what the journals gained since the last step (one batch); return the event count."""
        events = to_kv_events([a for reader in self.readers for a in poll(reader, self.announcer)])
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.published += len(events)
        return len(events)

    def run(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Step every ``poll_s`` seconds until ``stop`` is set, then once more (what was journaled
        since the last step is published, not lost at shutdown)."""
        while not stop.is_set():
            self.step()
            stop.wait(poll_s)
        self.step()

    def close(self) -> None:
        self.publisher.shutdown()
        for reader in self.readers:
            reader.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tieredkv.integrations.kv_events --journal /dev/shm/tieredkv-....journal --endpoint
    tcp://*:5557``: publish a host's tier changes to KV-aware routers until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m tieredkv.integrations.kv_events", description=main.__doc__)
    p.add_argument("--journal", action="append", required=True, help="a journal file (repeat for several)")
    p.add_argument("--endpoint", default="tcp://*:5557", help="ZMQ PUB endpoint (default tcp://*:5557)")
    p.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replays")
    p.add_argument("--topic", default="", help="topic of every message")
    p.add_argument("--poll-s", type=float, default=0.05, help="seconds between journal polls")
    args = p.parse_args(argv)
    exporter = Exporter(args.journal, args.endpoint, args.replay_endpoint, args.topic)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"tieredkv: publishing {len(args.journal)} journal(s) on {args.endpoint}", flush=True)
    try:
        exporter.run(stop, args.poll_s)
    finally:
        exporter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
