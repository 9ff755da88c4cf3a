"""``kvcache bench SUITE``: run a suite, print a table, write JSON."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

SUITES = ("decode",)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks beside transformers, in the same run")
    b.add_argument("suite", help=f"suite to run: {', '.join(SUITES)}")
    b.add_argument("--model", "-m", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    b.add_argument("--new-tokens", type=int, default=200, help="new tokens per run (default 200)")
    b.add_argument("--repeats", type=int, default=3, help="timed runs per system (default 3)")
    b.add_argument("--kv", default="dynamic,static", help="kvcache strategies, comma-separated (default dynamic,static)")
    b.add_argument("--peers", default="dynamic,static",
                   help="transformers caches to run: none,dynamic,static (default dynamic,static; '' skips)")
    b.add_argument("--threads", type=int, default=None, help="torch threads for every system")
    b.add_argument("--quick", action="store_true", help="fewer tokens and one repeat")
    b.add_argument("--json", default=None, help="write results to this JSON file")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite not in SUITES:
        raise InvalidParams(f"unknown bench suite {args.suite!r}; suites: {', '.join(SUITES)}")
    if args.new_tokens < 2 or args.repeats < 1:
        raise InvalidParams("--new-tokens must be >= 2 and --repeats >= 1")
    from tqdm import tqdm

    import torch

    from kvcache.bench.decode import PROMPT, bench_kvcache, bench_transformers
    from kvcache.engine.llm import LLM
    from kvcache.models.loading import resolve_model

    new, repeats = (32, 1) if args.quick else (args.new_tokens, args.repeats)
    strategies = [s for s in args.kv.split(",") if s]
    peers = [s for s in args.peers.split(",") if s]
    for p in peers:
        if p not in ("none", "dynamic", "static"):
            raise InvalidParams(f"unknown transformers cache {p!r}; choose from none, dynamic, static")
    llm = LLM(args.model, threads=args.threads)
    bar = tqdm(total=(len(strategies) + len(peers)) * repeats, desc="bench decode", file=sys.stderr)
    rows = bench_kvcache(llm, strategies, new, repeats, bar.update)
    ids = llm.encode(PROMPT, chat=True)
    if peers:
        rows += bench_transformers(str(resolve_model(args.model).path), ids, peers, new, repeats, bar.update)
    bar.close()
    results = [r.summary() for r in rows]
    hf_best = max((r["tok_s"] or 0 for r in results if r["system"] == "transformers"), default=0)
    print(f"\ndecode: {llm.model_name}, prompt {len(ids)} tokens, {new} new tokens, batch 1, fp32, "
          f"{torch.get_num_threads()} threads, median of {repeats}")
    print(f"{'system':<13} {'cache':<16} {'tok/s':>8} {'min-max':>13} {'TTFT ms':>8} {'GB/s':>6} {'vs HF best':>10}")
    for r in results:
        if r["tok_s"] is None:
            print(f"{r['system']:<13} {r['cache']:<16} {r['note']}")
            continue
        ratio = f"{r['tok_s'] / hf_best:.2f}x" if hf_best else "-"
        print(f"{r['system']:<13} {r['cache']:<16} {r['tok_s']:>8.1f} {r['tok_s_min']:>6.1f}-{r['tok_s_max']:<6.1f} "
              f"{r['ttft_ms']:>8.0f} {r['gb_s']:>6.2f} {ratio:>10}")
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "new_tokens": new, "repeats": repeats, "prompt_tokens": len(ids)}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0
