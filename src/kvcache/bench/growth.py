"""``kvcache bench growth``: the cost of appending one token's K/V (every layer) as the context grows.

kvcache's PagedKVCache writes into reserved pages (its pool doubles when full, so an append is
amortised O(1)); transformers' DynamicCache concatenates each layer's whole K and V tensors on
every update (O(context) per append). Both get the same pre-made fp32 K/V of one token per layer;
each append is timed with perf_counter, and the times are averaged over buckets of context
length: 0-1k, 1k-2k, 2k-4k, 4k-8k, ... (k = 1024).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.report import cell, run_meta
from kvcache.bench.rows import Headline, positive
from kvcache.errors import InvalidParams
from kvcache.peers.row import median

if TYPE_CHECKING:
    import torch
    from kvcache.models.config import ModelConfig

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "growth"
ORDER = 100
OPTIONS = ("repeats", "max_context")
QUICK = {"max_context": 512}

DEFAULT_MAX_CONTEXT, QUICK_MAX_CONTEXT = 8192, 2048


def buckets(max_context: int) -> list[tuple[int, int]]:
    """[start, end) context ranges: [0, 1024), then doubling, the last one cut at max_context."""
    if max_context < 2:
        raise InvalidParams(f"--max-context must be at least 2 tokens, got {max_context}")
    edges = [0, min(1024, max_context)]
    while edges[-1] < max_context:
        edges.append(min(edges[-1] * 2, max_context))
    return list(zip(edges[:-1], edges[1:]))


def bucket_label(start: int, end: int) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)

    return f"{k(start)}-{k(end)}"


@dataclass
class Bucket:
    start: int
    end: int
    kvcache_us: list[float] = field(default_factory=list)  # per repeat: mean microseconds per append
    transformers_us: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        kv, hf = median(self.kvcache_us), median(self.transformers_us)
        return {
            "bucket": bucket_label(self.start, self.end), "start": self.start, "end": self.end,
            "tokens": self.end - self.start,
            "kvcache_us": kv, "kvcache_us_min": min(self.kvcache_us, default=None),
            "kvcache_us_max": max(self.kvcache_us, default=None),
            "transformers_us": hf, "transformers_us_min": min(self.transformers_us, default=None),
            "transformers_us_max": max(self.transformers_us, default=None),
            "ratio": hf / kv if kv and hf is not None else None,
        }


def _per_bucket(times: list[float], ranges: list[tuple[int, int]]) -> list[float]:
    """Mean microseconds per append over each range of positions."""
    return [sum(times[a:b]) / (b - a) * 1e6 for a, b in ranges]


def _writer(cache) -> Callable[[int, object, int, torch.Tensor, torch.Tensor], None]:
    """``cache.write(layer, seq, start, k, v)``, or the same through the page pool where the
    cache has no write of its own."""
    import torch

    if hasattr(cache, "write"):
        return cache.write
    pool, ps = cache.pool, cache.page_size

    def write(layer: int, seq, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = torch.tensor([seq.pages[p // ps] * ps + p % ps for p in range(start, start + k.shape[0])])
        pool.write(layer, slots, k, v)

    return write


def grow_kvcache(model: ModelConfig, max_context: int, progress=None) -> list[float]:
    """Seconds of each append (reserve, write every layer, advance) from 0 to max_context tokens."""
    import torch

    from kvcache.cache.config import CacheConfig
    from kvcache.cache.paged import PagedKVCache

    cache = PagedKVCache(model, CacheConfig())
    write = _writer(cache)
    layers = model.num_layers
    torch.manual_seed(0)
    ks = [torch.randn(1, model.num_kv_heads, model.head_dim) for _ in range(layers)]
    vs = [torch.randn(1, model.num_kv_heads, model.head_dim) for _ in range(layers)]
    seq = cache.new_sequence()
    times = [0.0] * max_context
    clock = time.perf_counter
    with torch.inference_mode():
        for pos in range(max_context):
            t0 = clock()
            cache.reserve(seq, 1)
            for layer in range(layers):
                write(layer, seq, pos, ks[layer], vs[layer])
            seq.length += 1
            times[pos] = clock() - t0
            if progress and pos % 256 == 255:
                progress(256)
    cache.free(seq)
    return times


def bench_growth(model: ModelConfig, max_context: int, repeats: int, progress=None
                 ) -> tuple[list[Bucket], dict[str, list[float]], str]:
    """Per bucket the mean append time of each system (one value per repeat), the total seconds
    per repeat, and a note ('' or why transformers was skipped)."""
    from kvcache.peers.hf_transformers import dynamic_cache_appends

    ranges = buckets(max_context)
    rows = [Bucket(a, b) for a, b in ranges]
    totals: dict[str, list[float]] = {"kvcache": [], "transformers": []}
    note = ""
    for _ in range(repeats):
        kv = grow_kvcache(model, max_context, progress)
        totals["kvcache"].append(sum(kv))
        for row, us in zip(rows, _per_bucket(kv, ranges)):
            row.kvcache_us.append(us)
        hf = dynamic_cache_appends(model.num_layers, model.num_kv_heads, model.head_dim, max_context, progress)
        if hf is None:
            note = "transformers not installed: DynamicCache skipped"
            continue
        totals["transformers"].append(sum(hf))
        for row, us in zip(rows, _per_bucket(hf, ranges)):
            row.transformers_us.append(us)
    return rows, totals, note


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.models.config import ModelConfig
    from kvcache.engine.llm import default_threads
    from kvcache.models.loading import read_config, resolve_model

    max_context = args.max_context if args.max_context is not None else (
        QUICK_MAX_CONTEXT if args.quick else DEFAULT_MAX_CONTEXT)
    repeats = args.repeats if args.repeats is not None else 1
    if repeats < 1:
        raise InvalidParams(f"--repeats must be >= 1, got {repeats}")
    buckets(max_context)  # refuses a bad --max-context
    resolved = resolve_model(args.model)
    model = ModelConfig.from_hf(read_config(resolved.path))

    from tqdm import tqdm

    torch.set_num_threads(args.threads or default_threads())
    bar = tqdm(total=2 * max_context * repeats, desc="bench growth", unit="tok", file=sys.stderr)
    rows, totals, note = bench_growth(model, max_context, repeats, bar.update)
    bar.close()
    results = [r.summary() for r in rows]
    print(f"\ngrowth: appending one token's K/V to every layer ({model.num_layers} layers, {model.num_kv_heads} KV "
          f"heads, head_dim {model.head_dim}, fp32) from 0 to {max_context} tokens, {torch.get_num_threads()} "
          f"threads; mean microseconds per append, median of {repeats}")
    print(f"{'context':<11} {'kvcache us':>10} {'DynamicCache us':>15} {'DynamicCache/kvcache':>20}")
    for r in results:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        print(f"{r['bucket']:<11} {cell(r['kvcache_us']):>10} {cell(r['transformers_us']):>15} {ratio:>20}")
    med = {k: median(v) for k, v in totals.items()}
    ratio = f"{med['transformers'] / med['kvcache']:.1f}x" if med["transformers"] and med["kvcache"] else "-"
    print(f"{'total s':<11} {cell(med['kvcache'], '.2f'):>10} {cell(med['transformers'], '.2f'):>15} {ratio:>20}")
    print("kvcache: PagedKVCache reserve + write per layer (pages, pool doubling when full); "
          "DynamicCache: update per layer (torch.cat of the whole K and V)")
    if note:
        print(note)
    if args.json:
        meta = run_meta(model=resolved.name, max_context=max_context, repeats=repeats, layers=model.num_layers,
                        kv_heads=model.num_kv_heads, head_dim=model.head_dim, note=note)
        total = {f"{k}_s": v for k, v in med.items()}
        total.update({f"{k}_s_all": v for k, v in totals.items()})
        Path(args.json).write_text(json.dumps({"meta": meta, "buckets": results, "total": total}, indent=2))
    return 0


def headline(d: dict) -> list[Headline]:
    """``bench growth``: the mean time to append a token's K/V in the last bucket beside
    transformers' DynamicCache."""
    last = d["buckets"][-1]
    return [Headline(f"ms per K/V append, {last['bucket']} tokens", positive(last["kvcache_us"]) / 1e3,
                "transformers DynamicCache", positive(last["transformers_us"]) / 1e3, "ms", higher_better=False)]


def plot(plt, data: dict):
    from kvcache.bench.plots import finish

    rows = data.get("buckets") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [r["bucket"] for r in rows]
    for key, name in (("kvcache_us", "kvcache pages"), ("transformers_us", "transformers DynamicCache")):
        ax.plot(labels, [(r[key] or 0) / 1000 for r in rows], marker="o", label=name)
    finish(ax, "context", "ms per append (30 layers)", "appending one token's K/V")
    return fig
