"""KV events for routers, end to end on loopback: vLLM's real Scheduler publishes the connector's events
with its own ZMQ publisher (or tieredkv's exporter publishes a host's journal), and a real ZMQ SUB
socket decodes them with vLLM's own ``KVEventBatch``. No engine is started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import msgspec
import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")
os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1")

import zmq
from test_vllm_connector import (  # noqa: F401 (model_dir is a fixture)
    BLOCK,
    job,
    make_scheduler,
    model_dir,
    offloading_spec,
    request,
    step,
    stored_kv,
    tier_config,
    vllm_config,
    worker_for,
)
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import Locality, Medium, OffloadingKVEventsConfig, ReqContext
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tieredkv import TieredCache, chunk_keys
from tieredkv import journal as jr
from tieredkv.cache import HOT, REMOTE, WARM
from tieredkv.integrations import kv_events

CHUNK = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A router's side: a SUB socket connected on loopback, decoding vLLM's KVEventBatch messages (vLLM's
    publisher binds a wildcard endpoint, ``tcp://*:PORT``, as in production)."""

    def __init__(self, port: int, topic: str = ""):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.seqs: list[int] = []

    def events(self, want, timeout_s: float = 20.0) -> list:
        """Decoded tieredkv events until ``want(events)`` holds (or the timeout)."""
        got: list = []
        deadline = time.monotonic() + timeout_s
        while not want(got) and time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = self.decoder.decode(payload)
            got += [e for e in batch.events if isinstance(e, AllBlocksCleared)
                    or (getattr(e, "ownership", None) or "").startswith("tieredkv")]
        return got

    def close(self):
        self.sock.close(linger=0)


def chunk_hashes(req, i: int) -> list:
    per = CHUNK // BLOCK
    return [maybe_convert_block_hash(h) for h in req.block_hashes[i * per:(i + 1) * per]]


def engine_with_prompt(cfg, tokens):
    """One engine (a Scheduler and a worker) that has computed and saved ``tokens``' prompt."""
    scheduler = make_scheduler(cfg)
    worker, _ = worker_for(cfg)
    req = request("a", tokens)
    scheduler.add_request(req)
    step(scheduler, worker, [req])
    return scheduler, worker, req


def stored(events, medium):
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


@pytest.fixture
def events_cfg(model_dir, seg_name, tmp_path):  # noqa: F811
    def make(endpoint: str | None, **extra):
        cfg = vllm_config(model_dir, {"hot_name": seg_name, "warm_dir": str(tmp_path / "warm"), "warm_bytes": "32M",
                                      "chunk_tokens": CHUNK, "demotion": "write_through", **extra})
        cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq" if endpoint else "null",
                                              endpoint=endpoint or "tcp://*:5557", topic="kv")
        return cfg
    yield make
    jr.remove(jr.journal_path(seg_name))


_SECOND_ENGINE = textwrap.dedent("""
    import json, os, sys
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1")
    sys.path.insert(0, {tests!r})
    import numpy as np
    from vllm.config import KVEventsConfig
    from test_vllm_connector import make_scheduler, request, step, vllm_config, worker_for
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    cfg = vllm_config({model!r}, json.loads(sys.argv[1]))
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    scheduler = make_scheduler(cfg)
    worker, _ = worker_for(cfg)
    req = request("b", np.arange(1000, 1200) % 500)
    scheduler.add_request(req)
    step(scheduler, worker, [req])
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]  # ints, or bytes (by a vLLM env flag)
    print(json.dumps([h if isinstance(h, int) else h.hex() for h in hashes]))
    worker.shutdown()
    scheduler.connector.shutdown()
""")


@pytest.mark.procs
def test_the_schedulers_publisher_announces_stores_evictions_and_another_engines_stores(events_cfg, model_dir):  # noqa: F811
    port = free_port()
    cfg = events_cfg(f"tcp://*:{port}", hot_blocks=4)
    scheduler = make_scheduler(cfg)  # vLLM builds its ZMQ publisher from kv_events_config
    worker, _ = worker_for(cfg)
    sub = Subscriber(port, "kv")
    time.sleep(0.5)  # PUB drops messages until the subscription has reached it
    try:
        tokens = np.arange(1, 201) % 500
        req = request("a", tokens)
        scheduler.add_request(req)
        step(scheduler, worker, [req])  # computes and saves chunks 0..2; the step's events are published
        got = sub.events(lambda ev: len(stored(ev, "CPU")) >= 3 and len(stored(ev, "STORAGE")) >= 3)
        hot, warm = stored(got, "CPU"), stored(got, "STORAGE")
        assert [e.block_hashes for e in hot] == [chunk_hashes(req, i) for i in range(3)]
        assert [e.block_hashes for e in warm] == [chunk_hashes(req, i) for i in range(3)]
        for i, e in enumerate(hot):
            assert e.token_ids == tokens[i * CHUNK:(i + 1) * CHUNK].tolist() and e.block_size == BLOCK
            assert e.parent_block_hash == (chunk_hashes(req, i - 1)[-1] if i else None)
            assert (e.locality, e.ownership) == ("LOCAL", "tieredkv-hot")
        assert {(e.locality, e.ownership) for e in warm} == {("LOCAL", "tieredkv-warm")}
        # A second engine of the host (a real process, its own Scheduler and worker) stores another
        # prompt: the hot tier (4 chunks) evicts some of this engine's chunks to make room.
        extra = cfg.kv_transfer_config.kv_connector_extra_config
        code = _SECOND_ENGINE.format(tests=os.path.dirname(__file__), model=model_dir)
        out = subprocess.run([sys.executable, "-c", code, json.dumps(extra)], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        printed = json.loads(out.stdout.strip().splitlines()[-1])
        theirs = [h if isinstance(h, int) else bytes.fromhex(h) for h in printed]
        tick = request("tick", np.arange(7, 47))  # no full chunk: a step that only publishes
        scheduler.add_request(tick)
        step(scheduler, worker, [req, tick])
        got = sub.events(lambda ev: len(stored(ev, "CPU")) >= 3 and any(isinstance(e, BlockRemoved) for e in ev))
        assert [e.block_hashes for e in stored(got, "CPU")] == [theirs[2 * i:2 * i + 2] for i in range(3)]
        removed = [e for e in got if isinstance(e, BlockRemoved)]
        assert removed and {e.medium for e in removed} == {"CPU"}  # evicted from hot; warm still has them
        mine = {tuple(chunk_hashes(req, i)): i for i in range(3)}
        lost = [mine[tuple(e.block_hashes)] for e in removed]
        keys = chunk_keys(worker.spec, tokens[:192])
        assert not worker.cache.hot.contains_many(keys.take(np.array(lost))).any()
        assert sub.seqs == sorted(sub.seqs)
        # reset_cache gives the engine a new key generation (every later salt carries it): nothing
        # announced so far can serve this engine any more.
        assert scheduler.connector.reset_cache()
        assert [type(e) for e in scheduler.connector.take_events()] == [AllBlocksCleared]
    finally:
        sub.close()
        worker.shutdown()
        scheduler.connector.shutdown()
        scheduler.shutdown()


@pytest.mark.procs
def test_a_restarted_engine_announces_what_its_lookup_finds_in_warm(events_cfg):
    tokens = np.arange(3, 203) % 500
    scheduler, worker, _ = engine_with_prompt(events_cfg(None), tokens)
    worker.cache.unlink_hot()  # a reboot: the segment is gone, the warm tier stays
    worker.shutdown()
    scheduler.connector.shutdown()
    cfg2 = events_cfg(None)
    scheduler2 = make_scheduler(cfg2)
    conn = scheduler2.connector
    assert conn.take_events() == []
    again = request("again", tokens)
    scheduler2.add_request(again)
    scheduler2.schedule()  # the lookup finds chunks 0..2 in warm
    got = conn.take_events()
    assert [(e.medium, e.ownership) for e in got] == [("STORAGE", "tieredkv-warm")] * 3
    assert [e.block_hashes for e in got] == [chunk_hashes(again, i) for i in range(3)]
    conn.shutdown()
    scheduler.shutdown()
    scheduler2.shutdown()


@pytest.mark.procs
def test_the_exporter_publishes_a_hosts_journal(events_cfg, seg_name):
    cfg = events_cfg(None, hot_blocks=4)
    port = free_port()
    path = jr.journal_path(seg_name)
    exporter = subprocess.Popen([sys.executable, "-m", "tieredkv.integrations.kv_events", "--journal", path,
                                 "--endpoint", f"tcp://*:{port}", "--topic", "host"], stdout=subprocess.PIPE, text=True)
    sub = Subscriber(port, "host")
    try:
        assert "publishing" in exporter.stdout.readline()
        time.sleep(0.5)  # PUB drops messages until the subscription has reached it
        scheduler, worker, req = engine_with_prompt(cfg, np.arange(11, 211) % 500)
        got = sub.events(lambda ev: len(stored(ev, "CPU")) >= 3)
        assert [e.block_hashes for e in stored(got, "CPU")] == [chunk_hashes(req, i) for i in range(3)]
        # Another worker of the host (a plain TieredCache handle) stores three chunks nobody described
        # (not published); the hot tier (4 chunks) evicts some of these to make room.
        other_tokens = np.arange(300, 492)
        with TieredCache(worker.spec, hot_name=seg_name, journal=True) as other:
            other.store(other_tokens, stored_kv(worker.spec, other_tokens))
        got = sub.events(lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
        removed = [e for e in got if isinstance(e, BlockRemoved)]
        assert removed and {e.medium for e in removed} == {"CPU"}
        assert all(e.block_hashes in [chunk_hashes(req, i) for i in range(3)] for e in removed)
        assert not [e for e in got if isinstance(e, BlockStored)]
        # The segment removed (a reboot, `tieredkv rm`) and created again: the hot tier is empty, its
        # journal restarts with CLEARED, and the host's routers hear AllBlocksCleared.
        scheduler.connector.shutdown()
        scheduler.shutdown()
        worker.cache.unlink_hot()
        worker.shutdown()
        with TieredCache(worker.spec, hot_name=seg_name, hot_blocks=4, journal=True):
            got = sub.events(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
        assert any(isinstance(e, AllBlocksCleared) for e in got)
    finally:
        sub.close()
        exporter.terminate()
        assert exporter.wait(timeout=30) == 0


def test_an_announcer_announces_once_per_tier_and_follows_the_key_generation():
    stored_note = kv_events.chunk_notes(request("n", np.arange(64)), 1, CHUNK, BLOCK)[0]
    key, other = b"k" * 16, b"o" * 16

    def j(op, tier, keys, notes=()):  # a journal record as a reader gets it
        return jr.Record(op, tier, np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16), tuple(notes), 1, 0.0)

    ann = kv_events.Announcer(generation=b"")
    # A store before its description waits for it; then one announcement per tier, once.
    assert ann.feed([j(jr.STORED, HOT, [key])]) == []
    assert [a[:2] for a in ann.feed([j(jr.NOTED, HOT, [key], [stored_note])])] == [("stored", HOT)]
    assert ann.feed([j(jr.STORED, HOT, [key])]) == []
    assert [a[:2] for a in ann.feed([j(jr.STORED, WARM, [key]), j(jr.EVICTED, HOT, [key]),
                                     j(jr.EVICTED, HOT, [other])])] == [("stored", WARM), ("removed", HOT)]
    events = kv_events.to_kv_events(ann.feed([j(jr.EVICTED, WARM, [key])]))
    assert [(type(e), e.medium) for e in events] == [(BlockRemoved, "STORAGE")]
    # After a reset_cache (new generation): AllBlocksCleared once, and old-generation notes are ignored.
    ann.feed([j(jr.STORED, HOT, [key])])
    assert [a[0] for a in ann.regenerate(b"g" * 16)] == ["cleared"]
    assert ann.feed([j(jr.NOTED, HOT, [other], [stored_note]), j(jr.STORED, HOT, [other])]) == []
    mine = kv_events.chunk_notes(request("m", np.arange(64)), 1, CHUNK, BLOCK, generation=b"g" * 16)[0]
    assert [a[:2] for a in ann.feed([j(jr.NOTED, HOT, [other], [mine])])] == [("stored", HOT)]
    # The remote tier is STORAGE, REMOTE to the publisher.
    (remote,) = kv_events.to_kv_events([("stored", REMOTE, mine)])
    assert (remote.medium, remote.locality, remote.ownership) == ("STORAGE", "REMOTE", "tieredkv-remote")
    # The exporter reads every generation.
    assert kv_events.Announcer().feed([j(jr.NOTED, HOT, [key], [mine]), j(jr.STORED, HOT, [key])])


def test_a_router_always_hears_that_an_announced_block_left():
    """An announced block keeps its note: when other requests' notes push it out of the bounded note
    table, its eviction is still a ``BlockRemoved`` (before: a removal with no note, which no event
    could describe, so the router kept routing to a prefix that was gone). An announced block the
    announcer itself forgets to make room is announced removed then, and an eviction from one tier
    leaves the other tiers' stores that still wait for their note (before: the warm copy was never
    announced)."""
    def note(i: int) -> bytes:
        return kv_events.chunk_notes(request(f"r{i}", np.arange(64) + 1000 * i), 1, CHUNK, BLOCK)[0]

    def key(i: int) -> bytes:
        return i.to_bytes(16, "little")

    def j(op, tier, keys, notes=()):
        return jr.Record(op, tier, np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16), tuple(notes), 1, 0.0)

    ann = kv_events.Announcer(max_blocks=4)
    assert [a[:2] for a in ann.feed([j(jr.NOTED, HOT, [key(1)], [note(1)]), j(jr.STORED, HOT, [key(1)])])] \
        == [("stored", HOT)]
    ann.feed([j(jr.NOTED, HOT, [key(100 + i) for i in range(4)], [note(100 + i) for i in range(4)])])
    assert not ann.knows(key(1))  # its description was pushed out of the note table
    (removed,) = kv_events.to_kv_events(ann.feed([j(jr.EVICTED, HOT, [key(1)])]))
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    # Announced blocks past the bound: the oldest is announced removed as it is forgotten.
    out = ann.feed([j(jr.STORED, HOT, [key(100 + i)]) for i in range(4)] + [j(jr.NOTED, HOT, [key(5)], [note(5)]),
                                                                             j(jr.STORED, WARM, [key(5)])])
    assert [a[:2] for a in out] == [("stored", HOT)] * 4 + [("stored", WARM), ("removed", HOT)]
    assert kv_events.to_kv_events(out[-1:])[0].block_hashes == kv_events.to_kv_events(out[:1])[0].block_hashes
    # Stored hot and warm before the note came, evicted from hot meanwhile: the warm copy is announced.
    fresh = kv_events.Announcer()
    out = fresh.feed([j(jr.STORED, HOT, [key(7)]), j(jr.STORED, WARM, [key(7)]), j(jr.EVICTED, HOT, [key(7)]),
                      j(jr.NOTED, HOT, [key(7)], [note(7)])])
    assert [a[:2] for a in out] == [("stored", WARM)]


def test_journal_files_rotated_away_unread_clear_what_was_announced(tmp_path):
    """A reader that falls behind by whole journal files cannot tell which announced blocks those files
    evicted: it announces ``AllBlocksCleared`` (a router then forgets them, and loses hits at worst)
    rather than leave them announced (before: nothing, and the router kept routing to a gone prefix)."""
    note = kv_events.chunk_notes(request("r", np.arange(64)), 1, CHUNK, BLOCK)[0]
    journal = jr.HostJournal(str(tmp_path / "j.journal"), max_bytes=1000)
    reader, ann = jr.JournalReader(journal.path), kv_events.Announcer()
    kept = b"k" * 16
    journal.append(jr.NOTED, HOT, [kept], [note])
    journal.append(jr.STORED, HOT, [kept])
    assert [a[:2] for a in kv_events.poll(reader, ann)] == [("stored", HOT)]
    journal.append(jr.EVICTED, HOT, [kept])
    for i in range(100):  # several rotations before the next poll: the eviction's file is gone
        journal.append(jr.STORED, WARM, [i.to_bytes(16, "little")])
    out = kv_events.poll(reader, ann)
    assert reader.lost_files > 0
    assert [type(e) for e in kv_events.to_kv_events(out)] == [AllBlocksCleared]
    assert kv_events.poll(reader, ann) == []


def test_the_exporter_publishes_what_was_journaled_before_it_stopped(tmp_path):
    """``Exporter.run`` steps once more after ``stop`` is set: records journaled since its last step are
    published, not lost at shutdown."""
    import threading

    note = kv_events.chunk_notes(request("r", np.arange(64)), 1, CHUNK, BLOCK)[0]
    journal = jr.HostJournal(str(tmp_path / "j.journal"))
    exporter = kv_events.Exporter([journal.path], endpoint=f"tcp://127.0.0.1:{free_port()}")
    try:
        stop = threading.Event()
        stop.set()
        journal.append(jr.NOTED, HOT, [b"k" * 16], [note])
        journal.append(jr.STORED, HOT, [b"k" * 16])
        exporter.run(stop)
        assert exporter.published == 1
    finally:
        exporter.close()


def test_the_secondary_tier_yields_offloading_events_vllms_tracker_accepts(seg_name, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker

    cfg = {**tier_config(seg_name, tmp_path / "warm"), "hot_blocks": 2, "journal": True}
    cfg.pop("hot_bytes")
    primary = np.random.default_rng(0).integers(0, 256, size=(8, 4096), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(primary), offloading_spec())
    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(3)]
    try:
        tier.submit_store(job(1, keys[:2], [0, 1]))
        tier.drain_jobs()
        events = tier.take_events()
        assert {(bytes(e.keys[0]), e.medium, e.removed, e.locality) for e in events} == \
            {(k, m, False, Locality.LOCAL) for k in keys[:2] for m in (Medium.CPU, Medium.STORAGE)}
        tier.submit_store(job(2, keys[2:], [2]))  # two hot slots: one of the first chunks is evicted
        tier.drain_jobs()
        events = tier.take_events()
        assert [(e.medium, e.removed) for e in events if e.removed] == [(Medium.CPU, True)]
        assert bytes([e for e in events if e.removed][0].keys[0]) in keys[:2]
        # vLLM's offloading connector turns them into KV events (placeholder payloads: hashes only).
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                                   self_describing_kv_events=False))
        kv = list(tracker.take_events(events))
        assert {type(e) for e in kv} == {BlockStored, BlockRemoved}
        assert tier.lookup(keys[2], ReqContext(req_id="q")).name == "HIT"
    finally:
        tier.cache.unlink_hot()
        tier.shutdown()
        jr.remove(jr.journal_path(seg_name))
