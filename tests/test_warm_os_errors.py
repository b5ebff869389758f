"""The warm tier tells the operating system's refusals apart by their class and errno, never by the text
of a message: files that may not be written (immutable files: EPERM, the same for root; a read-only
mount: EROFS) open read-only and serve; a full disk is ``WarmTierUnavailable`` with ``errno.ENOSPC``.

Each case runs in a child with a private mount namespace and a small tmpfs of its own (root only, like
tests/test_faults.py): the real condition, not a patched call.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.procs,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a private tmpfs needs root")]

_CHILD = r"""
import errno, os, subprocess, sys, warnings
import numpy as np
from tieredkv import KVSpec, WarmTierUnavailable, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import payload_for

case, mnt = sys.argv[1], sys.argv[2]
spec = KVSpec(model_id="test/oserrors", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", mnt], check=True)
stored = chunk_keys(spec, np.arange(4 * 8))
with WarmTier(spec, mnt, capacity_bytes=1 << 20) as t:
    assert (t.put_many(stored, payload_for(stored, spec.block_bytes)) == 0).all()


def serves_read_only():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # opening read-only because of the files is no surprise to warn of
        with WarmTier(spec, mnt) as t:
            out = np.zeros((len(stored), spec.block_bytes), np.uint8)
            assert t.readonly, "opened for writing files it may not write"
            assert t.get_many(stored, out) == len(stored)
            assert (out == payload_for(stored, spec.block_bytes)).all()
            try:
                t.put_many(stored[:1], payload_for(stored[:1], spec.block_bytes))
            except WarmTierUnavailable:
                pass
            else:
                sys.exit("a read-only tier stored a block")


if case == "immutable":
    # chattr +i: every open for writing fails with EPERM ("Operation not permitted"), root's included.
    tier = os.path.join(mnt, spec.namespace)
    for dirpath, dirs, files in os.walk(tier):
        for name in files:
            subprocess.run(["chattr", "+i", os.path.join(dirpath, name)], check=True)
    serves_read_only()
elif case == "read-only mount":
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    serves_read_only()
elif case == "full disk":
    with open(os.path.join(mnt, "filler"), "wb") as f:  # every free page of the tmpfs
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with WarmTier(spec, mnt) as t:
        try:
            for i in range(1000):  # new records need index pages the disk no longer has
                more = chunk_keys(spec, np.arange(4 * 64) + 100_000 * (i + 1))
                t.remove(stored)
                t.put_many(more, payload_for(more, spec.block_bytes))
        except WarmTierUnavailable as exc:
            assert exc.errno == errno.ENOSPC, (exc.errno, str(exc))
            assert "the disk is full" in str(exc)
        else:
            sys.exit("a full disk never failed a store")
        out = np.zeros((4, spec.block_bytes), np.uint8)
        t.match(stored)  # still readable
print("ok", case)
"""


@pytest.mark.parametrize("case", ["immutable", "read-only mount", "full disk"])
def test_refusals_are_told_apart_by_errno(tmp_path, case):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = " ".join(shlex.quote(c) for c in [sys.executable, "-c", _CHILD, case, str(mnt)])
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"ok {case}" in r.stdout, r.stdout + r.stderr
