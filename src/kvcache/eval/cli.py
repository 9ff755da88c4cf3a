"""``kvcache eval``: fidelity of cache strategies against the full cache, on real English text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.cliargs import add_weights_arg
from kvcache.errors import InvalidParams

DEFAULT_SPECS = "int8;int4;int4,rotate;int2;int2,rotate;window=256;sinks=4,window=256"


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="fidelity of lossy caches (perplexity, agreement, KL) against the full cache")
    e.add_argument("--model", "-m", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    e.add_argument("--kv", default=DEFAULT_SPECS, help=f"cache specs separated by ';' (default {DEFAULT_SPECS!r})")
    add_weights_arg(e)
    e.add_argument("--text", default=None,
                   help="UTF-8 text file to read (default: the Python standard library's pydoc topics)")
    e.add_argument("--tokens", type=int, default=2048, help="tokens of the text to read (default 2048)")
    e.add_argument("--chunk", type=int, default=64, help="tokens per forward (default 64)")
    e.add_argument("--passkey-tokens", type=int, default=1024,
                   help="length of the passkey-retrieval prompts (default 1024; 0 skips the test)")
    e.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="where the key hides, 0..1 (default 0.1,0.5,0.9)")
    e.add_argument("--greedy-tokens", type=int, default=64,
                   help="greedy tokens generated after the text's first half, compared with the full cache's "
                        "(default 64; 0 skips)")
    e.add_argument("--plot", default=None, metavar="PNG", help="plot KL and perplexity against KV bytes per token")
    e.add_argument("--compare-weights", default=None, metavar="MODES",
                   help="instead of cache strategies, compare weights modes (comma-separated: file,q8,q4) with fp32 "
                        "weights: perplexity by llama.cpp's rule, KL, top-1 agreement, bytes")
    e.add_argument("--ppl-ctx", type=int, default=512, help="tokens per perplexity chunk for --compare-weights (512)")
    e.add_argument("--ppl-chunks", type=int, default=8, help="chunks read for --compare-weights (default 8)")
    e.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="with --compare-weights: also run llama.cpp's llama-perplexity from DIR on the same text")
    e.add_argument("--auto", action="store_true",
                   help="the quality gate: measure candidate strategies on the text (default: the built-in one), "
                        "choose the cheapest in bytes per token within --max-kl and --min-agree, and save the "
                        "choice beside the model's fingerprint for --kv auto")
    e.add_argument("--max-kl", type=float, default=None, metavar="NATS",
                   help="with --auto: mean KL budget against the full cache (default 0.05)")
    e.add_argument("--min-agree", type=float, default=None, metavar="SHARE",
                   help="with --auto: least top-1 agreement with the full cache, 0..1 (default 0.9)")
    e.add_argument("--margin", type=float, default=None, metavar="SE",
                   help="with --auto: standard errors added to the mean KL before the budget (default 2)")
    e.add_argument("--candidates", default=None, metavar="SPECS",
                   help="with --auto: the strategies to measure, separated by ';' (default: all candidates)")
    e.add_argument("--continuation", type=int, default=None, metavar="N",
                   help="prefill the text's first --tokens - N tokens through each strategy (a press compresses "
                        "them), then score the last N against the full cache; the passkey question comes after "
                        "its prefilled filler (--auto: default 256)")
    e.add_argument("--kvpress", action="store_true",
                   help="with --continuation: kvpress's figures for each spec's press and ratio on the same tokens "
                        "(needs .venv-kvpress: make kvpress; a missing or failing kvpress is a skipped row)")
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: all available cores)")
    e.add_argument("--json", default=None, help="write the results to this JSON file")
    e.set_defaults(func=cmd_eval)


PRESS_CONTINUATION = 256  # tokens scored after the prefilled prompt when a spec has a press


def cmd_eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.auto:
        from kvcache.eval.cli_auto import cmd_eval_auto

        return cmd_eval_auto(args)
    for opt in ("max_kl", "min_agree", "margin", "candidates"):
        if getattr(args, opt) is not None:
            raise InvalidParams(f"--{opt.replace('_', '-')} applies to --auto only")
    from kvcache.cache.config import parse_kv_spec
    from kvcache.engine.llm import LLM
    from kvcache.eval.fidelity import compare, read_text

    specs = [s.strip() for s in args.kv.split(";") if s.strip()]
    if not specs:
        raise InvalidParams("--kv needs at least one cache spec")
    for s in specs:
        if not parse_kv_spec(s).uses_cache:
            raise InvalidParams(f"--kv {s!r}: 'none' recomputes exactly; compare cache strategies")
    if args.tokens < 2:
        raise InvalidParams(f"--tokens must be at least 2, got {args.tokens}")
    if args.chunk < 1:
        raise InvalidParams(f"--chunk must be at least 1, got {args.chunk}")
    try:
        depths = tuple(float(x) for x in args.passkey_depths.split(",") if x.strip())
    except ValueError:
        raise InvalidParams(f"--passkey-depths takes numbers between 0 and 1, got {args.passkey_depths!r}") from None
    if args.passkey_tokens and (not depths or any(not 0 <= d <= 1 for d in depths)):
        raise InvalidParams(f"--passkey-depths takes numbers between 0 and 1, got {args.passkey_depths!r}")
    if args.greedy_tokens < 0:
        raise InvalidParams(f"--greedy-tokens must be 0 (skip) or more, got {args.greedy_tokens}")
    if args.passkey_tokens < 0:
        raise InvalidParams(f"--passkey-tokens must be 0 (skip) or more, got {args.passkey_tokens}")
    text, source = read_text(args.text)
    if args.kvpress and args.continuation is None:
        raise InvalidParams("--kvpress compares after a prefilled prompt: add --continuation N (e.g. 256)")
    pressed = [s for s in specs if parse_kv_spec(s).press is not None]
    if pressed and args.continuation is None:
        # teacher-forced scoring feeds the text in chunks and never ends a prompt: a press would never
        # act, and its rows would be the full cache's. Score a continuation after a prefilled prompt.
        args.continuation = min(PRESS_CONTINUATION, args.tokens // 2)
        print(f"eval: {pressed[0]!r} has a press, which acts once a prompt is in: prefilling the first "
              f"{args.tokens - args.continuation} tokens and scoring the last {args.continuation} "
              f"(--continuation {args.continuation})", file=sys.stderr)
    if args.continuation is not None:
        from kvcache.eval.cli_press import cmd_eval_continuation

        return cmd_eval_continuation(args, text, source, specs)
    if args.compare_weights is not None:
        from kvcache.eval.cli_weights import cmd_eval_weights

        return cmd_eval_weights(args, text, source)
    llm = LLM(args.model, threads=args.threads, weights=args.weights)
    ids = llm.encode(text)[: args.tokens]
    if len(ids) < 2:
        raise InvalidParams(f"{source} gives {len(ids)} token: at least 2 are needed")
    bar = tqdm(total=(len(ids) - 1) * len(specs), desc="eval", unit="tok", file=sys.stderr)
    rows = [compare(llm.model, ids, s, args.chunk, progress=bar.update) for s in specs]
    bar.close()
    greedy: list[float] = []
    if args.greedy_tokens:
        from kvcache.eval.passkey import greedy_agreement

        greedy = [greedy_agreement(llm, s, ids[: max(1, len(ids) // 2)], args.greedy_tokens) for s in specs]
    keys = []
    if args.passkey_tokens:
        from kvcache.eval.passkey import passkey

        keys = [passkey(llm, s, args.passkey_tokens, depths) for s in ["dynamic", *specs]]
    print(f"\neval: {llm.model_name}, {len(ids)} tokens of {source}, chunks of {args.chunk}; "
          f"full fp32 cache perplexity {rows[0].ppl_full:.3f}")
    w = max(32, *(len(r.spec) for r in rows))  # the spec column fits the longest spec
    head = f"{'kv':<{w}} {'ppl':>8} {'vs full':>8} {'top-1 agree':>11} {'KL nats':>9} {'KV B/token':>11}"
    print(head + (f" {'greedy':>7}" if greedy else "") + (f" {'passkey':>8}" if keys else ""))
    full = f"{'dynamic (full)':<{w}} {rows[0].ppl_full:>8.3f} {1:>7.3f}x {1:>10.1%} {0:>9.4f} {'':>11}"
    print(full + (f" {1:>6.0%}" if greedy else "") + (f" {keys[0].accuracy:>7.0%}" if keys else ""))
    for i, r in enumerate(rows):
        line = (f"{r.spec:<{w}} {r.ppl:>8.3f} {r.ppl / r.ppl_full:>7.3f}x {r.agreement:>10.1%} {r.kl:>9.4f} "
                f"{r.bytes_per_token:>11,.0f}")
        print(line + (f" {greedy[i]:>6.0%}" if greedy else "") + (f" {keys[i + 1].accuracy:>7.0%}" if keys else ""))
    if greedy:
        print(f"greedy: share of {args.greedy_tokens} greedy tokens after the text's first {max(1, len(ids) // 2)} "
              "tokens equal to the full cache's, position by position")
    if keys:
        print(f"passkey: a 5-digit key at depths {', '.join(map(str, depths))} of {keys[0].tokens}-token prompts, "
              "8 greedy tokens")
    results = [r.as_dict() for r in rows]
    for i, r in enumerate(results):
        if greedy:
            r["greedy_agreement"] = greedy[i]
        if keys:
            r["passkey"] = {"accuracy": keys[i + 1].accuracy, "found": list(keys[i + 1].found)}
    if args.plot:
        from kvcache.inspect.plots import fidelity_plot

        fidelity_plot(results, Path(args.plot), f"{llm.model_name}: fidelity against KV bytes ({len(ids)} tokens)")
        print(f"plot: {args.plot}")
    if args.json:
        meta = {"model": llm.model_name, "tokens": len(ids), "chunk": args.chunk, "text": source,
                "passkey_full": keys[0].accuracy if keys else None, "passkey_depths": list(depths)}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0
