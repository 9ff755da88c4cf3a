"""``kvcache bench SUITE``: run a suite, print a table, write JSON."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from kvcache.errors import InvalidParams

SUITES = ("decode", "cache-vs-none", "context", "memory", "growth", "prefix", "throughput", "hf")

DEFAULT_SPECS = "dynamic,fp16,int8,int4,sink"
QUICK_SPECS = "dynamic,static"
DEFAULT_CONTEXTS, QUICK_CONTEXTS = "128,512,2048,8000", "256,1024"
DEFAULT_MAX_CONTEXT, QUICK_MAX_CONTEXT = 8192, 2048


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks beside transformers, in the same run")
    b.add_argument("suite", help=f"suite to run: {', '.join(SUITES)}, or all (every suite, one report)")
    b.add_argument("--model", "-m", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    b.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens per run (default: decode 200, context 64)")
    b.add_argument("--repeats", type=int, default=None,
                   help="timed runs per system (default: decode 3, context 2, growth 1)")
    b.add_argument("--kv", default=None,
                   help="kvcache specs, comma-separated (default: decode dynamic,static; "
                        f"context {DEFAULT_SPECS}); in context, key=value items belong to the spec before "
                        "them (int8,sinks=4,window=1024 is one spec) and ';' separates specs explicitly")
    b.add_argument("--peers", default=None,
                   help="decode: peers to run: none,dynamic,static (transformers' caches), llama.cpp (when "
                        "llama-cpp-python is installed) (default dynamic,static,llama.cpp; '' skips); "
                        "throughput: sequential,padded,generate_batch (default all)")
    b.add_argument("--contexts", default=None,
                   help="context: prompt lengths in tokens, comma-separated (default 128,512,2048,8000)")
    b.add_argument("--max-context", type=int, default=None,
                   help=f"growth: tokens to grow the caches to (default {DEFAULT_MAX_CONTEXT}, "
                        f"--quick {QUICK_MAX_CONTEXT})")
    b.add_argument("--system-tokens", type=int, default=None,
                   help="prefix: tokens of the shared system prompt (default 2000, --quick 256)")
    b.add_argument("--redis", default=None, metavar="URL",
                   help="prefix: Redis to use for the Redis tier (default: start a local redis-server if installed)")
    b.add_argument("--context", type=int, default=None,
                   help="memory: prompt tokens of each run (default 4096, --quick 256)")
    b.add_argument("--budget", type=float, default=None, metavar="GIB",
                   help="memory: KV budget for the longest-context column (default 4 GiB)")
    b.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="cache-vs-none: stop a run without a cache after this long (default 120, --quick 10)")
    b.add_argument("--requests", type=int, default=None,
                   help="throughput: requests arriving at once (default 32, --quick 8)")
    b.add_argument("--threads", type=int, default=None, help="torch threads for every system")
    b.add_argument("--quick", action="store_true",
                   help="a short run: decode 32 tokens, 1 repeat; context 256,1024 with 16 tokens, 1 repeat, "
                        f"kv {QUICK_SPECS}; growth to {QUICK_MAX_CONTEXT} tokens")
    b.add_argument("--json", default=None, help="write results to this JSON file")
    b.add_argument("--out", default=None, metavar="DIR",
                   help="write SUITE.json, SUITE.png and a markdown report SUITE.md (machine, versions, command, "
                        "table) into DIR")
    b.set_defaults(func=cmd_bench)


# options each suite reads (the others are refused when given)
OPTIONS = {
    "decode": ("new_tokens", "repeats", "kv", "peers"),
    "context": ("new_tokens", "repeats", "kv", "contexts"),
    "growth": ("repeats", "max_context"),
    "prefix": ("repeats", "system_tokens", "redis", "new_tokens"),
    "throughput": ("requests", "new_tokens", "peers", "kv"),
    "cache-vs-none": ("new_tokens", "time_budget", "peers"),
    "memory": ("context", "new_tokens", "kv", "peers", "budget"),
    "hf": ("new_tokens", "repeats", "kv", "peers", "contexts"),
}
_FLAGS = ("new_tokens", "repeats", "kv", "peers", "contexts", "max_context", "system_tokens", "redis", "requests",
          "time_budget", "context", "budget")


def _refuse_foreign(args: argparse.Namespace) -> None:
    for name in _FLAGS:
        if getattr(args, name) is not None and name not in OPTIONS[args.suite]:
            users = [s for s in SUITES if name in OPTIONS[s]]
            flag = "--" + name.replace("_", "-")
            raise InvalidParams(f"{flag} does not apply to the {args.suite} suite (only to {', '.join(users)})")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "all":
        return cmd_all(args)
    if args.suite not in SUITES:
        raise InvalidParams(f"unknown bench suite {args.suite!r}; suites: {', '.join(SUITES)}, all")
    _refuse_foreign(args)
    if args.out:
        from kvcache.bench.report import run_with_report

        return run_with_report(args.suite, args, lambda: _dispatch(args))
    return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    if args.suite == "context":
        return cmd_context(args)
    if args.suite == "growth":
        return cmd_growth(args)
    if args.suite == "memory":
        from kvcache.bench.cli_memory import cmd_memory

        return cmd_memory(args)
    if args.suite == "cache-vs-none":
        from kvcache.bench.cli_nocache import cmd_cache_vs_none

        return cmd_cache_vs_none(args)
    if args.suite == "throughput":
        from kvcache.bench.cli_throughput import cmd_throughput

        return cmd_throughput(args)
    if args.suite == "prefix":
        from kvcache.bench.cli_prefix import cmd_prefix

        return cmd_prefix(args)
    if args.suite == "hf":
        from kvcache.bench.hfbridge import cmd_hf

        return cmd_hf(args)
    return cmd_decode(args)


# ``bench all --quick``: every suite, small enough that the whole run stays near two minutes
ALL_QUICK: dict[str, dict[str, object]] = {
    "decode": {"new_tokens": 16, "repeats": 1, "peers": "dynamic"},
    "cache-vs-none": {"new_tokens": 24, "time_budget": 3.0, "peers": "dynamic,none"},
    "context": {"contexts": "256", "kv": "dynamic,int8", "new_tokens": 8, "repeats": 1},
    "memory": {"context": 320, "kv": "dynamic;int4", "new_tokens": 2, "peers": "dynamic"},
    "growth": {"max_context": 512},
    "prefix": {"system_tokens": 128, "repeats": 1, "new_tokens": 4},
    "throughput": {"requests": 4, "new_tokens": 8, "peers": "padded"},
    "hf": {"contexts": "256", "new_tokens": 4, "kv": "dynamic", "peers": "dynamic"},
}


def cmd_all(args: argparse.Namespace) -> int:
    """Every suite in turn (with --quick, reduced further); with --out, one report per suite and
    an index."""
    for name in _FLAGS:
        if getattr(args, name) is not None:
            raise InvalidParams(f"--{name.replace('_', '-')} does not apply to 'bench all' (run the suite alone)")
    done = []
    for suite in SUITES:
        sub = argparse.Namespace(**vars(args))
        sub.suite, sub.json = suite, None
        if args.quick:
            for k, v in ALL_QUICK[suite].items():
                setattr(sub, k, v)
        print(f"\n=== {suite} ===", flush=True)
        if args.out:
            from kvcache.bench.report import run_with_report

            run_with_report(suite, sub, lambda sub=sub: _dispatch(sub))
        else:
            _dispatch(sub)
        done.append(suite)
    if args.out:
        from kvcache.bench.report import machine

        lines = ["# kvcache benchmarks", "", "| suite | report |", "|---|---|"]
        lines += [f"| {s} | [{s}.md]({s}.md) |" for s in done]
        lines += ["", "| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in machine().items()]
        (Path(args.out) / "README.md").write_text("\n".join(lines) + "\n")
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    quick = args.quick
    new = args.new_tokens if args.new_tokens is not None else (32 if quick else 200)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    args.kv = "dynamic,static" if args.kv is None else args.kv
    args.peers = "dynamic,static,llama.cpp" if args.peers is None else args.peers
    if new < 2 or repeats < 1:
        raise InvalidParams("--new-tokens must be >= 2 and --repeats >= 1")
    from tqdm import tqdm

    import torch

    from kvcache.bench.decode import PROMPT, bench_kvcache, bench_transformers
    from kvcache.engine.llm import LLM
    from kvcache.models.loading import fp32_folder

    strategies = [s for s in args.kv.split(",") if s]
    peers = [s for s in args.peers.split(",") if s]
    for p in peers:
        if p not in ("none", "dynamic", "static", "llama.cpp"):
            raise InvalidParams(f"unknown peer {p!r}; choose from none, dynamic, static (transformers' caches), "
                                "llama.cpp")
    lcpp = "llama.cpp" in peers
    peers = [p for p in peers if p != "llama.cpp"]
    llm = LLM(args.model, threads=args.threads)
    bar = tqdm(total=(len(strategies) + len(peers) + 3 * lcpp) * repeats, desc="bench decode", file=sys.stderr)
    rows = bench_kvcache(llm, strategies, new, repeats, bar.update)
    ids = llm.encode(PROMPT, chat=True)
    if peers:
        rows += bench_transformers(str(fp32_folder(args.model)), ids, peers, new, repeats, bar.update)
    if lcpp:
        rows += _llamacpp_rows(args.model, llm, ids, new, repeats, bar.update)
    bar.close()
    results = [r.summary() for r in rows]
    hf_best = max((r["tok_s"] or 0 for r in results if r["system"] == "transformers"), default=0)
    lcpp_best = max((r["tok_s"] or 0 for r in results if r["system"] == "llama.cpp"), default=0)
    print(f"\ndecode: {llm.model_name}, prompt {len(ids)} tokens, {new} new tokens, batch 1, fp32, "
          f"{torch.get_num_threads()} threads, median of {repeats}")
    print(f"{'system':<13} {'weights / cache':<22} {'tok/s':>8} {'min-max':>13} {'TTFT ms':>8} {'GB/s':>6} "
          f"{'vs HF best':>10}")
    for r in results:
        if r["tok_s"] is None:
            print(f"{r['system']:<13} {r['cache']:<22} {r['note']}")
            continue
        ratio = f"{r['tok_s'] / hf_best:.2f}x" if hf_best else "-"
        print(f"{r['system']:<13} {r['cache']:<22} {r['tok_s']:>8.1f} {r['tok_s_min']:>6.1f}-{r['tok_s_max']:<6.1f} "
              f"{r['ttft_ms']:>8.0f} {_fmt(r['gb_s'], '.2f'):>6} {ratio:>10}")
    if lcpp_best:
        ours = max((r["tok_s"] or 0 for r in results if r["system"] == "kvcache"), default=0)
        print(f"kvcache's best / llama.cpp's best: {ours / lcpp_best:.2f}x (llama.cpp computes on its quantized "
              "weights; its F32 row uses the same fp32 weights as kvcache)")
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "new_tokens": new, "repeats": repeats, "prompt_tokens": len(ids)}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def _llamacpp_rows(model: str | None, llm, ids: list[int], new: int, repeats: int, tick) -> list:
    """llama.cpp on the model's GGUF (as shipped, F32 and Q8_0), or a row saying why not."""
    import torch

    from kvcache.bench import llamacpp
    from kvcache.bench.decode import Row, step_bytes
    from kvcache.models.loading import resolve_model
    from kvcache.models.paths import cache_home

    note = llamacpp.missing()
    src = resolve_model(model).source
    if note is None and (src is None or not str(src).endswith(".gguf")):
        note = "the model is not a GGUF file: llama.cpp skipped"
    if note is not None:
        return [Row("llama.cpp", "-", note=note)]
    from pathlib import Path

    src = Path(src)
    models = {f"{src.stem.rsplit('.', 1)[-1]} (as shipped)": src}
    for ftype in ("F32", "Q8_0"):
        try:
            models[ftype] = llamacpp.convert(src, ftype, cache_home() / "llamacpp")
        except RuntimeError as e:
            return [Row("llama.cpp", ftype, note=str(e))]
    rows = llamacpp.bench(models, ids, new, repeats, torch.get_num_threads(), tick)
    kv16 = llm.config.kv_bytes_per_token() // 2  # llama.cpp's KV cache is fp16
    for row, path in zip(rows, models.values()):
        row.gb_s = [step_bytes(path.stat().st_size, kv16, len(ids), new) * t / 1e9 for t in row.tok_s]
    return rows


def _meta(**extra: object) -> dict[str, object]:
    import torch

    return {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, **extra}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def cmd_context(args: argparse.Namespace) -> int:
    from kvcache.bench.context import (
        bench_context, check_contexts, parse_contexts, reference_spec, resolve_spec, split_specs, with_ratios,
    )
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    quick = args.quick
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

    llm = LLM(args.model, threads=args.threads)
    bar = tqdm(total=len(configs) * len(contexts) * repeats, desc="bench context", file=sys.stderr)
    rows = bench_context(llm, configs, contexts, new, repeats, bar.update)
    bar.close()
    ref = reference_spec(list(configs))
    results = with_ratios([r.summary() for r in rows], ref)
    width = max(12, *(len(s) for s in configs))
    print(f"\ncontext: {llm.model_name}, {new} new tokens after a prompt of C tokens of English text, batch 1, "
          f"fp32 weights, {torch.get_num_threads()} threads, median of {repeats} (min-max)")
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
        meta = _meta(model=llm.model_name, new_tokens=new, repeats=repeats, contexts=contexts,
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
