"""WarmTier across real processes: persistence, SIGKILLed writers, crash consistency, concurrency."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tieredkv import KVSpec, PutResult, chunk_keys
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import TEST_SPEC_ARGS, check_index, mixer, payload_for, prompt_keys

SPEC = KVSpec(**TEST_SPEC_ARGS)
SLOT = 4096


def start_writer(root, **kw) -> subprocess.Popen:
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    code = f"from tieredkv.warm.testing import writer; writer({str(root)!r}, {args})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def committed_prompts(proc: subprocess.Popen, stop_after: int | None = None) -> list[int]:
    done = []
    for line in proc.stdout:
        done.append(int(line.split()[1]))
        if stop_after is not None and len(done) >= stop_after:
            break
    return done


def assert_all_served(root, prompts, chunks=8):
    with WarmTier(SPEC, root) as t:
        out = np.empty((chunks, SPEC.block_bytes), np.uint8)
        for p in prompts:
            k = prompt_keys(SPEC, p, chunks)
            assert t.get_many(k, out) == chunks, f"prompt {p} not fully served"
            np.testing.assert_array_equal(out, payload_for(k, SPEC.block_bytes))
        assert t.stats().corrupt == 0


@pytest.mark.procs
def test_persistence_after_clean_exit(tmp_path):
    proc = start_writer(tmp_path, capacity_slots=512, batches=40)
    prompts = committed_prompts(proc)
    assert proc.wait(timeout=60) == 0 and len(prompts) == 40
    assert_all_served(tmp_path, prompts)
    check_index(str(tmp_path / SPEC.namespace))


@pytest.mark.procs
@pytest.mark.parametrize("sync", ["none", "data"])
def test_persistence_after_sigkill(tmp_path, sync):
    proc = start_writer(tmp_path, capacity_slots=4096, batches=100_000, sync=sync)
    prompts = committed_prompts(proc, stop_after=30)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # Everything reported committed before the kill is there, byte for byte.
    assert_all_served(tmp_path, prompts)
    report = admin.verify(tmp_path)
    assert report["tiers"][0]["bad_blocks"] == []
    check_index(str(tmp_path / SPEC.namespace))  # open (above) reaped the dead writer's claims


@pytest.mark.procs
def test_crash_consistency_random_kills(tmp_path):
    """SIGKILL a writer at random points of put_many, many times; the index must stay exact."""
    rng = random.Random(1234)
    capacity = 96  # small: the writer evicts and recycles slots all the time
    spec_args = dict(TEST_SPEC_ARGS, num_layers=16, head_dim=64)  # 8 KiB blocks, 3 slots per 2 blocks
    spec = KVSpec(**spec_args)
    kills = int(os.environ.get("TIEREDKV_KILLS", "12"))
    claims_seen = 0
    for round_ in range(kills):
        proc = start_writer(tmp_path, capacity_slots=capacity, batches=100_000, seed=round_,
                            sync=rng.choice(["none", "none", "data"]), chunks=12, spec_args=spec_args)
        proc.stdout.readline()  # it is running put_many in a loop now
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        tier_dir = str(tmp_path / spec.namespace)
        counts = check_index(tier_dir, allow_claims=True)
        claims_seen += counts["claimed"] > 0
        report = admin.verify(tier_dir)
        assert report["bad_blocks"] == [], report["bad_blocks"]
        assert report["blocks_checked"] == counts["used"]
        # Opening reaps the dead writer's claims: afterwards every slot is used or free, and the
        # whole capacity can be written again.
        with WarmTier(spec, tmp_path) as t:
            pass
        counts = check_index(tier_dir)
        assert counts["used"] + counts["free"] + counts["never_used"] == counts["n_slots"]
    print(f"{claims_seen} of {kills} kills left a claim between claim and commit")
    with WarmTier(spec, tmp_path) as t:
        k = chunk_keys(spec, np.arange(t.n_slots * spec.chunk_tokens) + 50_000_000)  # all new
        codes = t.put_many(k, payload_for(k, spec.block_bytes))
        assert (codes == PutResult.STORED).all()
        out = np.empty((len(k), spec.block_bytes), np.uint8)
        assert t.get_many(k, out) == len(k)
        np.testing.assert_array_equal(out, payload_for(k, spec.block_bytes))


def _mix(args):
    return mixer(*args)


@pytest.mark.procs
def test_four_processes_overlapping_keys(tmp_path):
    capacity = 64  # far fewer slots than the working set: eviction and slot reuse under readers
    seconds = float(os.environ.get("TIEREDKV_MIX_SECONDS", "3"))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_mix, [(str(tmp_path), seed, seconds, capacity, None,
                                   "never" if seed % 2 else "always") for seed in range(4)])
    assert sum(r["bad"] for r in results) == 0, results
    assert all(r["blocks_read"] > 0 and r["stored"] > 0 for r in results), results
    assert sum(r["evicted"] for r in results) > 0
    tier_dir = str(tmp_path / SPEC.namespace)
    check_index(tier_dir)
    report = admin.verify(tier_dir)
    assert report["ok"], report
