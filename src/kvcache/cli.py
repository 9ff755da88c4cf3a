"""The ``kvcache`` console command: generate, chat, cache-prompt, serve, models, bench, size, eval, inspect."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcache.cliargs import add_weights_arg
from kvcache.fmt import human_bytes
from kvcache.errors import KVCacheError

KV_HELP = (
    "cache spec, comma-separated (default: dynamic). Presets: none, dynamic, static, offloaded, "
    "offloaded_static, quantized (int4), sliding_window, sink. Axes: dynamic|static[,max_tokens=N]; "
    "window=N[,sinks=K]; fp32|fp16|bf16|int8|int4|int2[,group_size=G][,residual=R]; "
    "device|host|disk[,dir=PATH]; page_size=N. Example: static,int4,sinks=4,window=1024"
)
DEFAULT_PROMPT = "What is a KV cache in a language model? Answer in two sentences."


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, HF model folder, hub id or bundled name (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--kv", default="dynamic", help=KV_HELP)
    add_weights_arg(p)
    p.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="most memory a dynamic KV pool may hold: GiB (2), a unit (512MiB) or a share of RAM "
                        "(25%%). Beyond it requests wait or are preempted; `serve` defaults to 50%%")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all available cores)")


def _add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep finished requests' K/V for reuse by later prompts")
    p.add_argument("--prefix-dir", default=None, metavar="DIR",
                   help="disk tier of the prefix cache: pages are written here and restored by later runs")
    p.add_argument("--redis", default=None, metavar="URL",
                   help="Redis tier of the prefix cache (redis://host:port/db), shared by several processes")
    p.add_argument("--prefix-tokens", type=int, default=16384, metavar="N",
                   help="tokens of finished requests kept in RAM for reuse (default 16384)")
    p.add_argument("--tier-secret-file", default=None, metavar="FILE",
                   help="a secret (the file's first line) with which disk and Redis entries carry a keyed MAC: "
                        "entries without the right MAC are misses. Also KVCACHE_TIER_SECRET")
    p.add_argument("--tier-secret", default=None, metavar="SECRET",
                   help="the same secret given inline (it shows in `ps`: prefer the file or the variable)")


def _add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=max_new, help=f"tokens to generate (default {max_new})")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")


def _params(args: argparse.Namespace):  # -> SamplingParams
    from kvcache.engine.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )


def _kv(args: argparse.Namespace, default_budget: str | None = None):  # -> CacheConfig
    """The --kv spec with --kv-budget applied (``default_budget`` for a dynamic pool without one)."""
    from dataclasses import replace

    from kvcache.cache.budget import parse_budget
    from kvcache.cache.config import parse_kv_spec

    kv = parse_kv_spec(args.kv)
    budget = getattr(args, "kv_budget", None)
    if budget is None and kv.capacity == "dynamic" and kv.budget is None:
        budget = default_budget
    return replace(kv, budget=parse_budget(budget)) if budget is not None else kv


def _load(args: argparse.Namespace, default_budget: str | None = None):  # -> LLM
    from kvcache.engine.llm import LLM

    from kvcache.prefix.config import PrefixConfig, tier_secret

    kv = _kv(args, default_budget)  # refuse a bad spec before the model loads
    secret = tier_secret(getattr(args, "tier_secret", None), getattr(args, "tier_secret_file", None))
    prefix = PrefixConfig(enabled=not getattr(args, "no_prefix_cache", False),
                          max_cached_tokens=getattr(args, "prefix_tokens", 16384),
                          disk=getattr(args, "prefix_dir", None), redis=getattr(args, "redis", None),
                          secret=secret)
    llm = LLM(args.model, kv=kv, threads=args.threads, prefix=prefix, weights=args.weights)
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _load(args)
    prompt = args.prompt if args.prompt is not None else ("" if args.prompt_cache else DEFAULT_PROMPT)
    chat = args.chat or args.prompt is None
    run = llm.request(prompt, params, chat and not args.prompt_cache, args.prompt_cache)
    for delta in run:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    r = run.result
    llm.flush()  # pages bound for the disk/Redis tiers are written before the process ends
    reused = f" ({r.cached_tokens} reused)" if r.cached_tokens else ""
    print(
        f"[{llm.model_name} · kv={llm.cache_config.spec()}] prompt {len(r.prompt_token_ids)} tokens{reused} · "
        f"new {len(r.token_ids)} tokens · TTFT {r.prefill_s * 1000:.0f} ms · {r.decode_tok_s:.1f} tok/s · "
        f"KV {human_bytes(r.kv_bytes)} · finish {r.finish_reason}",
        file=sys.stderr,
    )
    if args.stats:
        print_stats(r.kv_stats)
    return 0


def print_stats(stats) -> None:  # stats: CacheStats | None
    """The cache's memory accounting, per layer, on stderr."""
    err = sys.stderr
    if stats is None:
        print("KV cache: none (every step recomputes the whole sequence)", file=err)
        return
    print(f"KV cache · kv={stats.strategy} · {stats.encoding} · page {stats.page_size} tokens · "
          f"{stats.bytes_per_token:,} B/token stored", file=err)
    print(f"  pages {stats.pages_used}/{stats.pages_total} used · tokens {stats.tokens_stored} · "
          f"allocated {human_bytes(stats.bytes_allocated)} · used {human_bytes(stats.bytes_used)}", file=err)
    print(f"  {'layer':>5} {'window':>7} {'sinks':>5} {'B/token':>8} {'pages':>11} {'allocated':>11} {'used':>11}",
          file=err)
    for s in stats.per_layer:
        window = "full" if s.window is None else str(s.window)
        print(f"  {s.layer:>5} {window:>7} {s.sinks:>5} {s.bytes_per_token:>8.1f} {s.pages_used:>5}/{s.pages_total:<5} "
              f"{human_bytes(s.bytes_allocated):>11} {human_bytes(s.bytes_used):>11}", file=err)


def cmd_cache_prompt(args: argparse.Namespace) -> int:
    from pathlib import Path

    try:
        text = Path(args.prompt_file).read_text() if args.prompt_file != "-" else sys.stdin.read()
    except OSError as e:
        raise KVCacheError(f"cannot read {args.prompt_file}: {e.strerror or e}") from None
    if not text.strip():
        raise KVCacheError(f"{args.prompt_file} is empty: nothing to cache")
    llm = _load(args)
    n = llm.save_cache(args.out, text, chat=False)
    size = Path(args.out).stat().st_size
    print(f"cached {n} tokens of {args.prompt_file} in {args.out} ({human_bytes(size)}, kv={llm.cache_config.spec()})",
          file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _load(args)
    session = llm.chat_session(system=args.system, resume=args.resume)
    if args.resume:
        print(f"(resumed {len(session.messages)} messages from {args.resume})", file=sys.stderr)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"kvcache chat · {llm.model_name} · kv={llm.cache_config.spec()} · /reset to start over, /exit to leave")
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            session.close()
            session = llm.chat_session(system=args.system)
            print("(conversation reset)")
            continue
        if interactive:
            sys.stdout.write("bot> ")
        for piece in session.stream(text, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        r = session.last
        assert r is not None
        prefilled = len(r.prompt_token_ids) - r.cached_tokens
        print(
            f"[reused {r.cached_tokens} tokens from the cache · prefilled {prefilled} · "
            f"new {len(r.token_ids)} · {r.decode_tok_s:.1f} tok/s]",
            file=sys.stderr,
        )
    if args.save and session.messages:
        size = session.save(args.save)
        print(f"(saved {len(session.messages)} messages and their KV cache to {args.save}, {human_bytes(size)})",
              file=sys.stderr)
    session.close()
    llm.flush()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from kvcache.models.loading import list_models

    for row in list_models():
        print(row)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache", description="LLM inference with the KV cache at its centre.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (default: a short question, with --chat)")
    _add_model_args(g)
    _add_prefix_args(g)
    _add_sampling_args(g, 128)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stats", action="store_true", help="print the KV cache's memory accounting, per layer")
    g.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="continue a prompt cached by `kvcache cache-prompt` (its K/V are loaded, not computed)")
    g.set_defaults(func=cmd_generate)

    cp = sub.add_parser("cache-prompt", help="compute a prompt's KV cache once and save it to a file")
    cp.add_argument("--prompt-file", required=True, help="text file with the prompt ('-' reads stdin)")
    cp.add_argument("--out", required=True, help="cache file to write (safetensors)")
    _add_model_args(cp)
    cp.set_defaults(func=cmd_cache_prompt)

    c = sub.add_parser("chat", help="multi-turn chat that reuses its KV cache between turns")
    _add_model_args(c)
    _add_prefix_args(c)
    _add_sampling_args(c, 256)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--save", default=None, metavar="FILE",
                   help="at the end, save the conversation and its KV cache to FILE")
    c.add_argument("--resume", default=None, metavar="FILE",
                   help="continue a conversation saved with --save (its KV cache is loaded, not recomputed)")
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list the bundled and converted models")
    m.set_defaults(func=cmd_models)

    from kvcache.server.cli import add_serve_parser

    add_serve_parser(sub, _add_model_args, _add_prefix_args)

    from kvcache.bench.cli import add_bench_parser
    from kvcache.envinfo import add_env_parser
    from kvcache.eval.cli import add_eval_parser
    from kvcache.inspect.cli import add_size_parser
    from kvcache.inspect.cli_inspect import add_inspect_parser

    add_bench_parser(sub)
    add_size_parser(sub)
    add_eval_parser(sub)
    add_inspect_parser(sub)
    add_env_parser(parser, sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVCacheError as e:
        print(f"kvcache: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
