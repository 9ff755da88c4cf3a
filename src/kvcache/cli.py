"""The ``kvcache`` console command: generate, chat, cache-prompt, serve, models, bench, size, eval, inspect."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcache import gcpolicy
from kvcache.cliargs import (add_model_args, add_prefix_args, add_sampling_args, load_llm, prediction_text,
                             sampling_params, stop_asked, stop_on_signals)
from kvcache.fmt import human_bytes
from kvcache.errors import KVCacheError

DEFAULT_PROMPT = "What is a KV cache in a language model? Answer in two sentences."


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    predicted = prediction_text(args)
    llm = load_llm(args)
    if predicted:
        from dataclasses import replace

        params = replace(params, prediction=tuple(llm.tokenizer.encode(predicted, add_special_tokens=False)))
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
    llm = load_llm(args)
    n = llm.save_cache(args.out, text, chat=False)
    size = Path(args.out).stat().st_size
    print(f"cached {n} tokens of {args.prompt_file} in {args.out} ({human_bytes(size)}, kv={llm.cache_config.spec()})",
          file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(args)
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

    if args.check:
        return check_model_file(args.check)
    for row in list_models():
        print(row)
    return 0


def check_model_file(spec: str) -> int:
    """`kvcache models --check FILE`: what a GGUF is, what kvcache honours, why it refuses it (exit 2)."""
    from pathlib import Path

    from kvcache.errors import ModelLoadError
    from kvcache.models.bundled import BUNDLED, bundled_path
    from kvcache.models.gguf_convert import check_file

    path = bundled_path(spec) if spec in BUNDLED else Path(spec).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{spec}: no such GGUF file")
    report = check_file(path)
    for line in report.lines(path.name):
        print(line)
    return 0 if report.ok else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache", description="LLM inference with the KV cache at its centre.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (default: a short question, with --chat)")
    add_model_args(g)
    add_prefix_args(g)
    add_sampling_args(g, 128)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stats", action="store_true", help="print the KV cache's memory accounting, per layer")
    g.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="continue a prompt cached by `kvcache cache-prompt` (its K/V are loaded, not computed)")
    g.set_defaults(func=cmd_generate)

    cp = sub.add_parser("cache-prompt", help="compute a prompt's KV cache once and save it to a file")
    cp.add_argument("--prompt-file", required=True, help="text file with the prompt ('-' reads stdin)")
    cp.add_argument("--out", required=True, help="cache file to write (safetensors)")
    add_model_args(cp)
    cp.set_defaults(func=cmd_cache_prompt)

    c = sub.add_parser("chat", help="multi-turn chat that reuses its KV cache between turns")
    add_model_args(c)
    add_prefix_args(c)
    add_sampling_args(c, 256)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--save", default=None, metavar="FILE",
                   help="at the end, save the conversation and its KV cache to FILE")
    c.add_argument("--resume", default=None, metavar="FILE",
                   help="continue a conversation saved with --save (its KV cache is loaded, not recomputed)")
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list the bundled and converted models; --check FILE: what kvcache makes of a GGUF")
    m.add_argument("--check", default=None, metavar="FILE",
                   help="report every key and tensor of a GGUF file (or a bundled model's name): honoured, of no "
                        "effect, or the reason the file is refused (exit 2 when it is)")
    m.set_defaults(func=cmd_models)

    from kvcache.server.cli import add_serve_parser

    add_serve_parser(sub)

    from kvcache.bench.cli import add_bench_parser
    from kvcache.envinfo import add_env_parser
    from kvcache.eval.cli import add_eval_parser
    from kvcache.inspect.cli_size import add_size_parser
    from kvcache.inspect.cli_inspect import add_inspect_parser

    add_bench_parser(sub)
    add_size_parser(sub)
    add_eval_parser(sub)
    add_inspect_parser(sub)
    add_env_parser(parser, sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    stop_on_signals()  # Ctrl-C and SIGTERM stop every command from its first line
    gcpolicy.defer()  # garbage collected rarely while the imports and the model's load run (gcpolicy.py)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if stop_asked():  # asked while the parser's imports ran, and swallowed there
            raise KeyboardInterrupt
        return int(args.func(args) or 0)
    except KVCacheError as e:
        print(f"kvcache: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(argv)
    except BrokenPipeError:
        return 0
    except Exception as e:
        # a signal that came while a module's classes were being made surfaces wrapped (Python
        # reports an exception from __set_name__ as a RuntimeError caused by it): still a stop
        if stop_asked() and _caused_by_interrupt(e):
            return _interrupted(argv)
        raise
    finally:
        gcpolicy.settle()  # a command that loaded no model


def _interrupted(argv: Sequence[str] | None) -> int:
    print("", file=sys.stderr)
    # a server stopped by a signal before it served stops cleanly, at whatever moment: nothing
    # was served or written (kvcache serve itself says so once its parser has been built)
    serving = list(sys.argv[1:] if argv is None else argv)[:1] == ["serve"]
    return 0 if serving and stop_asked() else 130


def _caused_by_interrupt(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, KeyboardInterrupt):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False
