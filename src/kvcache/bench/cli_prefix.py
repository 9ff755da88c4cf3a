"""``kvcache bench prefix``: TTFT cold, warm, restored from disk and Redis, against transformers'
prefill + deepcopy; hit rate and TTFT on a multi-turn chat workload."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

from kvcache.errors import InvalidParams


def cmd_prefix(args: argparse.Namespace) -> int:
    from kvcache.bench.cli import one_weights

    quick = args.quick
    weights = one_weights(args)
    system_tokens = args.system_tokens if args.system_tokens is not None else (256 if quick else 2000)
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    new = args.new_tokens if args.new_tokens is not None else (8 if quick else 24)
    sessions, turns = (2, 2) if quick else (4, 3)
    if system_tokens < 16:
        raise InvalidParams(f"--system-tokens must be at least 16, got {system_tokens}")
    if repeats < 1 or new < 1:
        raise InvalidParams("--repeats and --new-tokens must be at least 1")

    from tqdm import tqdm

    import torch

    from kvcache.bench.cli import _fmt, _meta
    from kvcache.bench.prefix import bench_chat, bench_kvcache, bench_transformers, system_text
    from kvcache.engine.llm import LLM
    from kvcache.models.loading import fp32_folder
    from kvcache.prefix.redis_local import local_redis

    llm = LLM(args.model, threads=args.threads, prefix=False, weights=weights)
    system = system_text(llm, system_tokens)
    bar = tqdm(total=5 * repeats + sessions * turns * 2, desc="bench prefix", file=sys.stderr)
    with (nullcontext(args.redis) if args.redis else local_redis()) as url:
        cases = bench_kvcache(llm, system, repeats, url, bar.update)
    cases.append(bench_transformers(str(fp32_folder(args.model)), llm, system, repeats, bar.update))
    chat = bench_chat(llm, system, sessions, turns, new, bar.update)
    bar.close()
    rows = [c.summary() for c in cases]
    by = {r["case"]: r["ttft_ms"] for r in rows}
    cold = rows[0]["ttft_ms"]
    print(f"\nprefix: {llm.model_name}, shared system prompt of {system_tokens} tokens of English text + a short "
          f"question, batch 1, {llm.weights} weights, {torch.get_num_threads()} threads; time to first token, "
          f"median of {repeats}")
    print(f"{'case':<34} {'TTFT ms':>9} {'min-max':>15} {'reused tok':>10} {'cold/this':>9}")
    for r in rows:
        if r["ttft_ms"] is None:
            print(f"{r['case']:<34} {r['note']}")
            continue
        rng = f"{r['ttft_ms_min']:.0f}-{r['ttft_ms_max']:.0f}"
        print(f"{r['case']:<34} {r['ttft_ms']:>9.1f} {rng:>15} {_fmt(r['reused_tokens'], '.0f'):>10} "
              f"{cold / r['ttft_ms']:>8.1f}x" + (f"  ({r['note']})" if r["note"] else ""))
    warm, hf = by.get("kvcache warm (RAM radix)"), by.get("transformers prefill + deepcopy")
    goals = []
    if warm and cold:
        goals.append(f"warm vs cold {cold / warm:.1f}x lower (goal 20x)")
    if warm and hf:
        goals.append(f"warm vs transformers deepcopy {hf / warm:.1f}x lower (goal 2x)")
    for tier in ("disk", "Redis"):
        t = by.get(f"kvcache restored from {tier}")
        if t and cold:
            goals.append(f"{tier} restore vs recompute {cold / t:.1f}x faster (goal 5x)")
    print("; ".join(goals))
    results_chat = [c.summary() for c in chat]
    print(f"\nchat: {sessions} sessions x {turns} turns, same system prompt, {new} new tokens per turn, "
          "turns interleaved round-robin")
    print(f"{'case':<38} {'hit rate':>8} {'TTFT p50 ms':>11} {'TTFT max ms':>11} {'sum TTFT s':>10}")
    for c in results_chat:
        print(f"{c['case']:<38} {c['hit_rate']:>8.1%} {_fmt(c['ttft_ms_p50'], '.0f'):>11} "
              f"{_fmt(c['ttft_ms_max'], '.0f'):>11} {c['ttft_s_total']:>10.2f}")
    if args.json:
        meta = _meta(model=llm.model_name, weights=llm.weights, system_tokens=system_tokens, repeats=repeats,
                     sessions=sessions, turns=turns, new_tokens=new)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows, "chat": results_chat}, indent=2))
    return 0
