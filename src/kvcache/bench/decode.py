"""``kvcache bench decode``: kvcache under each weights mode beside transformers and llama.cpp, in
the same run: decode after a chat prompt, prefill of long prompts, decode at a long context.

kvcache's side is measured here, on one loaded model per weights mode: new-token tok/s and time to
first token, prompt tok/s of a fresh prefill, and decode at a long context. The peers run in child
processes (peers/hf_transformers.py, peers/llama_bench.py). Rows are ``peers.row.Row``, the shape every
system's rows share; the tables print each kvcache row's ratio against the peers measured in the
same run on the weights it is paired with.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.measure import english_prompt, pregrow, use_config, weight_bytes, weights_label
from kvcache.bench.report import cell, run_meta
from kvcache.bench.rows import Headline, beside_same_file, model_name, one, positive
from kvcache.cliargs import weights_list
from kvcache.errors import InvalidParams, KVCacheError
from kvcache.peers.row import Row, Tick, step_bytes

if TYPE_CHECKING:
    from kvcache.engine.llm import LLM
    from kvcache.engine.runner import ModelRunner

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "decode"
ORDER = 10
OPTIONS = ("new_tokens", "repeats", "rounds", "kv", "peers", "weights", "prefill", "depth", "llama_cpp_bin", "profile")
QUICK = {"new_tokens": 16, "repeats": 1, "peers": "dynamic", "weights": "file,q8,fp32", "prefill": "128", "depth": 128}
QUICK_LLAMA_CPP = {"peers": "dynamic,llama.cpp"}

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
DEFAULT_WEIGHTS, DEFAULT_PREFILL, DEFAULT_DEPTH = "file,q8,fp32", "512,2000,8000", 8000
QUICK_PREFILL, QUICK_DEPTH = "512", 512
DEPTH_KV = "int8"
HF_CACHES = ("none", "dynamic", "static")


def _runner(llm: LLM, spec: str) -> ModelRunner:
    from kvcache.cache.config import parse_kv_spec

    return use_config(llm, parse_kv_spec(spec))


def bench_decode(llm: LLM, ids: list[int], strategies: list[str], new: int, repeats: int,
                 tick: Tick | None = None) -> list[Row]:
    """Decode after the prompt ``ids``, one row per cache strategy."""
    from kvcache.engine.params import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    wbytes, label = weight_bytes(llm.model), weights_label(llm)
    rows = []
    for strat in strategies:
        _runner(llm, strat)
        row = Row("kvcache", label, strat, pair=llm.weights, tokens=len(ids))
        llm.generate([ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(repeats):
            r = llm.generate([ids], params)[0]
            row.tok_s.append(r.decode_tok_s)
            row.ttft_s.append(r.prefill_s)
            kv = llm.config.kv_bytes_per_token() if strat != "none" else 0
            row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * r.decode_tok_s / 1e9)
            if tick:
                tick()
        rows.append(row)
    return rows


def bench_prefill(llm: LLM, prompts: dict[int, list[int]], repeats: int, tick: Tick | None = None) -> list[Row]:
    """Prompt tokens per second of one runner step over a fresh sequence (dynamic fp32 cache),
    one row per prompt length."""
    runner = _runner(llm, "dynamic")
    pregrow(runner, max(prompts))
    warm = runner.new_sequence()
    runner.step([warm], [next(iter(prompts.values()))[:16]])  # warm-up
    runner.free(warm)
    rows = []
    for n, ids in prompts.items():
        row = Row("kvcache", weights_label(llm), "dynamic", pair=llm.weights, test="prefill", tokens=n)
        for _ in range(repeats):
            seq = runner.new_sequence()
            t0 = time.perf_counter()
            runner.step([seq], [ids])
            row.tok_s.append(n / (time.perf_counter() - t0))
            runner.free(seq)
            if tick:
                tick()
        rows.append(row)
    return rows


def bench_depth(llm: LLM, ids: list[int], spec: str, new: int, repeats: int, tick: Tick | None = None) -> Row:
    """Decode ``new`` tokens after a context of ``len(ids)`` tokens held in a ``spec`` cache; the
    context is prefilled once and kept, every repeat decodes from the same point."""
    from kvcache.engine.params import SamplingParams

    runner = _runner(llm, spec)
    pregrow(runner, len(ids) + new)
    row = Row("kvcache", weights_label(llm), spec, pair=llm.weights, test="depth", tokens=len(ids))
    from kvcache.engine.generate import RequestRun

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    seq = runner.new_sequence()
    wbytes = weight_bytes(llm.model)
    try:
        for _ in range(repeats):
            run = RequestRun(runner, llm.tokenizer, ids, params, seq=seq, keep_seq=True)
            for _ in run:
                pass
            r = run.result
            row.tok_s.append(r.decode_tok_s)
            if r.cached_tokens == 0:
                row.ttft_s.append(r.prefill_s)
            st = r.kv_stats
            kv = st.bytes_used / st.tokens_stored if st is not None and st.tokens_stored else 0.0
            row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * r.decode_tok_s / 1e9)
            if tick:
                tick()
    finally:
        runner.free(seq)
    return row


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


def profile_decode(llm: LLM, ids: list[int], new: int, repeats: int) -> dict[str, float]:
    """Where a decode step's time goes: in the native kernels, or in the host code around them
    (Python, torch's small operations, the sampler). Each repeat runs one request of ``1 + new``
    tokens step by step and times its ``new`` decode steps alone, from the end of the step that
    ran the prompt to the end of the request, in wall time and in the kernels' own time
    (``kernels.profile``, on before the model loaded): the prompt's time never enters (a
    difference of two runs, each with its prompt, could come out below zero on a busy host).
    Medians over the repeats, per step."""
    from kvcache.engine.params import SamplingParams
    from kvcache import kernels

    def timed(n: int) -> tuple[float, float, float]:
        run = llm.request(ids, SamplingParams(max_tokens=1 + n, ignore_eos=True))
        marks = []  # (calls, kernel seconds, wall) after each step from the one that gave the first token
        for _ in run.steps():
            if any(s.tokens for s in run.request.samples):
                marks.append((*kernels.profiled(), time.perf_counter()))
        if len(marks) < 2:
            raise KVCacheError(f"the profiled request ran {len(marks)} step(s) with tokens: no decode step to time")
        (calls0, in0, t0), (calls1, in1, t1), steps = marks[0], marks[-1], len(marks) - 1
        return (t1 - t0) / steps, (in1 - in0) / steps, (calls1 - calls0) / steps

    timed(2)  # warm-up
    walls, inside, calls = [], [], []
    for _ in range(repeats):
        w, k, c = timed(new)
        walls.append(w)
        inside.append(k)
        calls.append(c)
    step, kern = statistics.median(walls), statistics.median(inside)
    return {"step_ms": step * 1e3, "kernels_ms": kern * 1e3, "host_ms": (step - kern) * 1e3,
            "host_share": (step - kern) / step if step > 0 else 0.0, "calls_per_step": statistics.median(calls)}


def run_profile(args: argparse.Namespace, new: int, repeats: int) -> int:
    """``bench decode --profile``: one decode after the chat prompt, split into the kernels' time
    and the host's time outside them, per step."""
    from kvcache.engine.llm import LLM
    from kvcache import kernels
    from kvcache.envinfo import host_line

    kernels.profile()  # before the model loads: every native call it makes is counted
    mode = weights_list(args, DEFAULT_WEIGHTS)[0]
    spec = [s for s in (args.kv or "dynamic").split(",") if s][0]  # the first strategy named
    llm = LLM(args.model, threads=args.threads, weights=mode, prefix=False, kv=spec)
    ids = llm.encode(PROMPT, chat=True)
    p = profile_decode(llm, ids, new, repeats)
    print(f"\nbench decode --profile: {llm.model_name}, weights {mode}, kv {spec}, {len(ids)}-token prompt, "
          f"{new} new tokens, median of {repeats}; {host_line()}")
    print(f"decode step {p['step_ms']:.2f} ms: in the kernels {p['kernels_ms']:.2f} ms, "
          f"outside them {p['host_ms']:.2f} ms ({100 * p['host_share']:.1f}% of the step); "
          f"{p['calls_per_step']:.0f} native calls a step")
    if args.json:
        meta = run_meta(model=llm.model_name, new_tokens=new, repeats=repeats, weights=[mode], kv=[spec],
                        prompt_tokens=len(ids), host=host_line())
        Path(args.json).write_text(json.dumps({"meta": meta, "profile": p}, indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    from kvcache.cache.config import parse_kv_spec
    from kvcache.engine.llm import LLM

    quick = args.quick
    new = args.new_tokens if args.new_tokens is not None else (16 if quick else 200)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    # the bandwidth probe's vector: a quarter of it under --quick (still far past any cache; faulting
    # in a GiB took 2.4 s of a 12 s quick run)
    read_gib = 0.25 if quick else 1.0
    rounds = args.rounds if args.rounds is not None else 1
    if new < 2 or repeats < 1:
        raise InvalidParams("--new-tokens must be >= 2 and --repeats >= 1")
    if getattr(args, "profile", False):
        for s in (args.kv or "dynamic").split(","):
            parse_kv_spec(s)
        return run_profile(args, new, repeats)
    if rounds < 1:
        raise InvalidParams("--rounds must be >= 1")
    strategies = [s for s in (args.kv if args.kv is not None else "dynamic").split(",") if s]
    peers = [p for p in (args.peers if args.peers is not None
                         else "dynamic,llama.cpp" if quick else "dynamic,static,llama.cpp").split(",") if p]
    for p in peers:
        if p not in (*HF_CACHES, "llama.cpp"):
            raise InvalidParams(f"unknown peer {p!r}; choose from none, dynamic, static (transformers' caches), "
                                "llama.cpp")
    from kvcache.peers import llama_bench
    from kvcache.peers.llama_cpp import check_bin
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    weights = weights_list(args, DEFAULT_WEIGHTS)
    for s in strategies:
        parse_kv_spec(s)  # a bad spec is refused before anything loads
    bin_dir = check_bin(args.llama_cpp_bin) if "llama.cpp" in peers else None
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

    from kvcache.envinfo import host_line

    per_mode = len(strategies) * repeats + len(prefill) * repeats
    total = len(weights) * per_mode + (repeats if depth else 0) + (len(hf) + len(prefill) * bool(hf)) * repeats
    bar = tqdm(total=rounds * (total + len(weights) * ("llama.cpp" in peers)), desc="bench decode", file=sys.stderr)
    from kvcache.bench.measure import products_bandwidth, read_bandwidth

    pooled: dict[tuple[str, ...], Row] = {}
    products: dict[str, float] = {}  # weights mode -> the products' best read of its weights, GB/s
    ids, prompts, depth_ids, name, kv_f32, macs, read_gb_s, share = [], {}, [], "", 0, 0, 0.0, 1.0
    for _ in range(rounds):  # every system once a round, in turn: the host's speed drifts over minutes
        rows: list[Row] = []
        for mode in weights:
            llm = LLM(args.model, threads=args.threads, weights=mode, prefix=False)
            if not ids:
                ids, name, kv_f32 = llm.encode(PROMPT, chat=True), llm.model_name, llm.config.kv_bytes_per_token()
                macs = projection_macs(llm.config)
                share = weight_bytes(llm.model) / max(1, llm.model.weight_bytes())  # what a step reads
                prompts = {n: english_prompt(llm, n) for n in prefill}
                depth_ids = english_prompt(llm, depth) if depth else []
            rows += bench_decode(llm, ids, strategies, new, repeats, bar.update)
            prod = products_bandwidth(llm.model)
            if prod is not None:
                products[mode] = max(products.get(mode, 0.0), prod)
            if prefill:
                rows += bench_prefill(llm, prompts, repeats, bar.update)
            if depth and mode == depth_pair:
                rows.append(bench_depth(llm, depth_ids, DEPTH_KV, depth_new, repeats, bar.update))
            del llm
            gc.collect()
        threads = torch.get_num_threads()
        if hf:
            from kvcache.peers import hf_transformers
            from kvcache.models.loading import fp32_folder

            rows += hf_transformers.rows(str(fp32_folder(args.model)), ids, hf, new, repeats, prompts, threads, bar.update)
        if "llama.cpp" in peers:
            from kvcache.peers.llama_bench import Work

            work = Work(len(ids), ids, new, repeats, threads, prompts, depth_ids, depth_new, kv_f32, share)
            src = Path(str(resolved.source)) if resolved.source is not None else None
            rows += llama_bench.rows(src, weights, work, depth_pair, bin_dir, bar.update)
        read_gb_s = max(read_gb_s, read_bandwidth(threads, read_gib))  # the best the memory gave in any round
        pool_rows(pooled, rows)
    bar.close()
    rows = list(pooled.values())
    results = [r.summary() for r in rows]
    kind = llama_bench.kind(bin_dir) if "llama.cpp" in peers else None
    from kvcache import kernels

    peak = kernels.int8_peak(0.1 if quick else 0.3)
    meta = run_meta(model=name, new_tokens=new, repeats=repeats, rounds=rounds, prompt_tokens=len(ids),
                    weights=weights, read_gb_s=round(read_gb_s, 1), read_gib=read_gib,
                    int8_peak_gmacs=round(peak / 1e9) if peak else None,
                    products_gb_s={m: round(v, 1) for m, v in products.items()},
                    macs_per_token=macs,
                    kv=strategies, prefill=prefill, depth=depth, depth_new_tokens=depth_new, depth_kv=DEPTH_KV,
                    llama_cpp=kind, llama_cpp_bin=str(bin_dir) if bin_dir else None, host=host_line())
    rat = print_tables(results, meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "ratios": rat}, indent=2))
    return 0


def pool_rows(pooled: dict[tuple[str, ...], Row], rows: list[Row]) -> None:
    """Add one round's rows to ``pooled``: a row measured again gets its samples added (a note
    stays only while no round measured it)."""
    for r in rows:
        key = (r.system, r.weights, r.cache, r.pair, r.test, str(r.tokens))
        have = pooled.get(key)
        if have is None:
            pooled[key] = r
            continue
        have.tok_s += r.tok_s
        have.ttft_s += r.ttft_s
        have.gb_s += r.gb_s
        have.note = "" if have.tok_s else have.note or r.note


def projection_macs(cfg: object) -> int:
    """Multiply-adds of one token through every layer's projections (attention q, k, v, o and the
    gated MLP; the output head is left out: a prefill computes it for the last token only)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # type: ignore[attr-defined]
    hq, hkv = cfg.num_heads, cfg.num_kv_heads  # type: ignore[attr-defined]
    return cfg.num_layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * f)  # type: ignore[attr-defined]


REPORT_PEERS = ("llama.cpp", "transformers")  # the systems a kvcache row is compared with


def ratios(results: list[dict[str, object]]) -> list[dict[str, object]]:
    """kvcache tok/s over each peer's on the same test, length and paired weights (transformers:
    its fastest cache). ``file`` pairs with llama.cpp's GGUF as shipped, ``q8`` with its Q8_0,
    ``fp32`` with its F32 and with transformers."""
    out = []
    for r in results:
        if r["system"] != "kvcache" or not r["tok_s"]:
            continue
        for peer in REPORT_PEERS:
            same = [p for p in results if p["system"] == peer and p["tok_s"] and p["test"] == r["test"]
                    and p["tokens"] == r["tokens"] and p["pair"] == r["pair"]]
            if not same:
                continue
            best = max(same, key=lambda p: p["tok_s"])  # type: ignore[arg-type,return-value]
            out.append({"test": r["test"], "tokens": r["tokens"], "kvcache": f"{r['weights']} {r['cache']}",
                        "peer": f"{peer} {best['weights']} {best['cache']}",
                        "ratio": r["tok_s"] / best["tok_s"]})  # type: ignore[operator]
    return out


def _head(title: str, cols: str) -> None:
    print(f"\n{title}")
    print(f"{'system':<13} {'weights':<18} {'cache':<13} " + cols)


def _line(r: dict[str, object], cols: str) -> None:
    print(f"{r['system']:<13} {str(r['weights']):<18} {str(r['cache']):<13} " + cols)


def print_tables(results: list[dict[str, object]], meta: dict[str, object]) -> list[dict[str, object]]:
    """Print every table and the ratios; returns the ratios."""
    rep, rounds = meta["repeats"], meta.get("rounds", 1)
    runs = f"median of {rep}" if rounds == 1 else f"{rounds} rounds of every system in turn, median of {rep * rounds}"
    print(f"\ndecode: {meta['model']}, chat prompt of {meta['prompt_tokens']} tokens, {meta['new_tokens']} new "
          f"tokens, batch 1, {meta['threads']} threads, {runs} (min-max)")
    print(f"host: {meta['host']}")
    if meta.get("read_gb_s"):
        size = f"{meta.get('read_gib', 1.0):g} GiB"
        print(f"memory read bandwidth measured in this run: {meta['read_gb_s']} GB/s (a streaming read of "
              f"{size}, {meta['threads']} threads, the best of each round's); %bw: decode's GB/s as a share of it")
    if meta.get("products_gb_s"):
        read = meta.get("read_gb_s")
        each = ", ".join(f"{m} {v} GB/s" + (f" ({100 * v / read:.0f}%)" if read else "")  # type: ignore[operator]
                         for m, v in meta["products_gb_s"].items())  # type: ignore[union-attr]
        print(f"the products alone, one row through every quantized weight in turn (a decode step without "
              f"its attention, norms or Python), the best of each round's: {each}")
    if meta.get("int8_peak_gmacs"):
        print(f"int8 multiply-add peak measured in this run: {meta['int8_peak_gmacs']} G/s (the kernel variant's "
              f"dot-product instruction on registers); %peak: a prefill's projection multiply-adds "
              f"({meta['macs_per_token'] / 1e9:.2f} G a token) as a share of it")
    bw = meta.get("read_gb_s")
    _head("decode after the prompt", f"{'tok/s':>7} {'min-max':>13} {'TTFT ms':>8} {'GB/s':>6}" +
          (f" {'%bw':>5}" if bw else ""))
    for r in (x for x in results if x["test"] == "decode"):
        if r["tok_s"] is None:
            _line(r, str(r["note"]))
            continue
        mm = f"{cell(r['tok_s_min'])}-{cell(r['tok_s_max'])}"
        share = f" {100 * r['gb_s'] / bw:>4.0f}%" if bw and r["gb_s"] else ""
        _line(r, f"{r['tok_s']:>7.1f} {mm:>13} {cell(r['ttft_ms'], '.0f'):>8} {cell(r['gb_s'], '.2f'):>6}" + share)
    pre = [x for x in results if x["test"] == "prefill"]
    if pre:
        peak = meta.get("int8_peak_gmacs")
        _head("prefill: prompt tokens/s into an empty cache", f"{'tokens':>6} {'tok/s':>8} {'min-max':>15} "
              f"{'seconds':>8}" + (f" {'%peak':>6}" if peak else ""))
        for n in sorted({int(x["tokens"]) for x in pre}):  # type: ignore[call-overload]
            for r in (x for x in pre if x["tokens"] == n):
                if r["tok_s"] is None:
                    _line(r, f"{n:>6} {r['note']}")
                    continue
                mm = f"{cell(r['tok_s_min'], '.0f')}-{cell(r['tok_s_max'], '.0f')}"
                share = f" {100 * r['tok_s'] * meta['macs_per_token'] / (peak * 1e9):>5.0f}%" if peak else ""
                _line(r, f"{n:>6} {r['tok_s']:>8.0f} {mm:>15} {cell(r['seconds'], '.2f'):>8}" + share)
    deep = [x for x in results if x["test"] == "depth"]
    if deep:
        _head(f"decode after {deep[0]['tokens']} tokens of context ({meta['depth_new_tokens']} new tokens; "
              "8-bit KV: kvcache int8, llama.cpp q8_0)", f"{'tok/s':>7} {'min-max':>13} {'prefill s':>9} {'GB/s':>6}")
        for r in deep:
            if r["tok_s"] is None:
                _line(r, str(r["note"]))
                continue
            mm = f"{cell(r['tok_s_min'])}-{cell(r['tok_s_max'])}"
            pf = None if r["ttft_ms"] is None else r["ttft_ms"] / 1000  # type: ignore[operator]
            _line(r, f"{r['tok_s']:>7.1f} {mm:>13} {cell(pf, '.2f'):>9} {cell(r['gb_s'], '.2f'):>6}")
    rat = ratios(results)
    if rat:
        print("\nkvcache / peer, tok/s in this run (each kvcache weights mode against the peer on the same weights)")
        for x in rat:
            what = {"decode": "decode", "prefill": f"prefill {x['tokens']}", "depth": f"decode @{x['tokens']}"}
            print(f"  {what[str(x['test'])]:<14} kvcache {str(x['kvcache']):<26} vs {str(x['peer']):<38} "
                  f"{x['ratio']:.2f}x")
    print("\nGB/s: (weights + KV read per step) x tok/s. Pairs: kvcache file (the GGUF's own types) with llama.cpp\n"
          "on the file as shipped; q8 with llama.cpp's Q8_0 conversion; fp32 with its F32 and with transformers.")
    return rat


def headline(d: dict) -> list[Headline]:
    """``bench decode``: kvcache on the file's own weights beside llama.cpp on the same file
    (decode at batch 1, prefill, decode at depth); the layout before llama.cpp rows: kvcache
    against transformers' DynamicCache."""
    meta, results = d.get("meta", {}), d["results"]
    if not d.get("ratios"):  # the first layout: one decode test, kvcache beside transformers
        k = one(results, system="kvcache", cache="dynamic")
        p = one(results, system="transformers", cache="DynamicCache")
        return [Headline("decode tok/s, batch 1, fp32 weights", positive(k["tok_s"]), "transformers DynamicCache",
                    positive(p["tok_s"]), "tok/s")]
    rows = []
    for r in d["ratios"]:
        test, tokens = r["test"], r["tokens"]
        k = next(x for x in results if x["system"] == "kvcache" and x["test"] == test and x["tokens"] == tokens
                 and f"{x['weights']} {x['cache']}" == r["kvcache"])
        if not str(k["weights"]).startswith("file"):
            continue  # the file's own weights only: llama.cpp runs that file
        p = next(x for x in results if x["system"] != "kvcache" and x["test"] == test and x["tokens"] == tokens
                 and f"{x['system']} {x['weights']} {x['cache']}" == r["peer"])
        model = model_name(meta, str(k["weights"]))
        if test == "decode":
            what = f"{model}: decode tok/s, batch 1"
        elif test == "prefill":
            what = f"{model}: prefill {tokens} tokens, tok/s"
        elif test == "depth":
            what = f"{model}: decode tok/s after {tokens} tokens, {k['cache']} KV (peer {p['cache']})"
        else:
            what = f"{model}: {test} {tokens}, tok/s"
        rows.append(beside_same_file(what, k, p))
    return rows


def plot(plt, data: dict):
    """One panel per test (decode, prefill at each length, decode at depth): tok/s per system."""
    from kvcache.bench.plots import label

    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    tests = list(dict.fromkeys((r.get("test", "decode"), r.get("tokens", 0)) for r in rows))
    fig, axes = plt.subplots(len(tests), 1, figsize=(8, sum(0.6 + 0.4 * len(_of(rows, t)) for t in tests)),
                             squeeze=False)
    for ax, t in zip(axes[:, 0], tests):
        mine = _of(rows, t)
        values = [r["tok_s"] for r in mine]
        ax.barh(range(len(mine)), values, color=["#4477aa" if r["system"] == "kvcache" else "#aa7744" for r in mine])
        ax.set_yticks(range(len(mine)), [f"{r['system']} {r.get('weights', '')} {r['cache']}" for r in mine])
        ax.invert_yaxis()
        name, n = t
        ax.set_title({"decode": "decode, batch 1 (new tokens/s)", "prefill": f"prefill of {n} tokens (tokens/s)",
                      "depth": f"decode after {n} tokens of context (new tokens/s)"}.get(name, name), fontsize=9)
        for i, v in enumerate(values):
            ax.text(v, i, f" {label(v)}", va="center", fontsize=8)
    return fig


def _of(rows: list[dict], test: tuple[str, int]) -> list[dict]:
    return [r for r in rows if (r.get("test", "decode"), r.get("tokens", 0)) == test]
