"""``kvcache eval --continuation N [--kvpress]``: fidelity after a compressed prompt, beside kvpress.

The first ``--tokens`` - N tokens of the text are prefilled through each strategy (a press compresses
them when they are in), the last N are scored against the full fp32 cache (eval/continuation.py);
the passkey question is asked after its filler was prefilled on its own. With ``--kvpress`` every
spec that has a press gets kvpress's figures for the same press and ratio on the same token ids
(a child process in .venv-kvpress; kvpress keeps an fp32 cache, so an int4 spec is compared with
the fp32 press), and the paired difference of per-position KL with its standard error says whether
the two agree within the noise of the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvcache.cache.config import parse_kv_spec


def peer_case(spec: str) -> dict | None:
    """kvpress's case for a kvcache spec: its press and ratio (or kept tokens); None without a press."""
    cfg = parse_kv_spec(spec)
    if cfg.press is None:
        return None
    return {"press": cfg.press, "ratio": cfg.ratio} if cfg.ratio is not None else {"press": cfg.press, "budget": cfg.keep}


def paired(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float]:
    """Mean of a - b over paired positions and its standard error."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    if n < 2:
        return float("nan"), float("nan")
    m = sum(d) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)


def cmd_eval_continuation(args: argparse.Namespace, text: str, source: str, specs: list[str]) -> int:
    from tqdm import tqdm

    from kvcache.engine.llm import LLM
    from kvcache.eval.continuation import measure, reference, split
    from kvcache.eval.passkey import passkey_after, passkey_cases

    depths = tuple(float(x) for x in args.passkey_depths.split(",") if x.strip())
    llm = LLM(args.model, threads=args.threads, weights=args.weights, prefix=False)
    context, cont = split(llm.encode(text)[: args.tokens], args.continuation)
    steps = len(specs) * (2 if args.passkey_tokens else 1) + (1 if args.passkey_tokens else 0)
    bar = tqdm(total=steps, desc="eval", unit="run", file=sys.stderr)
    ref = reference(llm.model, context, cont)
    rows = []
    for s in specs:
        rows.append(measure(llm.model, ref, s))
        bar.update(1)
    keys = []
    if args.passkey_tokens:
        for s in ["dynamic", *specs]:
            keys.append(passkey_after(llm, s, args.passkey_tokens, depths))
            bar.update(1)
    bar.close()
    peer_rows: dict[str, object] = {}
    peer_note, versions = "", {}
    cases = [c for c in dict.fromkeys(json.dumps(peer_case(s)) for s in specs) if c != "null"]
    if args.kvpress and cases:
        from kvcache.peers.kvpress_peer import run_kvpress
        from kvcache.models.loading import fp32_folder

        pk = passkey_cases(llm.tokenizer, args.passkey_tokens, depths) if args.passkey_tokens else []
        print(f"kvpress: {len(cases)} press cases in .venv-kvpress ...", file=sys.stderr)
        run = run_kvpress(fp32_folder(args.model), [json.loads(c) for c in cases], context, cont,
                          [(c, q) for c, q, _ in pk], eos=llm.tokenizer.eos_token_ids, threads=args.threads)
        peer_note, versions = run.note, run.versions
        for c, r in zip(cases, run.rows):
            found = tuple(str(k) in llm.tokenizer.decode(list(a)) for (_, _, k), a in zip(pk, r.answers))
            peer_rows[c] = (r, found)
    fp32 = llm.model.config.kv_bytes_per_token()
    print(f"\neval: {llm.model_name}, a {len(context)}-token context of {source} prefilled through each strategy, "
          f"then {len(cont) - 1} positions scored; full fp32 cache perplexity {ref.ppl:.3f}")
    print(f"{'kv':<40} {'ppl':>8} {'top-1':>7} {'KL nats':>9} {'± SE':>7} {'KV B/token':>11} {'vs fp32':>8}"
          + (f" {'passkey':>8}" if keys else ""))
    if keys:
        print(f"{'dynamic (full)':<40} {ref.ppl:>8.3f} {1:>6.1%} {0:>9.4f} {0:>7.4f} {fp32:>11,} {1:>7.3f}x "
              f"{sum(keys[0].found):>4}/{len(depths)}")
    results = []
    for i, r in enumerate(rows):
        line = (f"{r.spec:<40} {r.ppl:>8.3f} {r.agreement:>6.1%} {r.kl:>9.4f} {r.kl_se:>7.4f} "
                f"{r.bytes_per_token:>11,.0f} {r.bytes_per_token / fp32:>7.3f}x")
        res = r.as_dict() | {"fp32_ratio": r.bytes_per_token / fp32}
        if keys:
            line += f" {sum(keys[i + 1].found):>4}/{len(depths)}"
            res["passkey"] = list(keys[i + 1].found)
        print(line)
        case = json.dumps(peer_case(r.spec))
        if case in peer_rows:
            p, found = peer_rows[case]
            if p.skipped:
                print(f"  {'kvpress':<38} skipped: {p.skipped}")
                res["kvpress"] = {"skipped": p.skipped}
            else:
                d, se = paired(r.kl_each, p.kl)
                held = (p.kept + 1) * fp32 / (len(context) + 1)  # its fp32 DynamicCache, as kvcache's bytes are read
                verdict = "within noise" if abs(d) <= 2 * se else "differs"
                print(f"  {'kvpress ' + p.press + ' ' + format(p.ratio if p.ratio is not None else p.budget, 'g'):<38} "
                      f"{p.ppl:>8.3f} {p.agreement:>6.1%} {p.mean_kl:>9.4f} {'':>7} {held:>11,.0f} {held / fp32:>7.3f}x"
                      + (f" {sum(found):>4}/{len(depths)}" if keys else "")
                      + f"   KL diff {d:+.4f} ± {se:.4f}: {verdict}")
                res["kvpress"] = {"ppl": p.ppl, "kl": p.mean_kl, "agreement": p.agreement, "kept": p.kept,
                                  "bytes_per_token": held, "passkey": list(found), "kl_diff": d, "kl_diff_se": se}
        results.append(res)
    if args.kvpress and not cases:
        print("kvpress: no spec has a press; nothing to compare")
    elif peer_note:
        print(f"kvpress: {peer_note}")
    elif versions:
        print("kvpress: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if keys:
        print(f"passkey: a 5-digit key at depths {', '.join(map(str, depths))} of {keys[0].tokens}-token prompts, "
              "the question asked after the filler was prefilled; 8 greedy tokens")
    if args.json:
        meta = {"model": llm.model_name, "text": source, "context": len(context), "scored": len(cont) - 1,
                "ppl_full": ref.ppl, "fp32_bytes_per_token": fp32, "passkey_depths": list(depths),
                "passkey_full": list(keys[0].found) if keys else None, "kvpress_versions": versions,
                "kvpress_note": peer_note}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0
