"""``kvcache bench hf``: one transformers model, its own caches against kvcache's through the bridge.

The same HF model object (fp32 weights of the converted folder), the same prompt of C tokens of
English prose, ``generate`` with N new tokens forced (EOS ignored), batch 1, greedy. Decode tok/s
is timed between the first and the last logits call of each run (prefill excluded); KV bytes are
what the cache holds after the run (tensors of transformers' caches; kvcache's pages in use plus
fp32 tails).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvcache.bench.rows import Headline, one, positive
from kvcache.errors import InvalidParams
from kvcache.peers.row import median

if TYPE_CHECKING:
    import torch

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "hf"
ORDER = 110
OPTIONS = ("new_tokens", "repeats", "kv", "peers", "contexts")
QUICK = {"contexts": "256", "new_tokens": 4, "kv": "dynamic", "peers": "dynamic"}

PEERS = ("dynamic", "static", "quantized")  # transformers' DynamicCache, StaticCache, QuantizedCache
DEFAULT_KV = "dynamic;static;int8;int4;int4,sinks=4,window=1024"


@dataclass
class HFRow:
    system: str
    cache: str
    context: int
    tok_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    tokens: int = 0
    note: str = ""

    def summary(self) -> dict[str, object]:
        return {"system": self.system, "cache": self.cache, "context": self.context,
                "tok_s": median(self.tok_s), "prefill_s": median(self.prefill_s),
                "kv_bytes": self.kv_bytes, "kv_bytes_per_token": self.kv_bytes / self.tokens if self.tokens else None,
                "note": self.note}


class _Clock:
    """A logits processor that only records when each step's logits arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages an object (a transformers cache layer) holds."""
    import torch

    seen = set() if seen is None else seen
    total = 0
    values = obj.__dict__.values() if hasattr(obj, "__dict__") else obj
    for v in values:
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += v.untyped_storage().nbytes()
        elif isinstance(v, (list, tuple)):
            total += tensor_bytes(v, seen)
    return total


def english_ids(tokenizer: Any, n: int) -> list[int]:
    from kvcache.eval.fidelity import builtin_text

    text, piece = builtin_text(), ""
    while True:
        piece += text + "\n\n"
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]


def _peer(model: Any, name: str, max_len: int) -> Any:
    from transformers import DynamicCache, QuantizedCache, StaticCache

    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return QuantizedCache(backend="fp8", config=model.config)  # quanto and hqq need extra packages


def run_one(model: Any, ids: torch.Tensor, make: Callable[[], Any], new: int) -> tuple[float, float, Any]:
    """-> (decode tok/s, prefill seconds, the cache after the run)."""
    import torch

    from transformers import LogitsProcessorList

    cache, clock = make(), _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, past_key_values=cache,
                       logits_processor=LogitsProcessorList([clock]), pad_token_id=model.config.eos_token_id)
    t = clock.times
    return (len(t) - 1) / max(t[-1] - t[0], 1e-9), t[0] - t0, cache


def bench_hf(model_dir: str, contexts: list[int], specs: list[str], peers: list[str], new: int, repeats: int,
             tick: Callable[[], object] | None = None) -> list[HFRow]:
    import torch

    from transformers import AutoTokenizer

    from kvcache.peers.hf_transformers import transformers_model
    from kvcache.hf import make_cache

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = transformers_model(model_dir)
    rows: list[HFRow] = []
    for ctx in contexts:
        ids = torch.tensor([english_ids(tok, ctx)])
        run_one(model, ids[:, :16], lambda: make_cache(model, "dynamic"), 2)  # warm-up
        systems: list[tuple[str, str, Callable[[], Any]]] = [
            ("transformers", {"dynamic": "DynamicCache", "static": "StaticCache", "quantized": "QuantizedCache(fp8)"}[p],
             lambda p=p: _peer(model, p, ctx + new)) for p in peers]
        for spec in specs:
            full = spec + (f",max_tokens={ctx + new}" if spec.split(",")[0] == "static" else "")
            systems.append(("kvcache.hf", spec, lambda full=full: make_cache(model, full)))
        for system, name, make in systems:
            row = HFRow(system, name, ctx)
            try:
                for _ in range(repeats):
                    tok_s, prefill, cache = run_one(model, ids, make, new)
                    row.tok_s.append(tok_s)
                    row.prefill_s.append(prefill)
                    if tick:
                        tick()
                row.tokens = ctx + new - 1
                if system == "kvcache.hf":
                    row.kv_bytes = cache.stats().bytes_used
                else:
                    row.kv_bytes = sum(tensor_bytes(layer) for layer in cache.layers)
                del cache
            except Exception as e:  # a peer that cannot run here gets a row saying why
                row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from tqdm import tqdm

    from kvcache.cliargs import split_specs
    from kvcache.models.loading import fp32_folder

    quick = args.quick
    new = args.new_tokens if args.new_tokens is not None else (8 if quick else 32)
    repeats = args.repeats if args.repeats is not None else 1
    contexts = [int(c) for c in (args.contexts or ("256" if quick else "512,4096")).split(",") if c]
    specs = split_specs(args.kv or ("dynamic;int4" if quick else DEFAULT_KV))
    peers = [p for p in (args.peers if args.peers is not None else ",".join(PEERS)).split(",") if p]
    if new < 2 or repeats < 1 or not contexts or min(contexts) < 1:
        raise InvalidParams("--new-tokens must be >= 2, --repeats >= 1, --contexts positive integers")
    for p in peers:
        if p not in PEERS:
            raise InvalidParams(f"unknown peer {p!r}; choose from {', '.join(PEERS)} (transformers' caches)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(fp32_folder(args.model))
    bar = tqdm(total=len(contexts) * (len(specs) + len(peers)) * repeats, desc="bench hf", file=sys.stderr)
    rows = bench_hf(model_dir, contexts, specs, peers, new, repeats, bar.update)
    bar.close()
    results = [r.summary() for r in rows]
    print(f"\nhf: {Path(model_dir).name}, {new} new tokens after each context, batch 1, fp32 weights, "
          f"{torch.get_num_threads()} threads, median of {repeats}; the same transformers model for every row")
    print(f"{'context':>7} {'system':<13} {'cache':<28} {'tok/s':>7} {'prefill s':>9} {'KV MB':>8} {'B/token':>8}")
    for r in results:
        if r["tok_s"] is None:
            print(f"{r['context']:>7} {r['system']:<13} {r['cache']:<28} {r['note']}")
            continue
        print(f"{r['context']:>7} {r['system']:<13} {r['cache']:<28} {r['tok_s']:>7.1f} {r['prefill_s']:>9.2f} "
              f"{r['kv_bytes'] / 1e6:>8.2f} {r['kv_bytes_per_token']:>8,.0f}")
    if args.json:
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "new_tokens": new, "repeats": repeats}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def headline(d: dict) -> list[Headline]:
    """``bench hf``: KV bytes held by kvcache's strategies through ``kvcache.hf`` beside
    transformers' DynamicCache at the longest context measured."""
    results = d["results"]
    ctx = max(r["context"] for r in results)
    ref = one(results, system="transformers", cache="DynamicCache", context=ctx)
    return [Headline(f"KV MB at {ctx} tokens, `{r['cache']}` through kvcache.hf", positive(r["kv_bytes"]) / 1e6,
                "transformers DynamicCache", positive(ref["kv_bytes"]) / 1e6, "MB", higher_better=False)
            for r in results if r["system"] == "kvcache.hf" and r["context"] == ctx
            and r["cache"] not in ("dynamic", "static")]


def plot(plt, data: dict[str, Any]):
    from kvcache.bench.plots import label

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
            ax.text(v, i, f" {label(v)}", va="center", fontsize=8)
    return fig
