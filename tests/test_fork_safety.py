"""Processes forked while a cache's background threads hold its locks (issue 19, item 1).

``fork`` copies every lock in the state it had: one held by the write-behind writer, the remote writer
or a reader at that instant would stay held in the child for ever. The parent here keeps a writer
thread storing prompts (write-behind warm writes, remote writes to a real valkey-server) and forks
children at random moments with ``os.fork``; each child must look up, load and store through the
inherited cache and exit. A child that has not exited within its bound is a hang.
"""

from __future__ import annotations

import faulthandler
import os
import secrets
import signal
import threading
import time

import numpy as np
import posix_ipc
import pytest

from helpers import kv_for, same_bytes
from tieredkv import KVSpec, TieredCache
from tieredkv.remote import testing as servers

pytestmark = pytest.mark.procs

CHILDREN = 30
CHILD_BOUND_S = 20.0


def _child(cache: TieredCache, tokens: np.ndarray, own: np.ndarray) -> int:
    """In the forked child: 0 when every call returned and every byte served was right."""
    spec = cache.spec
    hit = cache.lookup(tokens)
    out = np.zeros((spec.num_layers, 2, spec.num_kv_heads, max(hit.tokens, 1), spec.head_dim), spec.numpy_dtype)
    n = cache.load(hit, out)
    if n and not same_bytes(out[:, :, :, :n], kv_for(spec, tokens)[:, :, :, :n]):
        return 3
    cache.store(own, kv_for(spec, own))  # the child's own writers start lazily
    hit = cache.lookup(own)  # (the parent's stores may have evicted some of them already)
    out = np.zeros((spec.num_layers, 2, spec.num_kv_heads, max(hit.tokens, 1), spec.head_dim), spec.numpy_dtype)
    n = cache.load(hit, out)
    if n and not same_bytes(out[:, :, :, :n], kv_for(spec, own)[:, :, :, :n]):
        return 4
    cache.close()
    return 0


def _fork_under_writes(cache: TieredCache, spec: KVSpec, stacks) -> tuple[int, list[int]]:
    """Fork CHILDREN children while a thread stores; returns (hung, exit codes of the others)."""
    base = np.random.default_rng(0).integers(0, 30_000, 16 * 64 + 1)
    cache.store(base, kv_for(spec, base))
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            p = np.random.default_rng(1000 + i).integers(0, 30_000, 16 * 64 + 1)
            cache.store(p, kv_for(spec, p))
            i += 1

    threads = [threading.Thread(target=writer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    hung, codes = 0, []
    rng = np.random.default_rng(7)
    try:
        for c in range(CHILDREN):
            time.sleep(float(rng.uniform(0, 0.05)))
            own = np.random.default_rng(50_000 + c).integers(0, 30_000, 16 * 4 + 1)
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                code = 99
                f = open(stacks / f"child-{c}.txt", "w")  # noqa: SIM115 - open until os._exit
                faulthandler.dump_traceback_later(CHILD_BOUND_S - 5, exit=True, file=f)
                try:
                    code = _child(cache, base, own)
                finally:
                    os._exit(code)
            deadline = time.monotonic() + CHILD_BOUND_S
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes.append(os.waitstatus_to_exitcode(status))
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    hung += 1
                    break
                time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return hung, codes


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_children_forked_under_write_traffic_never_hang(tmp_path):
    spec = KVSpec(model_id=f"test/fork-{secrets.token_hex(4)}", num_layers=2, num_kv_heads=2, head_dim=64,
                  dtype="bfloat16", chunk_tokens=16)  # 16 KiB blocks
    name = f"/tieredkv-test-{os.getpid()}-{secrets.token_hex(4)}"
    with servers.ValkeyServer() as server:
        cache = TieredCache(spec, hot_bytes=8 << 20, hot_name=name, warm_dir=tmp_path / "warm",
                            warm_bytes=64 << 20, remote=f"{server.url}?deadline_ms=10000")
        try:
            hung, codes = _fork_under_writes(cache, spec, tmp_path)
        finally:
            cache.close()
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass
    where = "".join(p.read_text() for p in sorted(tmp_path.glob("child-*.txt")))
    print(where)  # the stacks of children that did not finish in time (faulthandler)
    assert hung == 0, f"{hung} of {CHILDREN} forked children hung (exit codes of the rest: {codes}):\n{where}"
    assert codes == [0] * CHILDREN, (codes, where)
