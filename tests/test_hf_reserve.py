"""CachedPrefill.reserve: the KV buffer is allocated and its pages touched before the first request;
the per-phase page-fault counts that show first touches."""

from __future__ import annotations

import pytest

from helpers import LazyModule
from tieredkv.errors import InvalidInput

pytestmark = pytest.mark.slow  # imports torch and transformers
torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_models = LazyModule("tieredkv.integrations.models")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return hf_models.random_model(hf_models.tiny_llama_config(), seed=0, dtype=torch.float32)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_reserve_touches_the_buffer_the_next_prefill_writes_into(model):
    runner = hf.CachedPrefill(model, None, spec=hf.spec_for_model(model, chunk_tokens=16, model_id="reserve"))
    per_token = 4 * 2 * 2 * 16 * 4          # layers x (K, V) x kv heads x head dim x float32
    n = (64 << 20) // per_token             # a 64 MiB buffer: far above malloc's reuse of freed heap
    before = _rss()
    kept = runner.reserve(n)
    grown = _rss() - before
    assert kept >= n * per_token
    # torch.empty only reserves address space: without the touch RSS would not grow by the buffer.
    assert grown >= 0.9 * kept, (grown, kept)
    base = runner._host_buf.data_ptr()
    res = runner.prefill(torch.arange(1, 41).unsqueeze(0))
    assert res.cache.layers[0]._kbuf.data_ptr() - base in range(kept)   # the reserved buffer, not a new one
    for phase in ("lookup", "load", "adopt", "forward", "extract", "store"):
        assert isinstance(res.phases[f"{phase}_faults"], int) and res.phases[f"{phase}_faults"] >= 0
    del res
    assert runner.reserve(n // 2) == kept                               # already large enough: kept as is


def test_reserve_without_reuse_keeps_nothing_and_refuses_negative(model):
    spec = hf.spec_for_model(model, chunk_tokens=16, model_id="reserve")
    assert hf.CachedPrefill(model, None, spec=spec, reuse_host_buffer=False).reserve(1000) == 0
    with pytest.raises(InvalidInput):
        hf.CachedPrefill(model, None, spec=spec).reserve(-1)


def test_thread_faults_count_first_touches():
    import mmap

    import numpy as np

    # A fresh anonymous mapping: never memory this process touched before (np.empty may reuse heap
    # pages an earlier test already faulted in, once glibc's mmap threshold has grown).
    with mmap.mmap(-1, 16 << 20) as m:
        buf = np.frombuffer(m, np.uint8)
        before = hf.thread_faults()
        buf[::4096] = 1                      # 4,096 fresh pages (fewer where they come as huge pages)
        after = hf.thread_faults()
        del buf
    assert after - before >= 8
