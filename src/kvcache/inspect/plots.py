"""PNG figures: attention heatmaps, K/V matrices, fidelity against KV bytes (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from kvcache.plotting import pyplot


def heatmap(matrix: torch.Tensor, path: Path, title: str, rows: Sequence[str], cols: Sequence[str] | None,
            xlabel: str, ylabel: str) -> Path:
    """matrix: [R, C] -> a PNG with token labels on the axes that have them."""
    plt = pyplot()
    r, c = matrix.shape
    fig, ax = plt.subplots(figsize=(min(16, 2 + c * 0.32), min(16, 1.5 + r * 0.32)))
    im = ax.imshow(matrix.float().numpy(), aspect="auto", cmap="viridis")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if r <= 64:
        ax.set_yticks(range(r), [repr(t)[1:-1] for t in rows], fontsize=7)
    if cols is not None and c <= 64:
        ax.set_xticks(range(c), [repr(t)[1:-1] for t in cols], fontsize=7, rotation=90)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fidelity_plot(rows: Sequence[dict], path: Path, title: str) -> Path:
    """KL divergence and perplexity ratio against KV bytes per token, one point per strategy."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in rows:
        x = r["bytes_per_token"]
        a.scatter(x, r["kl"])
        a.annotate(r["spec"], (x, r["kl"]), fontsize=7)
        b.scatter(x, r["ppl"] / r["ppl_full"])
        b.annotate(r["spec"], (x, r["ppl"] / r["ppl_full"]), fontsize=7)
    a.set_xlabel("KV bytes per token")
    a.set_ylabel("KL(full || strategy), nats")
    b.set_xlabel("KV bytes per token")
    b.set_ylabel("perplexity / full cache's")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
