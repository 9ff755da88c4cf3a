"""Command-line options shared by several subcommands, and what they turn into: the ``--kv`` spec
with its budget, the sampling parameters, the loaded model with its prefix cache.

Only argparse at import time (the parser builds fast); the engine loads inside the functions that
need it. Every console module (the top-level CLI, ``serve``, ``bench``, ``size``, ``inspect``,
``eval``) takes its shared options from here, and none imports another's.
"""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from kvcache.errors import InvalidParams

if TYPE_CHECKING:
    from kvcache.cache.config import CacheConfig
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams
    from kvcache.prefix.config import PrefixConfig

WEIGHTS = ("file", "fp32", "q8", "q4")
KV_HELP = (
    "cache spec, comma-separated (default: dynamic). Presets: none, dynamic, static, offloaded, "
    "offloaded_static, quantized (int4), sliding_window, sink. Axes: dynamic|static[,max_tokens=N]; "
    "window=N[,sinks=K]; fp32|fp16|bf16|int8|int4|int2[,group_size=G][,residual=R][,rotate] (rotate: K/V "
    "Hadamard-rotated per head before quantizing); "
    "device|host|disk[,dir=PATH]; page_size=N. Example: static,int4,sinks=4,window=1024. "
    "auto[,kl=X]: the cheapest strategy within a KL budget, measured once by `kvcache eval --auto` and saved"
)


def add_weights_arg(p: argparse.ArgumentParser, default: str = "file") -> None:
    p.add_argument("--weights", default=default, choices=WEIGHTS,
                   help="how weights are held: file (a GGUF's own quantized types, multiplied by int8 kernels; "
                        "the default), fp32, or q8/q4 (quantized at load, HF folders too)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, its cache spec and budget, its weights mode and the torch threads."""
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, HF model folder, hub id or bundled name (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--kv", default="dynamic", help=KV_HELP)
    add_weights_arg(p)
    p.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="most memory a dynamic KV pool may hold: GiB (2), a unit (512MiB) or a share of RAM "
                        "(25%%). Beyond it requests wait or are preempted; `serve` defaults to 50%%")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all available cores)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="speculative decoding with a draft model of the same tokenizer (a smaller or more quantized "
                        "one): it proposes 8 tokens at a time for every request that allows it; the text is the "
                        "text without it")
    p.add_argument("--draft-weights", default="file", choices=WEIGHTS, help="how the draft model's weights are held")
    p.add_argument("--template-timeout", type=float, default=None, metavar="SECONDS",
                   help="longest a chat template may take to render a prompt (default 1); a template that "
                        "cannot render a short conversation in it refuses the model at load")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    """The prefix cache: on or off, its RAM budget, its disk and Redis tiers, their secret."""
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
                        "entries without the right MAC are misses. Also KVCACHE_TIER_SECRET. Without one, the "
                        "installation's own secret ($KVCACHE_HOME/tier-secret, made on first use) is used: give "
                        "every machine that shares a tier the same file")
    p.add_argument("--tier-unsigned", action="store_true",
                   help="tier entries carry only a CRC-32 (catches bit rot, not a forger who can write to the "
                        "folder or the Redis)")
    p.add_argument("--tier-timeout", type=float, default=2.0, metavar="S",
                   help="longest wait for a tier read; a tier slower than this is a miss and is skipped for a "
                        "while (default 2)")
    p.add_argument("--tier-secret", default=None, metavar="SECRET",
                   help="the same secret given inline (it shows in `ps`: prefer the file or the variable)")


def add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=max_new, help=f"tokens to generate (default {max_new})")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this share of the most likely one's probability (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, -2 to 2 (default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, -2 to 2 (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="transformers' and vLLM's, over prompt and output tokens (default 1: off)")
    p.add_argument("--min-tokens", type=int, default=0, help="hold back EOS until this many tokens are out")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], metavar="ID",
                   help="a token id that ends the text like EOS (repeatable)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100 to 100) to token ID's logit (repeatable)")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="K",
                   help="speculative decoding: up to K tokens proposed per forward from n-grams of the prompt and "
                        "output, verified in one forward; the text is the text without it (default 0: off)")
    p.add_argument("--prediction", default=None, metavar="TEXT",
                   help="speculative decoding from the text you expect (inline or @FILE), as OpenAI's predicted "
                        "outputs: an edit of a file given as the file runs several tokens a forward")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="the text must be JSON valid under this JSON schema (inline JSON, or @FILE)")
    c.add_argument("--json", action="store_true", help="the text must be a JSON object")
    c.add_argument("--regex", default=None, help="the text must match this regular expression")
    c.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the text must be one of these (repeatable)")
    c.add_argument("--grammar", default=None, metavar="GRAMMAR",
                   help="the text must follow this grammar: GBNF (rules 'name ::= ...') or Lark, inline or @FILE")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The options of ``add_sampling_args`` as SamplingParams."""
    from kvcache.engine.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
        stop_token_ids=tuple(args.stop_token_id), logit_bias=_logit_bias(args.logit_bias), constraint=_constraint(args),
        prompt_lookup=args.prompt_lookup,
    )


def prediction_text(args: argparse.Namespace) -> str | None:
    """``--prediction``'s text (read from the file for @FILE), or None."""
    value = getattr(args, "prediction", None)
    return None if value is None else _text_or_file(value, "--prediction")


def _logit_bias(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise InvalidParams(f"--logit-bias {item!r}: give ID=BIAS, e.g. 1234=-100") from None
        if not sep:
            raise InvalidParams(f"--logit-bias {item!r}: give ID=BIAS, e.g. 1234=-100")
    return out


def _text_or_file(value: str, flag: str) -> str:
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidParams(f"{flag} {value}: cannot read the file ({e.strerror})") from None


def _constraint(args: argparse.Namespace):  # noqa: ANN202 - Constraint | None, imported lazily
    from kvcache.engine.grammar import Constraint

    if getattr(args, "json_schema", None) is not None:
        return Constraint.json_schema(_text_or_file(args.json_schema, "--json-schema"))
    if getattr(args, "json", False):
        return Constraint.json_object()
    if getattr(args, "regex", None) is not None:
        return Constraint.regex(args.regex)
    if getattr(args, "choice", None):
        return Constraint.choice(args.choice)
    if getattr(args, "grammar", None) is not None:
        return Constraint.grammar(_text_or_file(args.grammar, "--grammar"))
    return None


def kv_config(args: argparse.Namespace, default_budget: str | None = None) -> CacheConfig:
    """The --kv spec with --kv-budget applied (``default_budget`` for a dynamic pool without one)."""
    from dataclasses import replace

    from kvcache.cache.budget import parse_budget
    from kvcache.cache.config import parse_kv_spec

    spec = args.kv
    if isinstance(spec, str) and spec.strip().split(",")[0].strip() == "auto":  # the quality gate's choice
        from kvcache.eval.cli_auto import resolve_auto

        spec = resolve_auto(spec, args.model, getattr(args, "weights", "file"), getattr(args, "threads", None))
    kv = parse_kv_spec(spec)
    budget = getattr(args, "kv_budget", None)
    if budget is None and kv.capacity == "dynamic" and kv.budget is None:
        budget = default_budget
    return replace(kv, budget=parse_budget(budget)) if budget is not None else kv


def load_llm(args: argparse.Namespace, default_budget: str | None = None) -> LLM:
    """The model of ``add_model_args`` with the prefix cache of ``add_prefix_args`` (off or at its
    defaults where the command has no such options). A bad spec is refused before the model loads
    (and before torch is imported)."""
    kv = kv_config(args, default_budget)
    from kvcache.models.bundled import check_named

    check_named(args.model)
    timeout = getattr(args, "template_timeout", None)
    if timeout is not None and not timeout > 0:
        raise InvalidParams(f"--template-timeout must be a positive number of seconds, got {timeout}")
    from kvcache.engine.llm import LLM

    return LLM(args.model, kv=kv, threads=args.threads, prefix=prefix_config(args), weights=args.weights,
               draft_model=getattr(args, "draft_model", None), draft_weights=getattr(args, "draft_weights", "file"),
               template_timeout=getattr(args, "template_timeout", None))


def prefix_config(args: argparse.Namespace) -> PrefixConfig:
    """The prefix cache of ``add_prefix_args`` (at its defaults where the command has no such options)."""
    from dataclasses import replace

    from kvcache.prefix.config import SECRET_ENV, PrefixConfig, tier_secret

    secret = tier_secret(getattr(args, "tier_secret", None), getattr(args, "tier_secret_file", None))
    unsigned = getattr(args, "tier_unsigned", False)
    if unsigned and secret is not None:
        raise InvalidParams("--tier-unsigned and a tier secret (--tier-secret-file, --tier-secret, "
                            f"{SECRET_ENV}) exclude each other")
    config = PrefixConfig(enabled=not getattr(args, "no_prefix_cache", False),
                          max_cached_tokens=getattr(args, "prefix_tokens", 16384),
                          disk=getattr(args, "prefix_dir", None), redis=getattr(args, "redis", None), secret=secret,
                          unsigned=unsigned, tier_timeout_s=getattr(args, "tier_timeout", 2.0))
    if config.tiers and secret is None and not unsigned:  # resolved here, so that replicas elsewhere share it
        config = replace(config, secret=config.mac_secret())
    return config


def weights_list(args: argparse.Namespace, default: str) -> list[str]:
    """A comma-separated ``--weights`` as a list of modes (``default`` when not given); an unknown
    mode is refused."""
    text = args.weights if args.weights is not None else default
    modes = list(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    for w in modes:
        if w not in WEIGHTS:
            raise InvalidParams(f"--weights: unknown mode {w!r}; choose from {', '.join(WEIGHTS)}")
    if not modes:
        raise InvalidParams(f"--weights needs at least one mode ({', '.join(WEIGHTS)})")
    return modes


def one_weights(args: argparse.Namespace, default: str = "fp32") -> str:
    """``--weights`` where the command (``args.suite``) runs one mode."""
    modes = weights_list(args, default)
    if len(modes) > 1:
        raise InvalidParams(f"--weights: the {args.suite} suite runs one weights mode, got {', '.join(modes)}")
    return modes[0]


def split_specs(text: str) -> list[str]:
    """Split a ``--kv`` list into specs: comma-separated items, where an option (``key=value``)
    and an item that is no spec on its own (a flag such as ``rotate``) belong to the spec before
    it. ``dynamic,fp16,int8,int4,sink`` is five specs, ``dynamic,int8,sinks=4,window=1024`` two
    (``dynamic`` and ``int8,sinks=4,window=1024``), ``fp16,int4,rotate`` two. With ``;`` the specs
    are separated explicitly: ``static,int4;dynamic``."""
    if ";" in text:
        return [s.strip().strip(",") for s in text.split(";") if s.strip().strip(",")]
    specs: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if specs and ("=" in item or not _spec_alone(item)):
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def _spec_alone(item: str) -> bool:
    """Whether ``item`` parses as a whole cache spec by itself."""
    from kvcache.cache.config import parse_kv_spec

    try:
        parse_kv_spec(item)
    except InvalidParams:
        return False
    return True



# --- stopping from the first instant -------------------------------------------------------------

_STOPS: list[int] = []  # the SIGINT/SIGTERM signals this process has received


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt from now on and are remembered (``stop_asked``), so
    that a stop survives code that swallows the exception. Installed by the CLI's first line: a
    command started where SIGINT is ignored (a shell's background job inherits SIG_IGN, and Python
    keeps it) still stops on one."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    if sys.unraisablehook is not _unraisable:
        global _default_unraisable
        _default_unraisable = sys.unraisablehook
        sys.unraisablehook = _unraisable


def stop_asked() -> bool:
    """Whether a SIGINT or SIGTERM has come since ``stop_on_signals``."""
    return bool(_STOPS)


_DEFERRED = [0]  # depth of stops_deferred blocks running


@contextmanager
def stops_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM only remembered while the block runs, then raised as KeyboardInterrupt
    when it ends: for imports of native extensions (torch, pydantic's core), where an exception
    raised inside their initialisation comes out as their own error (a SchemaError) or aborts the
    process. Such a block takes a second or two, so a stop still comes within seconds."""
    _DEFERRED[0] += 1
    try:
        yield
    finally:
        _DEFERRED[0] -= 1
    if _STOPS and not _DEFERRED[0]:
        raise KeyboardInterrupt(f"signal {_STOPS[-1]}")


def _stop(signum: int, _frame: object) -> None:
    _STOPS.append(signum)
    if not _DEFERRED[0]:
        raise KeyboardInterrupt(f"signal {signum}")


_default_unraisable = sys.unraisablehook


def _unraisable(u: object) -> None:
    """A stop's KeyboardInterrupt raised where Python cannot pass it on (a weakref callback in the
    middle of an import, a finalizer) is dropped without a traceback: the stop is remembered
    (``stop_asked``) and the command acts on it. Anything else goes to the hook before ours."""
    if isinstance(getattr(u, "exc_value", None), KeyboardInterrupt) and _STOPS:
        return
    _default_unraisable(u)
