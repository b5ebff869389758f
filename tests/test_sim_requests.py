"""``tieredkv simulate --requests A:B``: replay a slice of a trace (a tuning and a held-out split)."""

from __future__ import annotations

import json

import pytest

from tieredkv import cli
from tieredkv.errors import InvalidInput
from tieredkv.sim import Trace
from tieredkv.sim.cli import request_slice


def _trace() -> Trace:
    return Trace.from_requests([[1, 2, 3], [1, 2, 4], [7, 8], [1, 2, 3, 9]], name="t",
                               timestamps_ms=[0, 10, 20, 30])


def test_a_slice_is_those_requests_from_a_cold_cache():
    tail = request_slice(_trace(), "2:")
    assert tail.n_requests == 2 and tail.name == "t[2:]"
    assert tail.timestamps_ms.tolist() == [20, 30]
    assert [len(r) for r in tail.requests()] == [2, 4]
    assert tail.unique_blocks == 6                     # ids remapped over the slice alone
    head = request_slice(_trace(), ":2")
    assert head.requests() == [[0, 1, 2], [0, 1, 3]]


@pytest.mark.parametrize("bad", ["2", "1:2:1", "a:", "3:3", "9:"])
def test_bad_slices_are_refused(bad):
    with pytest.raises(InvalidInput):
        request_slice(_trace(), bad)


def test_the_command_replays_the_slice(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "blocks": b}) + "\n"
                            for i, b in enumerate([[1, 2], [1, 2], [3], [1, 2]])))
    out = tmp_path / "r.json"
    assert cli.main(["simulate", "--trace", str(path), "--requests", "1:", "--policy", "lru",
                     "--capacity", "4", "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 3 and doc["accesses"] == 5
    assert doc["results"][0]["hits"] == 2              # request 1 starts cold; request 3 hits it
    assert cli.main(["simulate", "--trace", str(path), "--requests", "x"]) == 2
    assert "--requests takes A:B" in capsys.readouterr().err
