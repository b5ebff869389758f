"""Hot tier under attack: dead writers, damaged derived structures, interrupts, hostile segments.

Each test reproduces one way the hot tier was broken (issue 11 of the tracker) on real processes,
real signals and real shared-memory bytes, and checks the outcome the fix promises.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from helpers import payload_for
from tieredkv import HotTier, KVSpec, PutResult, chunk_keys

FORK = mp.get_context("fork")


def prompt(spec, seed, n_chunks):
    rng = np.random.default_rng(seed)
    return chunk_keys(spec, rng.integers(0, 30_000, n_chunks * spec.chunk_tokens))


def _write_then_hang(spec, name, keys, ready):
    tier = HotTier(spec, name=name, policy=None, create=False)

    def hang():
        ready.set()
        time.sleep(3600)

    tier._hooks["write"] = hang
    tier.put_many(keys, payload_for(spec, keys))


def _kill_mid_write(spec, name, keys):
    ready = FORK.Event()
    p = FORK.Process(target=_write_then_hang, args=(spec, name, keys, ready))
    p.start()
    assert ready.wait(30), "child never reached the write"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL


# ---- item 11: a dead writer's WRITING slot --------------------------------------------------------
def test_a_prefix_whose_writer_died_mid_copy_can_be_stored_again(tiny_spec, seg_name):
    """Plenty of free room (no eviction pass would ever reclaim the dead claim): the next store of
    the same prefix must reclaim the dead writer's slots and store, not answer EXISTS forever."""
    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        keys = prompt(tiny_spec, 11, 4)
        _kill_mid_write(tiny_spec, seg_name, keys)
        assert tier.slot_census()["writing_dead"] == 4
        assert tier.match(keys) == 0
        codes = tier.put_many(keys, payload_for(tiny_spec, keys))
        assert (codes == PutResult.STORED).all(), codes
        out = np.zeros((4, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(keys, out) == 4
        assert np.array_equal(out, payload_for(tiny_spec, keys))
        assert tier.slot_census()["writing_dead"] == 0
