"""PNG plots of benchmark results (matplotlib, Agg), drawn from a suite's JSON file by the suite's
own ``plot(plt, data)``; the helpers the suites' plots share."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from kvcache.plotting import pyplot


def plot_suite(module: ModuleType, data_path: Path, out: Path) -> Path | None:
    """The suite's figure (its module's ``plot``), or None when it has none (or no data)."""
    draw = getattr(module, "plot", None)
    if draw is None or not data_path.is_file():
        return None
    data = json.loads(data_path.read_text())
    plt = pyplot()
    fig = draw(plt, data)
    if fig is None:
        return None
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def label(v: float) -> str:
    """A bar's label: three significant digits, never in exponent notation (2790, 42.3, 0.812)."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def bars(plt, labels: list[str], values: list[float], title: str, xlabel: str, log: bool = False):
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(labels)))
    ax.barh(range(len(values)), values, color="#4477aa")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    for i, v in enumerate(values):
        ax.text(v, i, f" {label(v)}", va="center", fontsize=8)
    return fig


def finish(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Label a line plot's axes, title it, grid it and show its legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
