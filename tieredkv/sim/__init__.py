"""Trace-driven simulation of the eviction policies (``tieredkv simulate``).

- ``read_trace`` / ``write_trace``: Mooncake JSONL (``hash_ids``), our JSONL (``blocks``) and CSV;
- ``synthetic_trace``: a seeded generator (shared system prompts, multi-turn sessions, one-offs);
- ``simulate`` / ``simulate_tiered`` / ``run_simulation``: replay through the real policy code on a
  private slot state, reporting block and prefix hit ratios;
- ``belady`` (``optimal``): Belady's MIN, the block and prefix optimum, shown beside every result;
- ``plot_mrc``: miss-ratio curves (matplotlib), the optimum included;
- ``add_arguments`` / ``main``: the CLI subcommand.
"""

from .cli import add_arguments, format_table, main
from .optimal import belady, gap_closed, is_prefix_tree
from .plot import plot_mrc
from .replay import resolve_capacity, run_simulation, simulate, simulate_tiered
from .synthetic import synthetic_trace
from .trace import TRACE_FORMATS, Trace, read_trace, write_trace

__all__ = ["TRACE_FORMATS", "Trace", "add_arguments", "belady", "format_table", "gap_closed", "is_prefix_tree",
           "main", "plot_mrc", "read_trace",
           "resolve_capacity", "run_simulation", "simulate", "simulate_tiered", "synthetic_trace", "write_trace"]
