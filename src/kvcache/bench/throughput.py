"""``kvcache bench throughput``: many requests at once, kvcache's continuous batching against transformers.

Same prompts (distinct slices of real English text, lengths spread evenly over a range), same
number of new tokens per request (EOS ignored), same thread count. Systems:

- kvcache: every request submitted at t0, served by the scheduler (continuous batching, chunked
  prefill over the paged cache), once per weights mode (the GGUF's own quantized types, fp32: the
  weights transformers runs);
- transformers ``generate`` one request at a time;
- transformers ``generate`` on one left-padded batch of all requests;
- transformers ``generate_batch`` (its own continuous batching), when it runs here.

Output throughput = all new tokens / wall time. TTFT is measured from t0 (the arrival of every
request), time per output token per request after its first; p50 and p99 over requests.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.measure import weights_label
from kvcache.bench.report import cell, run_meta
from kvcache.bench.rows import Headline, positive
from kvcache.cliargs import weights_list
from kvcache.errors import InvalidParams
from kvcache.peers.row import BatchRow

if TYPE_CHECKING:
    from kvcache.engine.llm import LLM
    from kvcache.engine.scheduler import SchedulerConfig

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "throughput"
ORDER = 70
OPTIONS = ("requests", "new_tokens", "peers", "kv", "weights")
QUICK = {"requests": 4, "new_tokens": 8, "peers": "padded"}

PEERS = ("sequential", "padded", "generate_batch")


def make_prompts(llm: LLM, count: int, shortest: int, longest: int) -> list[list[int]]:
    """``count`` prompts of token ids, lengths spread evenly from ``shortest`` to ``longest``, each
    a different slice of the built-in English text (no shared prefixes)."""
    from kvcache.eval.fidelity import builtin_text

    ids = llm.tokenizer.encode(builtin_text())
    out, at = [], 0
    for i in range(count):
        n = shortest + (longest - shortest) * i // max(1, count - 1)
        if at + n > len(ids):
            at = 0
        out.append(ids[at : at + n])
        at += n + 7
    return out


def bench_kvcache(llm: LLM, prompts: list[list[int]], new: int, config: SchedulerConfig, label: str) -> BatchRow:
    from kvcache.engine.params import SamplingParams

    res = BatchRow(f"kvcache continuous batching, {label}")
    res.weights = llm.weights
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    llm.generate_batch([p[:8] for p in prompts[:2]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    llm.clear_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate_batch(prompts, params, scheduler=config)
    res.wall_s = time.perf_counter() - t0
    for o in outs:
        res.new_tokens += len(o.token_ids)
        res.ttft_s.append(o.prefill_s)
        if len(o.token_ids) > 1:
            res.tpot_s.append(o.decode_s / (len(o.token_ids) - 1))
    return res


def ratios(results: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each kvcache row's throughput against transformers one at a time, its best batched mode, and
    kvcache's own fp32 row."""
    tok = {str(r["system"]): r["tok_s"] for r in results}
    seq = tok.get("transformers generate, one at a time")
    batched = [v for k, v in tok.items() if k.startswith("transformers") and "one at a time" not in k and v]
    best = max(batched) if batched else None  # type: ignore[type-var]
    fp32 = next((r["tok_s"] for r in results if str(r["system"]).startswith("kvcache") and r["weights"] == "fp32"),
                None)
    out = []
    for r in results:
        ours = r["tok_s"]
        if not str(r["system"]).startswith("kvcache") or not ours:
            continue
        out.append({"system": r["system"], "weights": r["weights"],
                    "vs_sequential": ours / seq if seq else None,  # type: ignore[operator]
                    "vs_best_batched": ours / best if best else None,  # type: ignore[operator]
                    "vs_fp32": ours / fp32 if fp32 else None})  # type: ignore[operator]
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.engine.llm import LLM
    from kvcache.engine.scheduler import SchedulerConfig

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

    modes = weights_list(args, "file,fp32")

    from tqdm import tqdm

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
        from kvcache.peers.hf_transformers import generate_batch, generate_padded, generate_sequential, transformers_model

        model = transformers_model(fp32_folder(args.model))
        runs = {"sequential": generate_sequential, "padded": generate_padded, "generate_batch": generate_batch}
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
        print(f"{r['system']:<{width}} {r['tok_s']:>7.1f} {r['wall_s']:>7.1f} {cell(r['ttft_p50_s'], '.2f'):>10} "
              f"{cell(r['ttft_p99_s'], '.2f'):>10} {cell(r['tpot_p50_ms']):>11} {cell(r['tpot_p99_ms']):>11}"
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
        meta = run_meta(model=name, requests=count, new_tokens=new, prompt_tokens=[lo, hi], kv=args.kv, weights=modes)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "ratios": ratio}, indent=2))
    return 0


def headline(d: dict) -> list[Headline]:
    """``bench throughput``: continuous batching's output tok/s beside each of transformers' ways."""
    meta, results = d["meta"], d["results"]
    k = next(r for r in results if r["system"].startswith("kvcache"))
    what = (f"output tok/s, {meta['requests']} requests at once, {meta['new_tokens']} new tokens each")
    return [Headline(what, positive(k["tok_s"]), p["system"], positive(p["tok_s"]), "tok/s")
            for p in results if not p["system"].startswith("kvcache")]


def plot(plt, data: dict):
    from kvcache.bench.plots import bars

    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    return bars(plt, [r["system"] for r in rows], [r["tok_s"] for r in rows],
                 f"output throughput, {data['meta'].get('requests')} requests at once", "new tokens / s")
