"""NUMA placement: which CPUs belong to which node, and pinning a worker to one node.

On a multi-socket host a worker on the other socket reads the hot segment over the inter-socket link.
The remedy (docs/tuning.md, NUMA): one segment per node (``TieredCache(..., numa_node=N)`` suffixes the
segment name with ``-numa<N>``) and every worker pinned to the CPUs of the node whose segment it uses,
so that the pages it first touches, and the ones it reads, are local::

    from tieredkv import numa
    node = numa.node_for_worker(rank)      # None on a single-node host: nothing to set
    if node is not None:
        numa.pin_to_node(node)
    cache = TieredCache(spec, hot_bytes=..., numa_node=node)

The topology is read from ``/sys/devices/system/node`` (``nodeN/cpulist``); every function takes
``root`` to read another tree (tests build a fake one). Without that directory (no NUMA support in the
kernel, some containers) the host counts as a single node.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tieredkv.errors import InvalidInput

__all__ = ["SYSFS_NODE_ROOT", "parse_cpulist", "nodes", "check_node", "node_of_cpu", "current_cpu",
           "pin_to_node", "choose_node", "node_for_worker"]

#: Where Linux describes NUMA nodes.
SYSFS_NODE_ROOT = Path("/sys/devices/system/node")
_NODE_DIR = re.compile(r"^node(\d+)$")


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel CPU list such as ``"0-3,8-11,16"`` into sorted CPU numbers.

    Args:
        text: the list as sysfs writes it (ranges ``a-b``, optionally ``a-b:stride``, comma separated;
            empty for a node without CPUs).

    Returns:
        The CPU numbers, sorted and unique.

    Raises:
        ValueError: ``text`` is not a CPU list.

    Example:
        >>> parse_cpulist("0-3,8,10-14:2")
        [0, 1, 2, 3, 8, 10, 12, 14]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise ValueError(f"not a CPU list: {text!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if hi < lo or step < 1:
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(lo, hi + 1, step))
    return sorted(cpus)


def nodes(root: str | os.PathLike | None = None) -> dict[int, list[int]]:
    """The host's NUMA nodes that have CPUs, and their CPUs.

    Args:
        root: the node directory to read (default ``/sys/devices/system/node``).

    Returns:
        ``{node: [cpu, ...]}`` sorted by node; memory-only nodes (no CPUs) are left out. An empty dict
        when the directory does not exist: treat the host as a single node.
    """
    base = Path(root) if root is not None else SYSFS_NODE_ROOT
    try:
        entries = list(base.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out: dict[int, list[int]] = {}
    for entry in entries:
        m = _NODE_DIR.match(entry.name)
        if not m:
            continue
        try:
            cpus = parse_cpulist((entry / "cpulist").read_text())
        except FileNotFoundError:
            continue
        if cpus:
            out[int(m.group(1))] = cpus
    return dict(sorted(out.items()))


def check_node(node: int, root: str | os.PathLike | None = None) -> int:
    """Return ``node`` if this host has it (a host without NUMA information has node 0 only).

    Raises:
        InvalidInput: ``node`` is not an int or not one of the host's nodes; the message lists them.
    """
    if isinstance(node, bool) or not isinstance(node, int):
        raise InvalidInput(f"numa_node must be an int node number or None, got {node!r}")
    have = list(nodes(root)) or [0]
    if node not in have:
        hint = ("this host has one node: leave numa_node=None" if len(have) == 1
                else f"this host's nodes: {', '.join(map(str, have))}")
        raise InvalidInput(f"numa_node={node} does not exist ({hint})")
    return node


def node_of_cpu(cpu: int, root: str | os.PathLike | None = None) -> int | None:
    """The node that holds ``cpu``, or ``None`` if no node lists it (or there is no NUMA information)."""
    for node, cpus in nodes(root).items():
        if cpu in cpus:
            return node
    return None


def current_cpu(stat_path: str | os.PathLike = "/proc/self/stat") -> int:
    """The CPU the calling thread last ran on (field 39 of ``/proc/self/stat``)."""
    text = Path(stat_path).read_text()
    # The command name (field 2) is in parentheses and may hold spaces: split after its last ')'.
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[36])  # field 39 overall; fields[0] here is field 3


def pin_to_node(node: int, root: str | os.PathLike | None = None, pid: int = 0) -> list[int]:
    """Restrict a process to the CPUs of one NUMA node (``os.sched_setaffinity``).

    Threads started afterwards inherit the mask; call it early, before the model and the cache are
    created, so that their memory is first touched on that node.

    Args:
        node: the node number (see ``nodes()``).
        root: the node directory to read (default ``/sys/devices/system/node``).
        pid: the process to pin (default 0: the caller).

    Returns:
        The CPUs the process may now run on.

    Raises:
        InvalidInput: no such node, or none of its CPUs is allowed to this process (cgroup cpuset);
            the message lists the nodes there are.
    """
    topology = nodes(root)
    if node not in topology:
        have = ", ".join(f"{n} (CPUs {_fmt(c)})" for n, c in topology.items()) or "none (no NUMA information)"
        raise InvalidInput(f"no NUMA node {node} with CPUs; nodes: {have}")
    cpus = topology[node]
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:
        raise InvalidInput(f"cannot pin to node {node} (CPUs {_fmt(cpus)}): {exc.strerror}; this process may "
                           f"use only CPUs {_fmt(sorted(os.sched_getaffinity(pid)))}") from None
    return sorted(os.sched_getaffinity(pid))


def choose_node(root: str | os.PathLike | None = None, pid: int = 0) -> int | None:
    """The node the calling process belongs to, for ``TieredCache(..., numa_node=...)``.

    Args:
        root: the node directory to read (default ``/sys/devices/system/node``).
        pid: the process to look at (default 0: the caller; another pid only for its affinity mask).

    Returns:
        ``None`` on a host with one node (or no NUMA information): no setting is needed. Otherwise the
        node holding every CPU the process may run on (it was pinned, by ``pin_to_node``, ``numactl``
        or a cpuset), or, when its CPUs span nodes, the node of the CPU it runs on right now: a hint
        only, as the scheduler may move it; pin it for a placement that holds.
    """
    topology = nodes(root)
    if len(topology) <= 1:
        return None
    allowed = os.sched_getaffinity(pid)
    holding = [n for n, cpus in topology.items() if allowed <= set(cpus)]
    if holding:
        return holding[0]
    return node_of_cpu(current_cpu(), root) if pid == 0 else None


def node_for_worker(index: int, root: str | os.PathLike | None = None) -> int | None:
    """Spread workers over nodes round-robin: worker ``index`` gets the ``index % n``-th node.

    Args:
        index: the worker's rank (0, 1, ...).
        root: the node directory to read (default ``/sys/devices/system/node``).

    Returns:
        A node number, or ``None`` on a single-node host (no setting needed).
    """
    if index < 0:
        raise InvalidInput(f"worker index must be >= 0, got {index}")
    topology = nodes(root)
    if len(topology) <= 1:
        return None
    order = list(topology)
    return order[index % len(order)]


def _fmt(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    start: int | None = None
    prev = -1
    for c in cpus:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)
