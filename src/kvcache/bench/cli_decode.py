"""``kvcache bench decode``: kvcache under each weights mode beside transformers and llama.cpp, in
the same run: decode after a chat prompt, prefill of long prompts, decode at a long context."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

DEFAULT_WEIGHTS, DEFAULT_PREFILL, DEFAULT_DEPTH = "file,q8,fp32", "512,2000,8000", 8000
QUICK_PREFILL, QUICK_DEPTH = "512", 512
DEPTH_KV = "int8"
HF_CACHES = ("none", "dynamic", "static")


def parse_lengths(text: str, limit: int) -> list[int]:
    """``--prefill`` lengths: distinct integers from 2 to the model's context ('' is none)."""
    out = []
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        if not raw.isdigit():
            raise InvalidParams(f"--prefill: {raw!r} is not a number of tokens")
        n = int(raw)
        if not 2 <= n <= limit:
            raise InvalidParams(f"--prefill: {n} tokens is outside 2..{limit} (the model's context)")
        out.append(n)
    return sorted(set(out))


def cmd_decode(args: argparse.Namespace) -> int:
    quick = args.quick
    new = args.new_tokens if args.new_tokens is not None else (16 if quick else 200)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    if new < 2 or repeats < 1:
        raise InvalidParams("--new-tokens must be >= 2 and --repeats >= 1")
    strategies = [s for s in (args.kv if args.kv is not None else "dynamic").split(",") if s]
    peers = [p for p in (args.peers if args.peers is not None
                         else "dynamic,llama.cpp" if quick else "dynamic,static,llama.cpp").split(",") if p]
    for p in peers:
        if p not in (*HF_CACHES, "llama.cpp"):
            raise InvalidParams(f"unknown peer {p!r}; choose from none, dynamic, static (transformers' caches), "
                                "llama.cpp")
    from kvcache.bench import llamapeer
    from kvcache.bench.cli import weights_list
    from kvcache.cache.config import parse_kv_spec
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    weights = weights_list(args, DEFAULT_WEIGHTS)
    for s in strategies:
        parse_kv_spec(s)  # a bad spec is refused before anything loads
    bin_dir = llamapeer.check_bin(args.llama_cpp_bin) if "llama.cpp" in peers else None
    resolved = resolve_model(args.model)
    context = ModelConfig.from_hf(read_config(resolved.path)).max_position
    prefill = parse_lengths(args.prefill if args.prefill is not None
                            else QUICK_PREFILL if quick else DEFAULT_PREFILL, context)
    depth = args.depth if args.depth is not None else (QUICK_DEPTH if quick else DEFAULT_DEPTH)
    if depth and not 2 <= depth <= context - 2:
        raise InvalidParams(f"--depth must be 0 (no long-context row) or 2..{context - 2} tokens "
                            f"(the model's context is {context}), got {depth}")
    depth_new = min(new, context - depth)
    depth_pair = ("file" if "file" in weights else weights[0]) if depth else None
    hf = [p for p in peers if p in HF_CACHES]

    from tqdm import tqdm

    import torch

    from kvcache.bench.context import english_prompt
    from kvcache.bench.decode import PROMPT, bench_decode, bench_depth, bench_prefill
    from kvcache.engine.llm import LLM
    from kvcache.envinfo import host_line

    per_mode = len(strategies) * repeats + len(prefill) * repeats
    total = len(weights) * per_mode + (repeats if depth else 0) + (len(hf) + len(prefill) * bool(hf)) * repeats
    bar = tqdm(total=total + len(weights) * ("llama.cpp" in peers), desc="bench decode", file=sys.stderr)
    rows, ids, prompts, depth_ids, name, kv_f32 = [], [], {}, [], "", 0
    for mode in weights:
        llm = LLM(args.model, threads=args.threads, weights=mode, prefix=False)
        if not ids:
            ids, name, kv_f32 = llm.encode(PROMPT, chat=True), llm.model_name, llm.config.kv_bytes_per_token()
            prompts = {n: english_prompt(llm, n) for n in prefill}
            depth_ids = english_prompt(llm, depth) if depth else []
        rows += bench_decode(llm, ids, strategies, new, repeats, bar.update)
        if prefill:
            rows += bench_prefill(llm, prompts, repeats, bar.update)
        if depth and mode == depth_pair:
            rows.append(bench_depth(llm, depth_ids, DEPTH_KV, depth_new, repeats, bar.update))
        del llm
        gc.collect()
    threads = torch.get_num_threads()
    if hf:
        from kvcache.bench import hfpeer
        from kvcache.models.loading import fp32_folder

        rows += hfpeer.rows(str(fp32_folder(args.model)), ids, hf, new, repeats, prompts, threads, bar.update)
    if "llama.cpp" in peers:
        from kvcache.bench.llamabench import Work

        work = Work(len(ids), ids, new, repeats, threads, prompts, depth_ids, depth_new, kv_f32)
        src = Path(str(resolved.source)) if resolved.source is not None else None
        rows += llamapeer.rows(src, weights, work, depth_pair, bin_dir, bar.update)
    bar.close()
    results = [r.summary() for r in rows]
    kind = llamapeer.kind(bin_dir) if "llama.cpp" in peers else None
    from kvcache.bench.cli import _meta

    meta = _meta(model=name, new_tokens=new, repeats=repeats, prompt_tokens=len(ids), weights=weights,
                 kv=strategies, prefill=prefill, depth=depth, depth_new_tokens=depth_new, depth_kv=DEPTH_KV,
                 llama_cpp=kind, llama_cpp_bin=str(bin_dir) if bin_dir else None, host=host_line())
    from kvcache.bench.decode_report import print_tables

    rat = print_tables(results, meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "ratios": rat}, indent=2))
    return 0


