"""``kvcache size``: the KV size calculator on the command line, with the weights beside it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvcache.cliargs import WEIGHTS
from kvcache.errors import InvalidParams
from kvcache.fmt import human_bytes

if TYPE_CHECKING:
    from kvcache.inspect.weight_size import WeightSize
    from kvcache.models.config import ModelConfig

DEFAULT_SPECS = "dynamic;fp16;int8;int4;int2;sink"


def add_size_parser(sub: argparse._SubParsersAction) -> None:
    from kvcache.inspect.known_models import known_names

    s = sub.add_parser("size", help="KV cache bytes of a model under each strategy, and what fits a budget",
                       description=f"Known models: {known_names()}; or a bundled model (kvcache models), a config.json, "
                                   "model folder or GGUF file.")
    s.add_argument("model", nargs="?", default=None, help="model (default: SmolLM2-135M)")
    s.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's context)")
    s.add_argument("--batch", type=int, default=1, help="sequences held at once (default 1)")
    s.add_argument("--kv", default=DEFAULT_SPECS,
                   help=f"cache specs separated by ';' (default {DEFAULT_SPECS!r}), e.g. 'fp16;int4,window=4096'")
    s.add_argument("--budget", type=float, default=None, help="memory budget in GiB: longest context and largest batch")
    s.add_argument("--weights", default=None, choices=WEIGHTS,
                   help="with --budget: the weights, held this way, come out of the budget first (file: a GGUF's "
                        "own types; needs a GGUF file)")
    s.add_argument("--no-context-cap", action="store_true",
                   help="with --budget: the longest context the memory allows, past the model's own context "
                        "limit (what a longer-context model of the same shape would fit)")
    s.set_defaults(func=cmd_size)


def cmd_size(args: argparse.Namespace) -> int:
    from kvcache.cache.config import parse_kv_spec
    from kvcache.inspect.size import (UNCAPPED, bounded, kv_size, largest_batch, load_model_config,
                                      longest_context)

    specs = [x.strip() for x in args.kv.split(";") if x.strip()]
    if not specs:
        raise InvalidParams("--kv needs at least one cache spec")
    configs = [(s, parse_kv_spec(s)) for s in specs]
    for s, c in configs:
        if not c.uses_cache:
            raise InvalidParams(f"--kv {s!r}: the 'none' strategy keeps no cache to size")
    if args.budget is not None and args.budget <= 0:
        raise InvalidParams(f"--budget must be a positive number of GiB, got {args.budget}")
    if args.no_context_cap and args.budget is None:
        raise InvalidParams("--no-context-cap changes the longest context in a --budget: give --budget GiB too")
    if args.weights is not None and args.budget is None:
        raise InvalidParams("--weights says what comes out of a --budget: give --budget GiB too")
    name, model = load_model_config(args.model)
    context = args.context if args.context is not None else model.max_position
    if context < 1 or args.batch < 1:
        raise InvalidParams(f"--context and --batch must be at least 1 (got {context} and {args.batch})")
    sliding = sum(w is not None for w in model.layer_windows)
    weights = _weights(args, model)
    budget = int(args.budget * 2**30) if args.budget is not None else None
    if budget is not None and args.weights is not None:
        assert weights is not None
        held = weights.by_mode[args.weights]
        if held >= budget:
            raise InvalidParams(f"{args.weights} weights take {human_bytes(held)}: nothing of a {args.budget:g} GiB "
                                "budget is left for the KV cache")
        budget -= held
    fp32 = kv_size(model, parse_kv_spec("dynamic"), context, args.batch).bytes_total
    rows = []  # computed before anything is printed: a bad budget is one line, no half table
    for s, c in configs:
        size = kv_size(model, c, context, args.batch)
        per_token = size.bytes_total / (context * args.batch)
        row = f"{s:<24} {per_token:>10,.0f} {human_bytes(size.bytes_total):>11} {size.bytes_total / fp32:>7.2f}x"
        if budget is not None:
            longest = longest_context(model, c, args.batch, budget, capped=not args.no_context_cap)
            text = f"{longest}" + ("+" if longest == model.max_position and bounded(model, c) else "")
            text = "unbounded" if longest >= UNCAPPED else text
            row += f" {text:>16} {largest_batch(model, c, context, budget):>14}"
        rows.append(row)
    print(f"{name}: {model.num_layers} layers ({sliding} sliding), {model.num_kv_heads} KV heads x "
          f"{model.head_dim}, context {context}, batch {args.batch}"
          + (f" (longest context: past the model's {model.max_position})" if args.no_context_cap else ""))
    if weights is not None:
        from kvcache.inspect.weight_size import describe

        print(f"weights: {describe(weights, human_bytes)}")
    if budget is not None and args.weights is not None:
        print(f"KV budget: {args.budget:g} GiB less {args.weights} weights = {human_bytes(budget)}")
    head = f"{'kv':<24} {'B/token':>10} {'KV':>11} {'vs fp32':>8}"
    if budget is not None:
        head += f" {'longest context':>16} {'largest batch':>14}"
    print(head)
    print("\n".join(rows))
    print("B/token: the cache's bytes at this context per token held (windows keep fewer tokens); "
          "'+': every layer keeps a window, so any length fits")
    return 0


def _weights(args: argparse.Namespace, model: ModelConfig) -> WeightSize | None:
    """The weights' bytes per mode (None when the config lacks what they depend on)."""
    from pathlib import Path

    from kvcache.inspect.weight_size import weight_size

    gguf = Path(str(args.model)) if args.model and str(args.model).endswith(".gguf") else None
    if args.weights == "file" and gguf is None:
        raise InvalidParams("--weights file needs a GGUF file as the model (its own types are what file holds)")
    if model.intermediate_size <= 1:  # a config.json without the MLP's size
        if args.weights is not None:
            raise InvalidParams("--weights: this config has no intermediate_size, so its weights cannot be counted")
        return None
    return weight_size(model, gguf)
