"""NUMA topology and pinning, against fake /sys/devices/system/node trees built in tmp_path."""

from __future__ import annotations

import os

import pytest

from tieredkv import InvalidInput, KVSpec, numa
from tieredkv.hot import segment as seg


def fake_sysfs(root, node_cpus: dict[int, str], extra: bool = True):
    """A node directory like the kernel's: nodeN/cpulist, plus the files that are not nodes."""
    root.mkdir(parents=True, exist_ok=True)
    for node, cpulist in node_cpus.items():
        (root / f"node{node}").mkdir()
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    if extra:
        (root / "online").write_text(f"0-{max(node_cpus)}\n" if node_cpus else "0\n")
        (root / "possible").write_text("0-3\n")
        (root / "power").mkdir()
    return root


@pytest.mark.parametrize("text,cpus", [
    ("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,8-9", [0, 1, 8, 9]), ("4,2,2-3", [2, 3, 4]),
    ("0-6:3", [0, 3, 6]), ("", []), ("\n", []),
])
def test_parse_cpulist(text, cpus):
    assert numa.parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "0-4:0", "1;2"])
def test_parse_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError):
        numa.parse_cpulist(text)


def test_two_socket_topology(tmp_path):
    root = fake_sysfs(tmp_path / "node", {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})  # node 2: memory only
    assert numa.nodes(root) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert numa.node_of_cpu(9, root) == 0
    assert numa.node_of_cpu(12, root) == 1
    assert numa.node_of_cpu(99, root) is None
    assert [numa.node_for_worker(i, root) for i in range(5)] == [0, 1, 0, 1, 0]


def test_nodes_sorted_numerically(tmp_path):
    root = fake_sysfs(tmp_path / "node", {10: "2", 2: "1", 0: "0"})
    assert list(numa.nodes(root)) == [0, 2, 10]


def test_single_node_and_missing_sysfs_need_no_setting(tmp_path):
    single = fake_sysfs(tmp_path / "single", {0: "0-63"})
    missing = tmp_path / "no-such-dir"
    for root in (single, missing):
        assert numa.choose_node(root) is None
        assert numa.node_for_worker(3, root) is None
    assert numa.nodes(missing) == {}
    assert numa.node_of_cpu(0, missing) is None


def test_node_for_worker_rejects_negative_index(tmp_path):
    with pytest.raises(InvalidInput):
        numa.node_for_worker(-1, fake_sysfs(tmp_path / "node", {0: "0", 1: "1"}))


@pytest.fixture
def restore_affinity():
    before = os.sched_getaffinity(0)
    yield sorted(before)
    os.sched_setaffinity(0, before)


def test_pin_to_node_sets_affinity(tmp_path, restore_affinity):
    allowed = restore_affinity
    # Node 0 gets the first allowed CPU; node 1 claims the rest (or a CPU that does not exist).
    rest = ",".join(map(str, allowed[1:])) or "4095"
    root = fake_sysfs(tmp_path / "node", {0: str(allowed[0]), 1: rest})
    assert numa.pin_to_node(0, root) == [allowed[0]]
    assert os.sched_getaffinity(0) == {allowed[0]}
    # Once pinned, the process is wholly inside node 0: that is the node it belongs to.
    assert numa.choose_node(root) == 0


def test_choose_node_when_cpus_span_nodes_uses_the_current_cpu(tmp_path, monkeypatch):
    # The process may run on CPUs of both nodes (none holds all of them): the current CPU decides.
    allowed = sorted(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path / "node", {0: ",".join(map(str, allowed)) + ",4000", 1: "4001"})
    assert numa.choose_node(root) == 0                       # node 0 holds every allowed CPU
    root2 = fake_sysfs(tmp_path / "node2", {0: "4000", 1: "4001"})
    monkeypatch.setattr(numa, "current_cpu", lambda: 4001)
    assert numa.choose_node(root2) == 1
    monkeypatch.setattr(numa, "current_cpu", lambda: 4000)
    assert numa.choose_node(root2) == 0


def test_current_cpu_parses_names_with_spaces_and_parens(tmp_path):
    fields = ["S"] + ["0"] * 35 + ["7"] + ["0"] * 10  # field 39 (processor) = 7
    stat = tmp_path / "stat"
    stat.write_text("1234 (a (weird) name) " + " ".join(fields) + "\n")
    assert numa.current_cpu(stat) == 7
    assert numa.current_cpu() in os.sched_getaffinity(0)


def test_pin_to_unknown_node_lists_the_nodes(tmp_path):
    root = fake_sysfs(tmp_path / "node", {0: "0-3", 1: "4-7"})
    with pytest.raises(InvalidInput, match=r"no NUMA node 5.*0 \(CPUs 0-3\), 1 \(CPUs 4-7\)"):
        numa.pin_to_node(5, root)


def test_pin_to_cpus_not_allowed_is_a_clear_error(tmp_path, restore_affinity):
    root = fake_sysfs(tmp_path / "node", {0: "4000-4001", 1: "4002"})  # CPUs this host does not have
    with pytest.raises(InvalidInput, match="cannot pin to node 0"):
        numa.pin_to_node(0, root)
    assert os.sched_getaffinity(0) == set(restore_affinity)


def test_segment_name_per_node():
    spec = KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
    names = {seg.default_name(spec, n) for n in (None, 0, 1)}
    assert len(names) == 3
    assert seg.default_name(spec, 1) == seg.default_name(spec) + "-numa1"
