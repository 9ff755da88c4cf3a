"""``kvcache bench throughput``: many requests at once, kvcache's continuous batching against
transformers (one at a time, a padded batch, generate_batch)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

PEERS = ("sequential", "padded", "generate_batch")


def cmd_throughput(args: argparse.Namespace) -> int:
    quick = args.quick
    count = args.requests if args.requests is not None else (8 if quick else 32)
    new = args.new_tokens if args.new_tokens is not None else (32 if quick else 128)
    lo, hi = (32, 128) if quick else (128, 512)
    peers = [p for p in (args.peers if args.peers is not None else ",".join(PEERS)).split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise InvalidParams(f"unknown transformers mode {p!r}; choose from {', '.join(PEERS)}")
    if count < 1 or new < 2:
        raise InvalidParams("--requests must be at least 1 and --new-tokens at least 2")

    from kvcache.bench.cli import weights_list

    modes = weights_list(args, "file,fp32")

    import gc

    from tqdm import tqdm

    import torch

    from kvcache.bench.cli import _fmt, _meta
    from kvcache.bench.decode import weights_label
    from kvcache.bench.throughput import (
        bench_hf_generate_batch, bench_hf_padded, bench_hf_sequential, bench_kvcache, make_prompts, ratios, _hf_model,
    )
    from kvcache.engine.llm import LLM
    from kvcache.engine.scheduler import SchedulerConfig
    from kvcache.models.loading import fp32_folder

    hf_steps = (count if "sequential" in peers else 0) + len([p for p in peers if p != "sequential"])
    bar = tqdm(total=len(modes) + hf_steps, desc="bench throughput", file=sys.stderr)
    rows, prompts, name = [], [], ""
    for mode in modes:  # one model in memory at a time
        llm = LLM(args.model, kv=args.kv or "dynamic", threads=args.threads, weights=mode)
        prompts = prompts or make_prompts(llm, count, lo, hi)
        name = llm.model_name
        rows.append(bench_kvcache(llm, prompts, new, SchedulerConfig(max_batch_tokens=512, max_running=count),
                                  f"{weights_label(llm)} weights"))
        bar.update()
        del llm
        gc.collect()
    if peers:
        model = _hf_model(str(fp32_folder(args.model)))
        runs = {"sequential": bench_hf_sequential, "padded": bench_hf_padded, "generate_batch": bench_hf_generate_batch}
        for p in peers:
            rows.append(runs[p](model, prompts, new, bar.update))
    bar.close()
    results = [r.summary() for r in rows]
    ratio = ratios(results)
    width = max(38, *(len(str(r["system"])) for r in results))
    print(f"\nthroughput: {name}, {count} requests arriving at once, prompts of {lo}-{hi} tokens of English "
          f"text, {new} new tokens each (EOS ignored), {torch.get_num_threads()} threads; transformers runs fp32 "
          "weights")
    print(f"{'system':<{width}} {'tok/s':>7} {'wall s':>7} {'TTFT p50 s':>10} {'TTFT p99 s':>10} "
          f"{'TPOT p50 ms':>11} {'TPOT p99 ms':>11}")
    for r in results:
        if r["tok_s"] is None:
            print(f"{r['system']:<{width}} {r['note']}")
            continue
        print(f"{r['system']:<{width}} {r['tok_s']:>7.1f} {r['wall_s']:>7.1f} {_fmt(r['ttft_p50_s'], '.2f'):>10} "
              f"{_fmt(r['ttft_p99_s'], '.2f'):>10} {_fmt(r['tpot_p50_ms']):>11} {_fmt(r['tpot_p99_ms']):>11}"
              + (f"  ({r['note']})" if r["note"] else ""))
    for x in ratio:
        parts = [f"{x['system']}:"]
        if x["vs_fp32"] and x["weights"] != "fp32":
            parts.append(f"{x['vs_fp32']:.2f}x kvcache's fp32 weights;")
        if x["vs_sequential"]:
            parts.append(f"{x['vs_sequential']:.1f}x transformers one at a time (goal 5x);")
        if x["vs_best_batched"]:
            parts.append(f"{x['vs_best_batched']:.2f}x its best batched mode (goal 1.5x)")
        print(" ".join(parts).rstrip(";"))
    if args.json:
        meta = _meta(model=name, requests=count, new_tokens=new, prompt_tokens=[lo, hi], kv=args.kv, weights=modes)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "ratios": ratio}, indent=2))
    return 0
