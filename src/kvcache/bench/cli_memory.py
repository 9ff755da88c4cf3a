"""``kvcache bench memory``: resident memory and KV bytes per strategy (each in a fresh process),
beside transformers' caches; the longest context each strategy fits in a budget."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

DEFAULT_SPECS = "dynamic;static;fp16;int8;int4;sink;disk"
QUICK_SPECS = "dynamic;int4"


def cmd_memory(args: argparse.Namespace) -> int:
    from kvcache.bench.context import split_specs

    quick = args.quick
    context = args.context if args.context is not None else (256 if quick else 4096)
    new = args.new_tokens if args.new_tokens is not None else (4 if quick else 16)
    budget = args.budget if args.budget is not None else 4.0
    specs = split_specs(args.kv if args.kv is not None else (QUICK_SPECS if quick else DEFAULT_SPECS))
    peers = [p for p in (args.peers if args.peers is not None else ("dynamic" if quick else "dynamic,static")).split(",")
             if p]
    for p in peers:
        if p not in ("dynamic", "static"):
            raise InvalidParams(f"unknown transformers cache {p!r} for memory; choose from dynamic, static")
    if context < 16 or new < 1:
        raise InvalidParams("--context must be at least 16 and --new-tokens at least 1")
    if budget <= 0:
        raise InvalidParams(f"--budget must be positive GiB, got {budget}")

    from kvcache.bench.context import resolve_spec
    from kvcache.inspect.size import load_model_config, longest_context

    name, model_cfg = load_model_config(args.model)
    configs = {s: resolve_spec(s, context + new, model_cfg.max_position) for s in dict.fromkeys(specs)}

    from tqdm import tqdm

    from kvcache.bench.memory import run_probe
    from kvcache.fmt import human_bytes

    bar = tqdm(total=len(configs) + len(peers), desc="bench memory", file=sys.stderr)
    rows = []
    for spec, cfg in configs.items():
        rows.append(run_probe("kvcache", cfg.spec(), context, new, args.model, args.threads))
        rows[-1].cache = spec
        bar.update()
    for p in peers:
        rows.append(run_probe("transformers", {"dynamic": "DynamicCache", "static": "StaticCache"}[p], context, new,
                              args.model, args.threads))
        bar.update()
    bar.close()
    results = [r.summary() for r in rows]
    limit = int(budget * 2**30)
    for r, spec in zip(results, list(configs) + [None] * len(peers)):
        r["longest_context_in_budget"] = longest_context(model_cfg, configs[spec], 1, limit) if spec else None
    print(f"\nmemory: {name}, prompt of {context} tokens of English text + {new} new tokens, batch 1, fp32 weights, "
          "each run in a fresh process; request peak = peak resident memory during the request minus after loading")
    print(f"{'system':<13} {'cache':<14} {'RSS loaded':>10} {'RSS peak':>10} {'request peak':>12} {'KV used':>10} "
          f"{'KV allocated':>12} {'longest ctx in ' + format(budget, 'g') + ' GiB':>22}")
    for r in results:
        if r.get("rss_peak") is None:
            print(f"{r['system']:<13} {r['cache']:<14} {r['note']}")
            continue
        longest = r["longest_context_in_budget"]
        lc = "-" if longest is None else ("unbounded" if longest >= 2**40 else f"{longest:,}")
        print(f"{r['system']:<13} {r['cache']:<14} {human_bytes(r['rss_loaded']):>10} {human_bytes(r['rss_peak']):>10} "
              f"{human_bytes(r['request_peak']):>12} {human_bytes(r['kv_used']):>10} {human_bytes(r['kv_allocated']):>12} "
              f"{lc:>22}")
    print("KV used: bytes the cache holds for the tokens stored (scales and fp32 windows included); allocated: the "
          "pools' size; longest context: KV bytes alone, from `kvcache size`")
    if args.json:
        from kvcache.bench.cli import _meta

        meta = _meta(model=name, context=context, new_tokens=new, budget_gib=budget, kv=list(configs))
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0
