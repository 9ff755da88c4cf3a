"""``kvcache bench SUITE``: the parser and the dispatch to the suites. Each suite is one module that
declares itself (bench/suites.py: its name, options, place and quick settings) and whose
``run(args)`` measures, prints its table and writes its JSON; ``bench report DIR ...``
(bench/headline.py) reads those JSON files back into one table per host kind."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvcache.bench import suites
from kvcache.errors import InvalidParams


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks beside transformers, in the same run")
    b.add_argument("suite", help=f"suite to run: {', '.join(suites.names())}, or all (every suite, one report); "
                                 "report DIR ...: one markdown table per host kind from the suites' JSON files "
                                 "under DIR (kvcache beside its peer, the ratio, each row's date and file)")
    b.add_argument("dirs", nargs="*", metavar="DIR",
                   help="report: folders (or files) of suite JSON written by --out/--json, e.g. docs/bench")
    b.add_argument("--since", default=None, metavar="YYYY-MM-DD",
                   help="report: only runs of this date or later")
    b.add_argument("--model", "-m", default=None,
                   help="model (default: bundled SmolLM2-135M-Instruct); random:SHAPE:FTYPE makes (once, cached) a "
                        "model of that shape with random weights and SmolLM2's tokenizer, quantized by llama.cpp's "
                        "llama-quantize: random:1b:Q4_K_M, random:3b:Q8_0, random:135m:Q4_0, "
                        "random:hidden=2048,layers=16,heads=32,kv_heads=8,ffn=8192:Q4_0 (speed does not depend on "
                        "what the weights say)")
    b.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens per run (default: decode 200, context 64); structured: the most tokens a "
                        "constrained output may have (default 320); spec: at most that many per run "
                        "(default 128)")
    b.add_argument("--repeats", type=int, default=None,
                   help="timed runs per system (default: decode 3, context 2, growth 1; structured 3 alternating "
                        "free/constrained runs, the best counts; spec 3 runs without and with speculation, "
                        "taking turns, the best counts)")
    b.add_argument("--profile", action="store_true", default=None,
                   help="decode: where a decode step's time goes, in the native kernels or in the host code "
                        "around them (Python, torch's small operations, the sampler), per step; kvcache alone")
    b.add_argument("--rounds", type=int, default=None,
                   help="decode: measure every system this many times in turn, pooling the samples (default 1): "
                        "the host's memory speed drifts over minutes, so one pass can leave one system in a slow "
                        "stretch")
    b.add_argument("--kv", default=None,
                   help="kvcache specs, comma-separated (default: decode dynamic; "
                        "context dynamic,fp16,int8,int4,sink); in context, key=value items belong to the spec before "
                        "them (int8,sinks=4,window=1024 is one spec) and ';' separates specs explicitly")
    b.add_argument("--peers", default=None,
                   help="decode: peers to run: none,dynamic,static (transformers' caches), llama.cpp (default "
                        "dynamic,static,llama.cpp; '' skips); context --long: llama.cpp's KV types beside kvcache "
                        "(default f16,q8_0,q4_0; '' skips llama.cpp); throughput: sequential,padded,generate_batch "
                        "(default all); structured: grammar engines to compare, llguidance,xgrammar (default "
                        "both; '' skips); spec: transformers,llama-server (default both; '' skips)")
    b.add_argument("--weights", default=None,
                   help="how kvcache holds the weights (file, fp32, q8, q4), comma-separated: decode (default "
                        "file,q8,fp32), throughput, memory and spec (default file,fp32) run each; context, prefix "
                        "and cache-vs-none take one (default fp32, the weights transformers runs)")
    b.add_argument("--prefill", default=None, metavar="N,N",
                   help="decode: prompt lengths of the prefill rows (default 512,2000,8000, --quick 512; '' skips); "
                        "serve: prompt tokens of each request (default 256)")
    b.add_argument("--depth", type=int, default=None, metavar="N",
                   help="decode: context of the long-context row, kvcache int8 KV against llama.cpp q8_0 "
                        "(default 8000, --quick 512; 0 skips)")
    b.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="decode and context --long (llama-bench, llama-quantize), serve and spec (llama-server): "
                        "folder with "
                        "llama.cpp's tools to run as the peer "
                        "(default $KVCACHE_LLAMA_CPP_BIN, or what `make llamacpp` built; else llama-cpp-python "
                        "when installed)")
    b.add_argument("--contexts", default=None,
                   help="context: prompt lengths in tokens, comma-separated (default 128,512,2048,8000; with --long "
                        "4096,16384,32768: the depths decode is measured at and the prompts prefilled)")
    b.add_argument("--long", action="store_true",
                   help="context: decode and prefill at depth (default 4096,16384,32768 tokens) for KV specs "
                        "fp16,bf16,int8,int4,int2 (or --kv) beside llama-bench's f16,q8_0,q4_0 KV on the same GGUF, "
                        "with the read bandwidth measured in the run, the bytes each decode step reads and its "
                        "share of that bandwidth, and each spec's resident memory at the largest context; each "
                        "spec runs in its own process and is grown to the largest context in stages (one prefill); "
                        "--quick: 256,1024 tokens, fp16,int8, 8 new tokens, 1 repeat"),
    b.add_argument("--max-context", type=int, default=None,
                   help="growth: tokens to grow the caches to (default 8192, --quick 2048)")
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
                   help="throughput: requests arriving at once (default 32, --quick 8); serve: requests each stream "
                        "sends in turn (default 3); structured: requests run at once, the first "
                        "4 also one at a time (default 16, --quick 4)")
    b.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="throughput: multi-turn chat through N engine replicas on Ray Serve instead: prefix-aware "
                        "routing against round-robin against one replica (hit rate, TTFT)")
    b.add_argument("--prefill-replicas", type=int, default=None, metavar="M",
                   help="throughput with --replicas: also long documents with and without M prefill replicas")
    b.add_argument("--streams", default=None, metavar="N,N",
                   help="serve: concurrent streams, one level each (default 8,32; --quick 4)")
    b.add_argument("--mixed", type=int, default=None, metavar="LONG_TOKENS",
                   help="serve: short chats beside one document of LONG_TOKENS prompt tokens instead of the "
                        "streams levels: the short chats' TTFT (median, max) alone and while the document is "
                        "prefilled, and the document's total time; --streams: short-chat clients (default 2), "
                        "--prefill: a short chat's tokens (default 64), --requests: short chats alone (default 5), "
                        "--new-tokens: tokens out of each (default 8)")
    b.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="serve: kvcache serve's --max-batch-tokens (default: the server's, 256)")
    b.add_argument("--document-step-work", type=int, default=None, metavar="N",
                   help="serve --mixed: kvcache serve's --document-step-work (default: the server's, 32; 0: never capped)")
    b.add_argument("--rows", type=int, default=None, metavar="N",
                   help="attention: new tokens of one call (default 1, a decode); N > 1 times a prefill chunk of N "
                        "tokens over the context (causal among themselves), without the torch peer")
    b.add_argument("--threads", type=int, default=None, help="torch threads for every system")
    b.add_argument("--quick", action="store_true",
                   help="a short run: decode 16 tokens, 1 repeat, prefill 512, depth 512; context 256,1024 with 16 tokens, 1 repeat, "
                        "kv dynamic,static; growth to 2048 tokens; structured 4 requests (2 one at a time), 1 repeat; "
                        "spec 32 tokens, 1 repeat, transformers on the first workload only; with 'all', each suite "
                        "smaller still (spec on the file's weights alone, without transformers' rows), llama.cpp's rows only "
                        "where --llama-cpp-bin "
                        "names its tools")
    b.add_argument("--json", default=None, help="write results to this JSON file")
    b.add_argument("--out", default=None, metavar="DIR",
                   help="write SUITE.json, SUITE.png and a markdown report SUITE.md (machine, versions, command, "
                        "table) into DIR; report: the markdown file to write the tables to")
    b.set_defaults(func=cmd_bench)


def _users(name: str) -> list[str]:
    """The suites that read option ``name``: a mode's own option (--long) belongs to its suite
    (context); an option only a mode reads to that mode (context --long)."""
    out: dict[str, None] = {}
    for s in suites.catalogue():
        if name == s.mode:
            out[s.name] = None
        elif name in s.options:
            base = suites.find(s.name)
            out[s.name if s.mode is None or (base and name in base.options) else s.key] = None
    return list(out)


def _refuse_foreign(args: argparse.Namespace, suite: suites.Suite) -> None:
    """A suite-specific option the chosen suite (or mode) does not read is refused, naming those
    that do."""
    for name in suites.flags():
        if not suites.given(args, name) or name in suite.options or name == suite.mode:
            continue
        flag = "--" + name.replace("_", "-")
        modes = [s for s in suites.catalogue() if s.name == suite.name and s.mode and name in s.options + (s.mode,)]
        if modes and suite.mode is None:
            raise InvalidParams(f"{flag} does not apply to the {suite.name} suite without --{modes[0].mode}")
        where = f"the {suite.name} suite" + (f" with --{suite.mode}" if suite.mode else "")
        raise InvalidParams(f"{flag} does not apply to {where} (only to {', '.join(_users(name))})")


def random_model(args: argparse.Namespace) -> None:
    """``--model random:SHAPE:FTYPE`` -> the path of that benchmark model (bench/randmodel.py)."""
    spec = args.model
    if not (isinstance(spec, str) and spec.startswith("random:")):
        return
    shape, _, ftype = spec[len("random:"):].rpartition(":")
    if not shape or not ftype:
        raise InvalidParams(f"--model {spec!r}: give random:SHAPE:FTYPE, e.g. random:1b:Q4_K_M")
    from kvcache.bench.randmodel import ShapeError, bin_dir, make

    try:
        (path,) = make(shape, [ftype], llama_bin=bin_dir(getattr(args, "llama_cpp_bin", None)))
    except (ShapeError, RuntimeError) as e:
        raise InvalidParams(f"--model {spec!r}: {e}") from None
    args.model = str(path)


def cmd_report(args: argparse.Namespace) -> int:
    """``kvcache bench report DIR ...``: the tables, printed (and written to --out); notes on the
    files skipped go to stderr."""
    given = [n for n in suites.flags() if suites.given(args, n)]
    given += [n for n in ("model", "json", "threads") if getattr(args, n, None) is not None]
    given += [n for n in ("quick",) if getattr(args, n, False)]
    if given:
        raise InvalidParams(f"--{given[0].replace('_', '-')} does not apply to 'bench report' "
                            "(it takes DIR ..., --since and --out)")
    if not args.dirs:
        raise InvalidParams("bench report: give the folders of suite JSON to read, e.g. kvcache bench report docs/bench")
    from kvcache.bench.headline import report

    text = report(args.dirs, since=args.since, out=args.out)
    print(text, end="")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "report":
        return cmd_report(args)
    if args.dirs:
        raise InvalidParams(f"unexpected arguments after the suite: {' '.join(args.dirs)}")
    if args.since is not None:
        raise InvalidParams(f"--since does not apply to the {args.suite} suite (only to report)")
    random_model(args)
    if args.suite == "all":
        return cmd_all(args)
    if suites.find(args.suite) is None:
        raise InvalidParams(f"unknown bench suite {args.suite!r}; suites: {', '.join(suites.names())}, all "
                            "(or report DIR ... to tabulate their JSON)")
    suite = suites.chosen(args.suite, args)
    _refuse_foreign(args, suite)
    return _run(suite, args)


def _run(suite: suites.Suite, args: argparse.Namespace) -> int:
    """Run one suite (with --out, its report beside); its JSON names the suite that wrote it
    (``meta.suite``), which ``bench report`` reads."""
    module = suite.load()
    if args.out:
        from kvcache.bench.report import run_with_report

        return run_with_report(suite, args, lambda: module.run(args))
    rc = module.run(args)
    suites.mark(args.json, suite)
    return rc


def cmd_all(args: argparse.Namespace) -> int:
    """Every suite in turn (not their modes; with --quick, each reduced further by its QUICK
    settings); with --out, one report per suite and an index. --llama-cpp-bin goes to the suites
    that run llama.cpp."""
    for name in suites.flags():
        if suites.given(args, name) and name != "llama_cpp_bin":
            mode = next((s for s in suites.catalogue() if s.mode == name), None)
            alone = f"bench {mode.name} --{name}" if mode else "the suite"
            raise InvalidParams(f"--{name.replace('_', '-')} does not apply to 'bench all' (run {alone} alone)")
    took: dict[str, float] = {}  # suite -> seconds, in the order they ran
    start = time.perf_counter()
    for suite in (s for s in suites.catalogue() if s.mode is None):
        sub = argparse.Namespace(**vars(args))
        sub.suite, sub.json = suite.name, None
        if args.quick:
            settings = suite.quick | (suite.quick_llama_cpp if args.llama_cpp_bin else {})
            for k, v in settings.items():
                setattr(sub, k, v)
        print(f"\n=== {suite.name} ===", flush=True)
        t0 = time.perf_counter()
        _run(suite, sub)
        took[suite.name] = time.perf_counter() - t0
    each = ", ".join(f"{name} {s:.1f} s" for name, s in took.items())
    print(f"\nbench all: {len(took)} suites in {time.perf_counter() - start:.1f} s ({each})", flush=True)
    if args.out:
        from kvcache.bench.report import machine

        lines = ["# kvcache benchmarks", "", "| suite | report |", "|---|---|"]
        lines += [f"| {s} | [{s}.md]({s}.md) |" for s in took]
        lines += ["", "| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in machine().items()]
        (Path(args.out) / "README.md").write_text("\n".join(lines) + "\n")
    return 0
