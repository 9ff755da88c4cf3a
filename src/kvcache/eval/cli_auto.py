"""``kvcache eval --auto --max-kl X`` and ``--kv auto[,kl=X]``: calibrate, print, save, reload.

``kvcache eval --auto`` always measures (and replaces the saved table); ``--kv auto`` for generate,
chat and serve loads the saved choice, picks one from the saved table for a new budget, and
measures only when the model has no saved table (saying so on stderr).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from kvcache.cache.config import parse_kv_spec
from kvcache.errors import InvalidParams
from kvcache.eval.auto import (DEFAULT_MARGIN, DEFAULT_MAX_KL, DEFAULT_MIN_AGREE, Budget, candidates, load, measure_table,
                               parse_auto, record, save, store_path, text_digest)

CAL_TOKENS = 2048
CAL_CONTINUATION = 256


def calibrate(llm, text: str, source: str, budget: Budget, tokens: int = CAL_TOKENS,
              continuation: int = CAL_CONTINUATION, specs: Sequence[str] | None = None,
              out: TextIO = sys.stdout) -> tuple[dict, dict]:
    """Measure ``specs`` (default: every candidate) on the first ``tokens`` tokens of ``text``,
    print the table and the choice, save both beside the model's fingerprint; (saved data, row)."""
    from tqdm import tqdm

    from kvcache.eval.continuation import split
    from kvcache.models.loading import model_fingerprint, resolve_model

    if tokens < continuation + 2:
        raise InvalidParams(f"--tokens ({tokens}) must exceed the scored continuation ({continuation}) by 2 or more")
    specs = list(specs or candidates())
    if not any(s.strip() in ("dynamic", "fp32") for s in specs):
        specs.insert(0, "dynamic")  # the full cache: a choice always exists
    ids = llm.encode(text)[:tokens]
    context, cont = split(ids, continuation)
    fingerprint = model_fingerprint(resolve_model(llm.model_path).path)
    bar = tqdm(total=len(specs), desc="kv auto", unit="strategy", file=sys.stderr)
    rows = measure_table(llm.model, context, cont, specs, bar.update)
    bar.close()
    calibration = {"text": source, "sha256": text_digest(text), "context": len(context), "continuation": len(cont) - 1,
                   "weights": llm.weights, "model": llm.model_name, "fp32_bytes_per_token": llm.model.config.kv_bytes_per_token()}
    data, row = record(load(fingerprint), fingerprint, calibration, rows, budget)
    path = save(fingerprint, data)
    print_table(data, budget, row, out)
    print(f"saved: {path} (`--kv auto` or `--kv auto,kl={budget.max_kl:g}` use it without measuring)", file=out)
    return data, row


def cmd_eval_auto(args) -> int:
    """``kvcache eval --auto``: calibrate on ``--text`` (or the built-in text) and save the choice."""
    from kvcache.engine.llm import LLM
    from kvcache.eval.fidelity import read_text

    budget = Budget(DEFAULT_MAX_KL if args.max_kl is None else args.max_kl,
                    DEFAULT_MIN_AGREE if args.min_agree is None else args.min_agree,
                    DEFAULT_MARGIN if args.margin is None else args.margin)
    specs = None
    if args.candidates is not None:
        specs = [s.strip() for s in args.candidates.split(";") if s.strip()]
        if not specs:
            raise InvalidParams("--candidates needs at least one cache spec (separated by ';')")
        for s in specs:
            parse_kv_spec(s)  # a bad spec is refused before the model loads
    text, source = read_text(args.text)
    llm = LLM(args.model, threads=args.threads, weights=args.weights, prefix=False)
    cont = CAL_CONTINUATION if args.continuation is None else args.continuation
    data, row = calibrate(llm, text, source, budget, args.tokens, cont, specs)
    if args.json:
        Path(args.json).write_text(json.dumps({"choice": row, **data}, indent=2))
    return 0


def print_table(data: dict, budget: Budget, chosen: dict, out: TextIO = sys.stdout) -> None:
    cal = data["calibration"]
    fp32 = cal["fp32_bytes_per_token"]
    print(f"\nkv auto: {cal['model']} ({cal['weights']} weights), a {cal['context']}-token context of {cal['text']} "
          f"prefilled through each strategy, then {cal['continuation']} positions scored against the full fp32 cache",
          file=out)
    print(f"budget: mean KL + {budget.margin:g} SE <= {budget.max_kl:g} nats, top-1 agreement >= {budget.min_agree:.0%}; "
          "the cheapest in bytes per token that meets it is chosen", file=out)
    print(f"{'kv':<36} {'KL nats':>9} {'± SE':>8} {'top-1':>7} {'ppl':>8} {'KV B/token':>11} {'vs fp32':>8}  ok",
          file=out)
    rows = sorted(data["table"], key=lambda r: (r.get("bytes_per_token", float("inf")), r.get("kl", 0)))
    for r in rows:
        if "error" in r:
            print(f"{r['asked']:<36} refused: {r['error']}", file=out)
            continue
        mark = "<- chosen" if r is chosen or r["spec"] == chosen["spec"] else ("yes" if budget.admits(r) else "")
        print(f"{r['spec']:<36} {r['kl']:>9.4f} {r['kl_se']:>8.4f} {r['agreement']:>6.1%} {r['ppl']:>8.3f} "
              f"{r['bytes_per_token']:>11,.0f} {r['bytes_per_token'] / fp32:>7.3f}x  {mark}", file=out)
    print(f"choice: {chosen['spec']}: KL {chosen['kl']:.4f} ± {chosen['kl_se']:.4f} nats, top-1 {chosen['agreement']:.1%}, "
          f"{chosen['bytes_per_token']:,.0f} B/token ({chosen['bytes_per_token'] / fp32:.3f}x fp32)", file=out)


def resolve_auto(spec: str, model: str | None, weights: str = "file", threads: int | None = None,
                 err: TextIO = sys.stderr) -> str:
    """The cache spec ``--kv auto[,kl=X,...]`` stands for on ``model``: the saved choice, a choice
    from the saved table, or (none saved) a calibration on the built-in text, measured now."""
    from kvcache.models.loading import model_fingerprint, resolve_model

    budget = parse_auto(spec)
    fingerprint = model_fingerprint(resolve_model(model).path)
    data = load(fingerprint)
    if data is not None and data.get("table"):
        key = budget.key if budget is not None else data.get("last")
        if key in data.get("choices", {}):
            return str(data["choices"][key]["spec"])
        if budget is not None:
            data, row = record(data, fingerprint, data["calibration"], None, budget)
            save(fingerprint, data)
            print(f"kvcache: --kv auto picked {row['spec']} for {budget.key} from the table measured on "
                  f"{data['calibration']['text']} ({store_path(fingerprint)})", file=err)
            return str(row["spec"])
    from kvcache.engine.llm import LLM
    from kvcache.eval.fidelity import builtin_text

    budget = budget or Budget(DEFAULT_MAX_KL, DEFAULT_MIN_AGREE)
    print(f"kvcache: no saved --kv auto choice for this model: measuring {len(candidates())} cache strategies on "
          f"the built-in calibration text ({budget.key}); this happens once, `kvcache eval --auto` redoes it",
          file=err)
    llm = LLM(model, weights=weights, threads=threads, prefix=False)
    _, row = calibrate(llm, builtin_text(), "pydoc_data.topics", budget, out=err)
    return str(row["spec"])
