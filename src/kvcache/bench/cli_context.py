"""``kvcache bench context`` (decode speed and KV bytes per strategy at several context lengths)
and ``kvcache bench growth`` (the cost of appending to the cache as it grows)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvcache.bench.cli import (
    DEFAULT_CONTEXTS, DEFAULT_MAX_CONTEXT, DEFAULT_SPECS, QUICK_CONTEXTS, QUICK_MAX_CONTEXT, QUICK_SPECS, _fmt, _meta,
    one_weights,
)
from kvcache.errors import InvalidParams


def cmd_context(args: argparse.Namespace) -> int:
    from kvcache.bench.context import (
        bench_context, check_contexts, parse_contexts, reference_spec, resolve_spec, split_specs, with_ratios,
    )
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    quick = args.quick
    weights = one_weights(args)
    new = args.new_tokens if args.new_tokens is not None else (16 if quick else 64)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 2)
    if new < 2:
        raise InvalidParams(f"--new-tokens must be >= 2, got {new}")
    if repeats < 1:
        raise InvalidParams(f"--repeats must be >= 1, got {repeats}")
    contexts = parse_contexts(args.contexts if args.contexts is not None
                              else QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS)
    specs = split_specs(args.kv if args.kv is not None else (QUICK_SPECS if quick else DEFAULT_SPECS))
    if not specs:
        raise InvalidParams("--kv needs at least one cache spec, e.g. --kv dynamic,int8")
    model_context = ModelConfig.from_hf(read_config(resolve_model(args.model).path)).max_position
    configs = {s: resolve_spec(s, max(contexts) + new, model_context) for s in dict.fromkeys(specs)}
    check_contexts(contexts, new, model_context, configs)

    from tqdm import tqdm

    import torch

    from kvcache.engine.llm import LLM

    llm = LLM(args.model, threads=args.threads, weights=weights)
    bar = tqdm(total=len(configs) * len(contexts) * repeats, desc="bench context", file=sys.stderr)
    rows = bench_context(llm, configs, contexts, new, repeats, bar.update)
    bar.close()
    ref = reference_spec(list(configs))
    results = with_ratios([r.summary() for r in rows], ref)
    width = max(12, *(len(s) for s in configs))
    print(f"\ncontext: {llm.model_name}, {new} new tokens after a prompt of C tokens of English text, batch 1, "
          f"{llm.weights} weights, {torch.get_num_threads()} threads, median of {repeats} (min-max)")
    if repeats > 1:
        print("repeats keep the prompt's K/V where the spec still holds them; prefill s: runs that prefilled it all")
    if ref is None:
        print("(no fp32 dynamic row in --kv: the ratio columns are empty)")
    header = (f"{'kv':<{width}} {'tok/s':>7} {'min-max':>13} {'prefill s':>9} {'KV B/token':>10} {'KV held':>9} "
              f"{'GB/s':>6} {'tok/s vs fp32':>13} {'bytes vs fp32':>13}")
    for c in contexts:
        print(f"\ncontext {c} tokens")
        print(header)
        for r in results:
            if r["context"] != c:
                continue
            held = f"{r['kv_bytes_used'] / 2**20:.1f} MiB" if r["kv_bytes_used"] else "-"
            tok = f"{_fmt(r['tok_s_min'])}-{_fmt(r['tok_s_max'])}"
            vs_tok = "-" if r["tok_s_vs_ref"] is None else f"{r['tok_s_vs_ref']:.2f}x"
            vs_b = "-" if r["bytes_vs_ref"] is None else f"{r['bytes_vs_ref']:.3f}x"
            line = (f"{r['spec']:<{width}} {_fmt(r['tok_s']):>7} {tok:>13} {_fmt(r['prefill_s'], '.2f'):>9} "
                    f"{r['kv_bytes_per_token']:>10.0f} {held:>9} {_fmt(r['gb_s'], '.2f'):>6} {vs_tok:>13} {vs_b:>13}")
            print(line + (f"  ({r['note']})" if r["note"] else ""))
    print("\nKV B/token: bytes the cache holds / tokens stored, after the last step (windows and fp32 tails "
          "included); GB/s: (weights + KV read per step) x tok/s")
    if args.json:
        meta = _meta(model=llm.model_name, weights=llm.weights, new_tokens=new, repeats=repeats, contexts=contexts,
                     kv=list(configs), reference=ref, prompt="pydoc_data.topics, first C tokens")
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def cmd_growth(args: argparse.Namespace) -> int:
    from kvcache.bench.growth import bench_growth, buckets
    from kvcache.engine.llm import default_threads
    from kvcache.models.config import ModelConfig
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

    import torch

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
        print(f"{r['bucket']:<11} {_fmt(r['kvcache_us']):>10} {_fmt(r['transformers_us']):>15} {ratio:>20}")
    med = {k: (statistics.median(v) if v else None) for k, v in totals.items()}
    ratio = f"{med['transformers'] / med['kvcache']:.1f}x" if med["transformers"] and med["kvcache"] else "-"
    print(f"{'total s':<11} {_fmt(med['kvcache'], '.2f'):>10} {_fmt(med['transformers'], '.2f'):>15} {ratio:>20}")
    print("kvcache: PagedKVCache reserve + write per layer (pages, pool doubling when full); "
          "DynamicCache: update per layer (torch.cat of the whole K and V)")
    if note:
        print(note)
    if args.json:
        meta = _meta(model=resolved.name, max_context=max_context, repeats=repeats, layers=model.num_layers,
                     kv_heads=model.num_kv_heads, head_dim=model.head_dim, note=note)
        total = {f"{k}_s": v for k, v in med.items()}
        total.update({f"{k}_s_all": v for k, v in totals.items()})
        Path(args.json).write_text(json.dumps({"meta": meta, "buckets": results, "total": total}, indent=2))
    return 0
