"""PNG plots of benchmark results (matplotlib, Agg), drawn from a suite's JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcache.plotting import pyplot


def plot_suite(suite: str, data_path: Path, out: Path) -> Path | None:
    """The suite's figure, or None when it has none (or no data)."""
    if not data_path.is_file():
        return None
    data = json.loads(data_path.read_text())
    draw = {"context": _context, "prefix": _prefix, "throughput": _throughput, "cache-vs-none": _nocache,
            "memory": _memory, "decode": _decode, "growth": _growth, "hf": _hf,
            "serve": _serve}.get(suite)
    if draw is None:
        return None
    plt = pyplot()
    fig = draw(plt, data)
    if fig is None:
        return None
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _num(v: float) -> str:
    """A bar's label: three significant digits, never in exponent notation (2790, 42.3, 0.812)."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _bars(plt, labels: list[str], values: list[float], title: str, xlabel: str, log: bool = False):
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(labels)))
    ax.barh(range(len(values)), values, color="#4477aa")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    for i, v in enumerate(values):
        ax.text(v, i, f" {_num(v)}", va="center", fontsize=8)
    return fig


def _context(plt, data: dict[str, Any]):
    if data["meta"].get("mode") == "long":
        return _long(plt, data)
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec in dict.fromkeys(r["spec"] for r in rows):
        mine = sorted((r for r in rows if r["spec"] == spec), key=lambda r: r["context"])
        xs = [r["context"] for r in mine]
        a.plot(xs, [r["tok_s"] for r in mine], marker="o", label=spec)
        b.plot(xs, [r["kv_bytes_used"] / 2**20 for r in mine], marker="o", label=spec)
    for ax, ylabel, title in ((a, "decode tok/s", "speed against context"),
                              (b, "KV held (MiB)", "KV memory against context")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _long(plt, data: dict[str, Any]):
    """``bench context --long``: decode tok/s against the context, one line per KV encoding and
    peer; beside it prefill tok/s against the prompt's length."""
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, test in ((a, "decode"), (b, "prefill")):
        mine = [r for r in rows if r["test"] == test]
        for key in dict.fromkeys((r["system"], r["kv"]) for r in mine):
            line = sorted((r for r in mine if (r["system"], r["kv"]) == key), key=lambda r: r["context"])
            style = "-" if key[0] == "kvcache" else "--"
            ax.plot([r["context"] for r in line], [r["tok_s"] for r in line], style, marker="o",
                    label=f"{key[0]} {key[1]}")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["context"] for r in mine})
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.set_xlabel("context before decoding (tokens)" if test == "decode" else "prompt (tokens)")
        ax.set_ylabel("new tokens/s" if test == "decode" else "prompt tokens/s")
        ax.set_title("decode at depth" if test == "decode" else "prefill")
        ax.grid(alpha=0.3)
        if mine:
            ax.legend(fontsize=8)
    fig.suptitle(f"{data['meta'].get('model')}, {data['meta'].get('weights')} weights, "
                 f"read bandwidth {data['meta'].get('read_gb_s')} GB/s", fontsize=10)
    return fig


def _prefix(plt, data: dict[str, Any]):
    rows = [r for r in data["results"] if r.get("ttft_ms")]
    if not rows:
        return None
    return _bars(plt, [r["case"] for r in rows], [r["ttft_ms"] for r in rows],
                 f"time to first token, {data['meta'].get('system_tokens')}-token shared prompt (log scale)",
                 "TTFT (ms)", log=True)


def _throughput(plt, data: dict[str, Any]):
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    return _bars(plt, [r["system"] for r in rows], [r["tok_s"] for r in rows],
                 f"output throughput, {data['meta'].get('requests')} requests at once", "new tokens / s")


def _decode(plt, data: dict[str, Any]):
    """One panel per test (decode, prefill at each length, decode at depth): tok/s per system."""
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    tests = list(dict.fromkeys((r.get("test", "decode"), r.get("tokens", 0)) for r in rows))
    fig, axes = plt.subplots(len(tests), 1, figsize=(8, sum(0.6 + 0.4 * len(_of(rows, t)) for t in tests)),
                             squeeze=False)
    for ax, t in zip(axes[:, 0], tests):
        mine = _of(rows, t)
        values = [r["tok_s"] for r in mine]
        ax.barh(range(len(mine)), values, color=["#4477aa" if r["system"] == "kvcache" else "#aa7744" for r in mine])
        ax.set_yticks(range(len(mine)), [f"{r['system']} {r.get('weights', '')} {r['cache']}" for r in mine])
        ax.invert_yaxis()
        name, n = t
        ax.set_title({"decode": "decode, batch 1 (new tokens/s)", "prefill": f"prefill of {n} tokens (tokens/s)",
                      "depth": f"decode after {n} tokens of context (new tokens/s)"}.get(name, name), fontsize=9)
        for i, v in enumerate(values):
            ax.text(v, i, f" {_num(v)}", va="center", fontsize=8)
    return fig


def _of(rows: list[dict[str, Any]], test: tuple[str, int]) -> list[dict[str, Any]]:
    return [r for r in rows if (r.get("test", "decode"), r.get("tokens", 0)) == test]


def _hf(plt, data: dict[str, Any]):
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.8 + 0.45 * len(rows)))
    labels = [f"{r['context']}: {r['system']} {r['cache']}" for r in rows]
    for ax, values, title in ((a, [r["tok_s"] for r in rows], "decode tok/s (same transformers model)"),
                              (b, [r["kv_bytes"] / 2**20 for r in rows], "KV held (MiB)")):
        ax.barh(range(len(rows)), values, color="#4477aa")
        ax.set_yticks(range(len(rows)), labels if ax is a else [""] * len(rows))
        ax.invert_yaxis()
        ax.set_title(title)
        for i, v in enumerate(values):
            ax.text(v, i, f" {_num(v)}", va="center", fontsize=8)
    return fig


def _nocache(plt, data: dict[str, Any]):
    size = data["meta"]["bucket"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in data["results"]:
        ys = [y for y in r["ms_per_token"] if y is not None]
        ax.plot([size * (i + 0.5) for i in range(len(ys))], ys, marker="o", label=f"{r['system']} {r['cache']}")
    ax.set_yscale("log")
    ax.set_xlabel("new token index")
    ax.set_ylabel("ms per new token (log)")
    ax.set_title("cost per token as the sequence grows, with and without a KV cache")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _memory(plt, data: dict[str, Any]):
    rows = [r for r in data["results"] if r.get("rss_peak")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(rows)))
    labels = [f"{r['system']} {r.get('weights_label') or r.get('weights', '')} {r['cache']}" for r in rows]
    peak = [r["request_peak"] / 2**20 for r in rows]
    kv = [r["kv_used"] / 2**20 for r in rows]
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], peak, height=0.4, label="request peak RSS (MiB)", color="#aa4466")
    ax.barh([i + 0.2 for i in y], kv, height=0.4, label="KV held (MiB)", color="#4477aa")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title(f"memory of one request, {data['meta'].get('context')}-token prompt")
    ax.legend(fontsize=8)
    return fig


def _growth(plt, data: dict[str, Any]):
    rows = data.get("buckets") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [r["bucket"] for r in rows]
    for key, name in (("kvcache_us", "kvcache pages"), ("transformers_us", "transformers DynamicCache")):
        ax.plot(labels, [(r[key] or 0) / 1000 for r in rows], marker="o", label=name)
    ax.set_xlabel("context")
    ax.set_ylabel("ms per append (30 layers)")
    ax.set_title("appending one token's K/V")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _serve(plt, data: dict[str, Any]):
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    meta = data["meta"]
    return _bars(plt, [f"{r['system']}, {r['streams']} streams" for r in rows], [r["tok_s"] for r in rows],
                 f"serving, {meta.get('prompt_tokens')}-token prompts, {meta.get('new_tokens')} out",
                 "output tokens per second")
