"""``kvcache bench cache-vs-none``: milliseconds per new token as the sequence grows, with and
without a KV cache, kvcache beside transformers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def cmd_cache_vs_none(args: argparse.Namespace) -> int:
    from kvcache.bench.cli import one_weights

    quick = args.quick
    weights = one_weights(args)
    new = args.new_tokens if args.new_tokens is not None else (64 if quick else 1000)
    budget = args.time_budget if args.time_budget is not None else (10.0 if quick else 120.0)
    size = 16 if quick else 100
    if new < 2:
        raise InvalidParams(f"--new-tokens must be >= 2, got {new}")
    if budget <= 0:
        raise InvalidParams(f"--time-budget must be positive, got {budget}")
    peers = [p for p in (args.peers if args.peers is not None else "dynamic,none").split(",") if p]
    for p in peers:
        if p not in ("dynamic", "none"):
            raise InvalidParams(f"unknown transformers cache {p!r} for cache-vs-none; choose from dynamic, none")

    from tqdm import tqdm

    import torch

    from kvcache.bench.cli import _fmt, _meta
    from kvcache.bench.nocache import bench_kvcache, bench_transformers
    from kvcache.engine.llm import LLM
    from kvcache.models.loading import fp32_folder

    llm = LLM(args.model, threads=args.threads, prefix=False, weights=weights)
    ids = llm.encode(PROMPT, chat=True)
    bar = tqdm(total=(2 + len(peers)) * (new - 1), desc="bench cache-vs-none", unit="tok", file=sys.stderr)
    # the time budget bounds the runs without a cache; those with one always finish
    runs = [bench_kvcache(llm, ids, spec, new, budget if spec == "none" else float("inf"), bar.update)
            for spec in ("dynamic", "none")]
    if peers:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(fp32_folder(args.model)), dtype=torch.float32).eval()
        runs += [bench_transformers(model, ids, p == "dynamic", new, budget if p != "dynamic" else float("inf"),
                                    bar.update) for p in peers]
    bar.close()
    results = [r.summary(size, new - 1) for r in runs]
    print(f"\ncache-vs-none: {llm.model_name}, greedy, {new} new tokens after a {len(ids)}-token prompt, "
          f"{llm.weights} weights, {torch.get_num_threads()} threads; mean ms per new token in each {size}-token "
          f"stretch (runs without a cache stop after {budget:.0f} s)")
    names = [f"{r['system']} {r['cache']}" for r in results]
    print(f"{'tokens':<11} " + " ".join(f"{n:>26}" for n in names))
    for b in range(len(results[0]["ms_per_token"])):  # type: ignore[arg-type]
        a = b * size
        label = f"{a}-{min(a + size, new - 1)}"
        print(f"{label:<11} " + " ".join(f"{_fmt(r['ms_per_token'][b]):>26}" for r in results))  # type: ignore[index]
    print(f"{'total s':<11} " + " ".join(f"{r['total_s']:>26.1f}" for r in results))
    print(f"{'tokens made':<11} " + " ".join(f"{r['tokens']:>26}" for r in results))
    base = {r["cache"]: r for r in results if r["system"] == "kvcache"}
    reached = [x for x in base["none"]["ms_per_token"] if x is not None]  # type: ignore[union-attr]
    if reached:
        ratio = reached[-1] / base["dynamic"]["ms_per_token"][len(reached) - 1]  # type: ignore[index]
        print(f"in the last stretch kvcache none completed, a token cost {ratio:.1f}x what it costs with the cache")
    for r in results:
        if r["stopped"]:
            print(f"{r['system']} {r['cache']}: {r['stopped']}")
    if args.json:
        meta = _meta(model=llm.model_name, weights=llm.weights, new_tokens=new, prompt_tokens=len(ids), bucket=size,
                     time_budget_s=budget)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0
