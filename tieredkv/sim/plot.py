"""Miss-ratio curves from a ``run_simulation`` result (matplotlib, an optional dependency)."""

from __future__ import annotations

import os

from tieredkv.errors import InvalidInput, MissingDependency

__all__ = ["plot_mrc"]


def plot_mrc(result: dict, path: str | os.PathLike, *, title: str | None = None) -> str:
    """Draw block and prefix miss ratio against capacity, one line per policy, into a PNG.

    When the result carries the optimum (``run_simulation(..., optimal=True)``), Belady's MIN is drawn
    in both panels as a dashed black line: the lowest miss ratio any policy can reach (on a
    prefix-tree trace, for prefix misses too).

    Args:
        result: what ``run_simulation`` returned.
        path: output image path.
        title: figure title (default: the trace name).

    Returns:
        The path written.

    Raises:
        MissingDependency: matplotlib is missing (``pip install 'tieredkv[plot]'``; an ``ImportError``).
        InvalidInput: the result has no rows.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependency("plotting miss-ratio curves needs matplotlib: pip install 'tieredkv[plot]'") from e
    rows = result.get("results") or []
    if not rows:
        raise InvalidInput("nothing to plot: the simulation result has no rows")
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    metrics = (("block_hit_ratio", "block miss ratio"), ("prefix_hit_ratio", "prefix miss ratio"))
    unique = result.get("unique_blocks") or 0
    for ax, (key, label) in zip(axes, metrics):
        for name, pts in by_policy.items():
            pts = sorted(pts, key=lambda r: r["capacity_blocks"])
            xs = [100.0 * r["capacity_blocks"] / unique if unique else r["capacity_blocks"] for r in pts]
            ax.plot(xs, [1.0 - r[key] for r in pts], marker="o", ms=3, label=name)
        best = sorted(result.get("optimal") or [], key=lambda r: r["capacity_blocks"])
        if best:
            xs = [100.0 * r["capacity_blocks"] / unique if unique else r["capacity_blocks"] for r in best]
            ax.plot(xs, [1.0 - r[key] for r in best], "k--", marker="s", ms=3, lw=1.6,
                    label="belady (optimum)")
        ax.set_xlabel("capacity (% of unique blocks)" if unique else "capacity (blocks)")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle(title or f"miss-ratio curves: {result.get('trace', '')} "
                          f"({result.get('requests', '?')} requests, {unique} unique blocks)")
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
