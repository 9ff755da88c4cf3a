"""``kvcache bench memory``: resident memory and KV bytes per strategy (each in a fresh process),
beside transformers' caches; the weights each weights mode holds and what resident memory it
adds to a process that only imported torch; the longest context each strategy fits in a budget."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

DEFAULT_SPECS = "dynamic;static;fp16;int8;int4;sink;disk"
QUICK_SPECS = "dynamic;int4"
DEFAULT_WEIGHTS, QUICK_WEIGHTS = "file,q8,fp32", "file,fp32"


def cmd_memory(args: argparse.Namespace) -> int:
    from kvcache.bench.cli import weights_list
    from kvcache.bench.context import split_specs

    quick = args.quick
    context = args.context if args.context is not None else (256 if quick else 4096)
    new = args.new_tokens if args.new_tokens is not None else (4 if quick else 16)
    budget = args.budget if args.budget is not None else 4.0
    specs = split_specs(args.kv if args.kv is not None else (QUICK_SPECS if quick else DEFAULT_SPECS))
    peers = [p for p in (args.peers if args.peers is not None else "dynamic" if quick else "dynamic,static").split(",")
             if p]
    for p in peers:
        if p not in ("dynamic", "static"):
            raise InvalidParams(f"unknown transformers cache {p!r} for memory; choose from dynamic, static")
    if context < 16 or new < 1:
        raise InvalidParams("--context must be at least 16 and --new-tokens at least 1")
    if budget <= 0:
        raise InvalidParams(f"--budget must be positive GiB, got {budget}")
    modes = weights_list(args, QUICK_WEIGHTS if quick else DEFAULT_WEIGHTS)

    from kvcache.bench.context import resolve_spec
    from kvcache.inspect.size import load_model_config, longest_context

    name, model_cfg = load_model_config(args.model)
    configs = {s: resolve_spec(s, context + new, model_cfg.max_position) for s in dict.fromkeys(specs)}

    from tqdm import tqdm

    from kvcache.bench.memory import run_probe, torch_baseline

    # every spec under the first weights mode; the first spec under every other mode
    runs = [(modes[0], s) for s in configs] + [(m, next(iter(configs))) for m in modes[1:]]
    bar = tqdm(total=1 + len(runs) + len(peers), desc="bench memory", file=sys.stderr)
    baseline = torch_baseline()
    bar.update()
    rows = []
    for mode, spec in runs:
        rows.append(run_probe("kvcache", configs[spec].spec(), context, new, args.model, args.threads, mode))
        rows[-1].cache = spec
        bar.update()
    for p in peers:
        rows.append(run_probe("transformers", {"dynamic": "DynamicCache", "static": "StaticCache"}[p], context, new,
                              args.model, args.threads))
        bar.update()
    bar.close()
    results = [r.summary() for r in rows]
    limit = int(budget * 2**30)
    for r in results:
        spec = r["cache"] if r["system"] == "kvcache" else None
        r["longest_context_in_budget"] = longest_context(model_cfg, configs[spec], 1, limit) if spec else None
    _print(name, context, new, budget, baseline, results)
    if args.json:
        from kvcache.bench.cli import _meta

        meta = _meta(model=name, context=context, new_tokens=new, budget_gib=budget, kv=list(configs), weights=modes,
                     rss_torch_alone=baseline)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def _print(name: str, context: int, new: int, budget: float, baseline: int | None,
           results: list[dict[str, object]]) -> None:
    from kvcache.fmt import human_bytes

    base = "-" if baseline is None else human_bytes(baseline)
    print(f"\nmemory: {name}, each run in a fresh process; `python -c \"import torch\"` alone is {base} resident")
    print("\nweights, as each mode holds them (bytes by kind; RSS right after loading, and what that adds to "
          "torch alone)")
    print(f"{'system':<13} {'weights':<13} {'weights by kind':<46} {'total':>10} {'RSS loaded':>10} {'- torch':>10}")
    seen = set()
    for r in results:
        key = (r["system"], r.get("weights"))
        if r.get("rss_loaded") is None or key in seen:
            continue
        seen.add(key)
        kinds = r.get("weight_kinds") or {"fp32": r.get("weight_bytes", 0)}
        order = sorted(kinds.items(), key=lambda kv: -kv[1])  # type: ignore[union-attr]
        text = ", ".join(f"{k} {human_bytes(v)}" for k, v in order if v)
        added = "-" if baseline is None else human_bytes(int(r["rss_loaded"]) - baseline)  # type: ignore[call-overload]
        print(f"{r['system']:<13} {_label(r):<13} {text:<46} {human_bytes(r.get('weight_bytes') or 0):>10} "
              f"{human_bytes(r['rss_loaded']):>10} {added:>10}")
    print(f"\nrequests: a prompt of {context} tokens of English text + {new} new tokens, batch 1; request peak = "
          "peak resident memory during the request minus after loading")
    print(f"{'system':<13} {'weights':<13} {'cache':<14} {'RSS loaded':>10} {'RSS peak':>10} {'request peak':>12} "
          f"{'KV used':>10} {'KV allocated':>12} {'longest ctx in ' + format(budget, 'g') + ' GiB':>22}")
    for r in results:
        if r.get("rss_peak") is None:
            print(f"{r['system']:<13} {_label(r):<13} {r['cache']:<14} {r['note']}")
            continue
        longest = r["longest_context_in_budget"]
        lc = "-" if longest is None else ("unbounded" if longest >= 2**40 else f"{longest:,}")  # type: ignore[operator]
        print(f"{r['system']:<13} {_label(r):<13} {r['cache']:<14} {human_bytes(r['rss_loaded']):>10} "
              f"{human_bytes(r['rss_peak']):>10} {human_bytes(r['request_peak']):>12} {human_bytes(r['kv_used']):>10} "
              f"{human_bytes(r['kv_allocated']):>12} {lc:>22}")
    print("KV used: bytes the cache holds for the tokens stored (scales and fp32 windows included); allocated: the "
          "pools' size; longest context: KV bytes alone, from `kvcache size`")


def _label(r: dict[str, object]) -> str:
    """The weights as loaded (``file (Q4_1)``), else the mode asked for."""
    return str(r.get("weights_label") or r["weights"])
