"""``kvcache bench spec``: speculative decoding against decoding one token per forward, batch 1,
greedy, on three workloads, beside transformers' prompt lookup on the same fp32 weights and
llama-server's n-gram lookup on the same GGUF file.

Workloads (chat prompts, at most ``--new-tokens`` new tokens, EOS ends a text):
- code edit: a 62-line Python file and an instruction to rename one of its functions. Speculation
  by a prediction (OpenAI's predicted outputs: the file as the answer would write it), by a
  prediction that misses (another Python file: what a wrong prediction costs, which should be at
  most 3%), by prompt lookup, and the ceiling: a prediction that is the greedy output itself (taken
  from the run without speculation), where every proposal is right and only the cost of verifying
  remains;
- document: a question about a document of about 1050 tokens whose answer quotes it, by prompt
  lookup;
- free text: a short story, where little of the output repeats the prompt, by prompt lookup: what
  speculation costs where it finds little to propose.
With fp32 weights each workload also runs with a draft model: the same model's GGUF weights
(quantized, several times cheaper a token) proposing for its fp32 self; the draft's own forwards,
its prefill of the prompt among them, count in the decode time.

kvcache's side runs in this process, one loaded model per ``--weights`` mode. For each workload
the run without speculation and each speculating run take turns (the order rotates from repeat to
repeat), after one untimed run of each; the best of ``--repeats`` counts (the machine may be
shared), and the median over the rounds of each round's ratio to the run without speculation
beside it (``speedup_median``). Decode tok/s is ``RequestOutput.decode_tok_s``: the tokens after the first over the time
after the first. The model's prefix cache stays on, so that only the first run of a workload
prefills its whole prompt (the prompt's time is not in the figures); the draft's stays off, since
its prefill counts. Each row reports:
- acceptance: proposed tokens the model kept / tokens proposed (``spec_accepted`` /
  ``spec_proposed`` of the request's metrics);
- tokens per forward: (new tokens - 1) / the forwards after the prompt's, those that verified
  proposals and those that had none to verify (1.00 without speculation);
- forward cost: the time of a forward with speculation over one without (decode seconds /
  forwards, each side), so that speed-up = tokens per forward / forward cost;
- text: every speculating run's tokens against the run without speculation (greedy speculation
  is exact: they must be the same; a difference is counted, not raised).

transformers (the peer) runs in a child process (a crash or a missing package is a skipped row) on
the fp32 folder kvcache converted from the same file (peers/hf_transformers.py's weights), with the
same prompt token ids, EOS tokens and thread count: ``generate`` without and with
``prompt_lookup_num_tokens``, alternating, tok/s as peers/hf_transformers.py measures it (new
tokens after the first over the generate time less the time to first token of a one-token generate). Its forwards are counted by a forward
hook and its proposals by wrapping its prompt-lookup candidate generator, in one untimed run of
each; its first forward reads the prompt and verifies the first proposals together. Its greedy
text is compared with kvcache's fp32 text (fp32 sums in another order may part them: reported,
not failed). Its draft row: ``assistant_model`` a copy of the same model with its linear layers
quantized to int8 by torch's ``quantize_dynamic`` (transformers' cheapest way to a faster draft
of the same weights on a CPU; several times faster a token than fp32 there), 8 tokens proposed a
forward (``num_assistant_tokens``), its proposals counted by wrapping the assisted candidate
generator.

llama-server (the other peer) serves the model's own GGUF file twice, without speculation and
with its n-gram prompt lookup (``--spec-type ngram-simple``, at most ``lookup`` tokens proposed a
forward), on the very prompt token ids kvcache reads: ``/completion`` with the prompt as token
ids, greedy, ``n_predict`` new tokens at most, the prompt cache off, the tokens returned; the two
take turns per repeat after one untimed request each.

The peers' sides are peers/speculation.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.bench.report import cell, run_meta
from kvcache.bench.rows import Headline, model_name, one, positive
from kvcache.bench.spec_texts import EDIT, EDIT_PREDICTION, MISS, QUESTION, STORY
from kvcache.errors import InvalidParams
from kvcache.peers.row import method_label, spec_row
from kvcache.peers.speculation import llama_rows, peer_rows

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "spec"
ORDER = 50
OPTIONS = ("new_tokens", "repeats", "weights", "peers", "llama_cpp_bin")
# the file's weights: fp32 (and its draft rows) decodes several times slower; transformers' rows: 60 s more
QUICK = {"new_tokens": 16, "repeats": 1, "weights": "file", "peers": ""}
QUICK_LLAMA_CPP = {"peers": "llama-server"}

DEFAULT_NEW, QUICK_NEW = 128, 32
DEFAULT_REPEATS, QUICK_REPEATS = 3, 1
DEFAULT_WEIGHTS = "file,fp32"
PEERS = ("transformers", "llama-server")
LOOKUP = 6  # prompt lookup: tokens proposed per forward at most (kvcache and transformers alike)
FREE_COST_LIMIT = 0.03  # what speculation may cost where it finds little to propose

# workload -> (prompt, speculation methods); a method is "prediction", "miss", "ceiling" or "lookup"
WORKLOADS: dict[str, tuple[str, tuple[str, ...]]] = {
    "code edit": (EDIT, ("prediction", "miss", "ceiling", "lookup")),
    "document": (QUESTION, ("lookup",)),
    "free text": (STORY, ("lookup",)),
}


# -- kvcache's side -------------------------------------------------------------------------------


@dataclass
class Run:
    """One request: its tokens, decode tok/s and seconds, the forwards after the prompt's, metrics."""

    tokens: list[int]
    tok_s: float
    decode_s: float
    forwards: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ms_per_forward(self) -> float | None:
        return self.decode_s / self.forwards * 1000 if self.forwards else None


def one_run(llm: Any, ids: list[int], params: Any) -> Run:
    """Run one request as ``LLM.generate`` does (its prompt in one forward), counting its forwards."""
    run = llm.request(ids, params)
    for _ in run:
        pass
    out = run.result
    return Run(list(out.token_ids), out.decode_tok_s, out.decode_s, max(0, run.scheduler.steps - 1),
               dict(out.metrics))


def spec_params(method: str, new: int, lookup: int, prediction: dict[str, list[int]], output: list[int]) -> Any:
    """A method's parameters; ``prediction``: the token ids of the "prediction" and "miss" methods."""
    from kvcache.engine.params import SamplingParams

    if method in ("prediction", "miss"):
        return SamplingParams(max_tokens=new, prediction=tuple(prediction[method]))
    if method == "ceiling":
        return SamplingParams(max_tokens=new, prediction=tuple(output))
    if method == "draft":  # the draft model proposes for every request while it is attached
        return SamplingParams(max_tokens=new)
    return SamplingParams(max_tokens=new, prompt_lookup=lookup)


def bench_workload(llm: Any, workload: str, ids: list[int], methods: tuple[str, ...], new: int, repeats: int,
                   lookup: int, prediction: dict[str, list[int]], tick: Any = None,
                   draft: Any = None) -> tuple[list[dict[str, object]], list[int]]:
    """One workload on one loaded model: the rows of its speculation methods and the text without
    speculation (token ids). Untimed first runs, then ``repeats`` rounds of the run without
    speculation and each method, the order rotating by one each round. ``draft``: a draft model's
    runner, attached to the model for the "draft" method's runs only."""
    def run_side(side: str, params: Any) -> Run:
        if side != "draft":
            return one_run(llm, ids, params)
        llm.runner.draft = draft
        try:
            return one_run(llm, ids, params)
        finally:
            llm.runner.draft = None

    from kvcache.bench.measure import weights_label
    from kvcache.engine.params import SamplingParams

    plain_params = SamplingParams(max_tokens=new)
    ref = one_run(llm, ids, plain_params)  # the reference text, and the warm-up of one-token forwards
    params = {m: spec_params(m, new, lookup, prediction, ref.tokens) for m in methods}
    runs: dict[str, list[Run]] = {"plain": [], **{m: [] for m in methods}}
    mismatches = {m: 0 for m in methods}
    checked = {m: 0 for m in methods}
    for m in methods:  # untimed: warms the shapes of verifying forwards; its text is checked too
        r = run_side(m, params[m])
        checked[m] += 1
        mismatches[m] += r.tokens != ref.tokens
    sides = ["plain", *methods]
    for rep in range(repeats):
        at = rep % len(sides)
        for side in sides[at:] + sides[:at]:
            r = run_side(side, plain_params if side == "plain" else params[side])
            runs[side].append(r)
            if side != "plain":
                checked[side] += 1
                mismatches[side] += r.tokens != ref.tokens
            if tick:
                tick()
    plain = max(runs["plain"], key=lambda r: r.tok_s)
    rows = []
    for m in methods:
        best = max(runs[m], key=lambda r: r.tok_s)
        n = len(ref.tokens)
        proposed, accepted = best.metrics.get("spec_proposed", 0), best.metrics.get("spec_accepted", 0)
        rows.append(spec_row(
            "kvcache", weights_label(llm), llm.weights, workload, m, method_label(m, lookup), len(ids), tokens=n,
            plain_tok_s=plain.tok_s, spec_tok_s=best.tok_s, proposed=int(proposed), accepted=int(accepted),
            verifying_forwards=int(best.metrics.get("spec_forwards", 0)), forwards=best.forwards,
            plain_forwards=plain.forwards, plain_ms_per_forward=plain.ms_per_forward,
            spec_ms_per_forward=best.ms_per_forward, runs=checked[m], mismatches=mismatches[m],
            plain_tok_s_runs=[r.tok_s for r in runs["plain"]], spec_tok_s_runs=[r.tok_s for r in runs[m]],
            speedup_median=statistics.median(a.tok_s / b.tok_s for a, b in zip(runs[m], runs["plain"])),
            prediction_tokens=len(prediction[m]) if m in prediction else n if m == "ceiling" else None,
            text=llm.tokenizer.decode(ref.tokens)))
    return rows, ref.tokens


def bench_kvcache(model: str | None, mode: str, threads: int | None, prompts: dict[str, list[int]] | None,
                  new: int, repeats: int, lookup: int, tick: Any = None
                  ) -> tuple[list[dict[str, object]], dict[str, list[int]], dict[str, list[int]], str, list[int]]:
    """Every workload on the model loaded with weights ``mode``: rows, the prompts' token ids, the
    texts without speculation, the model's name and its EOS tokens."""
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams

    llm = LLM(model, threads=threads, weights=mode)
    if prompts is None:
        prompts = {w: llm.encode(p, chat=True) for w, (p, _) in WORKLOADS.items()}
    prediction = {m: llm.tokenizer.encode(text, add_special_tokens=False)
                  for m, text in (("prediction", EDIT_PREDICTION), ("miss", MISS))}
    first = next(iter(prompts.values()))
    llm.generate([first[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    draft = _draft(model, llm, threads) if mode == "fp32" else None
    rows, texts = [], {}
    for w, (_, methods) in WORKLOADS.items():
        ms = methods + (("draft",) if draft is not None else ())
        got, texts[w] = bench_workload(llm, w, prompts[w], ms, new, repeats, lookup, prediction, tick,
                                       draft.runner if draft is not None else None)
        rows += got
    name, eos = llm.model_name, sorted(llm.tokenizer.eos_token_ids)
    del llm, draft
    gc.collect()
    return rows, prompts, texts, name, eos


def _draft(model: str | None, llm: Any, threads: int | None) -> Any:
    """The model's own GGUF weights as the draft of its fp32 weights (None for a model without a
    GGUF file: nothing smaller to draft with)."""
    from kvcache.engine.llm import LLM

    if llm.weights != "fp32" or not str(llm.model_path).endswith(".gguf"):
        return None
    draft = LLM(model, threads=threads, weights="file", prefix=False)
    return draft if draft.weights != "fp32" else None


# -- the suite ----------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (None when they are the same)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_peer(rows: list[dict[str, Any]], texts: dict[str, list[int]] | None) -> None:
    """Each transformers row's greedy text against kvcache's fp32 text of its workload (in place):
    ``matches_kvcache`` and ``first_difference`` (None where kvcache fp32 did not run)."""
    for r in rows:
        ids = r.pop("token_ids", None)
        if texts is None or ids is None or r["workload"] not in texts:
            r["matches_kvcache"], r["first_difference"] = None, None
            continue
        at = first_difference(ids, texts[r["workload"]])
        r["matches_kvcache"], r["first_difference"] = at is None, at


def ratios(results: list[dict[str, Any]]) -> list[dict[str, object]]:
    """kvcache over each peer on the same workload, weights and kind of speculation (transformers:
    fp32, prompt lookup and a draft; llama-server: the GGUF file, prompt lookup): decode tok/s
    without speculation (``plain``) and with it (``spec``)."""
    out = []
    for p in results:
        if p["system"] == "kvcache" or not p["plain_tok_s"] or not p["spec_tok_s"]:
            continue
        for r in results:
            if (r["system"] == "kvcache" and r["pair"] == p["pair"] and r["workload"] == p["workload"]
                    and r["method"] == p["method"] and r["plain_tok_s"]):
                out.append({"peer": p["system"], "pair": p["pair"], "workload": p["workload"], "method": p["method"],
                            "plain": r["plain_tok_s"] / p["plain_tok_s"], "spec": r["spec_tok_s"] / p["spec_tok_s"]})
    return out


def run(args: argparse.Namespace) -> int:
    from kvcache.cliargs import weights_list

    quick = args.quick
    new = args.new_tokens if args.new_tokens is not None else (QUICK_NEW if quick else DEFAULT_NEW)
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if new < 8 or repeats < 1:
        raise InvalidParams("--new-tokens must be at least 8 and --repeats at least 1")
    peers = [p for p in (args.peers if args.peers is not None else ",".join(PEERS)).split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise InvalidParams(f"unknown peer {p!r}; peers: {', '.join(PEERS)} ('' skips)")
    weights = weights_list(args, DEFAULT_WEIGHTS)

    import torch
    from tqdm import tqdm

    per_mode = sum(repeats * (2 + len(m)) for _, m in WORKLOADS.values())  # with a draft row where fp32
    bar = tqdm(total=per_mode * len(weights) + len(peers), desc="bench spec", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    prompts: dict[str, list[int]] | None = None
    fp32_texts: dict[str, list[int]] | None = None
    file_texts: dict[str, list[int]] | None = None
    file_label = "file"
    name, eos = "", []
    for mode in weights:
        got, prompts, texts, name, eos = bench_kvcache(args.model, mode, args.threads, prompts, new, repeats,
                                                       LOOKUP, bar.update)
        rows += got
        if got and got[0]["pair"] == "fp32":
            fp32_texts = texts
        elif got and mode == "file":
            file_texts, file_label = texts, str(got[0]["weights"]).removeprefix("kvcache ")
    threads = torch.get_num_threads()
    if "transformers" in peers and prompts is not None:
        from kvcache.models.loading import fp32_folder

        # --quick: transformers on the first workload only (its int8 copy and generate loop are the slow part)
        theirs = dict(list(prompts.items())[:1]) if quick else prompts
        hf = peer_rows(str(fp32_folder(args.model)), theirs, new, repeats, LOOKUP, threads, eos)
        compare_peer(hf, fp32_texts)
        rows += hf
        bar.update()
    if "llama-server" in peers and prompts is not None:
        rows += _llama_rows(args, prompts, new, repeats, threads, file_label, eos, file_texts)
        bar.update()
    bar.close()
    rat = ratios(rows)
    meta = run_meta(model=name, new_tokens=new, repeats=repeats, weights=weights, peers=peers, lookup=LOOKUP,
                    prompt_tokens={w: len(ids) for w, ids in (prompts or {}).items()},
                    compared="decode tok/s (tokens after the first over the time after the first), batch 1, "
                             "greedy; best of the runs without and with speculation, taking turns",
                    tokens_per_forward="(new tokens - 1) / forwards after the prompt's (those verifying "
                                       "proposals and those with none)",
                    acceptance="proposed tokens kept / tokens proposed",
                    forward_cost="ms per forward with speculation / ms per forward without")
    print_table(rows, rat, meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows, "ratios": rat}, indent=2))
    return 0


def _llama_rows(args: argparse.Namespace, prompts: dict[str, list[int]], new: int, repeats: int, threads: int,
                label: str, eos: list[int], texts: dict[str, list[int]] | None) -> list[dict[str, Any]]:
    """llama-server's rows on the model's GGUF file, its texts compared with kvcache's on the same file."""
    from kvcache.peers.llama_cpp import llama_server
    from kvcache.models.loading import resolve_model

    gguf = resolve_model(args.model).gguf
    binary, _ = llama_server(getattr(args, "llama_cpp_bin", None), gguf)
    got = llama_rows(binary, gguf, prompts, new, repeats, LOOKUP, threads, label,
                          f"n-gram lookup {LOOKUP}")
    for r in got:
        ids = r.get("token_ids")
        if isinstance(ids, list) and ids and ids[-1] in eos:
            ids.pop()  # kvcache's texts end before their EOS
    compare_peer(got, texts)
    return got


def _text_cell(r: dict[str, Any]) -> str:
    if r["identical"] is None:
        return "-"
    own = f"same {r['runs']}/{r['runs']}" if r["identical"] else f"{r['mismatches']}/{r['runs']} DIFFER"
    if r["system"] == "kvcache" or r.get("matches_kvcache") is None:
        return own
    ours = "kvcache fp32" if r["pair"] == "fp32" else "kvcache file"
    if r["matches_kvcache"]:
        return own + f", = {ours}"
    return own + f", {ours} differs from token {r['first_difference']}"


def print_table(rows: list[dict[str, Any]], rat: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"\nspec: {meta['model']}, batch 1, greedy, {meta['threads']} threads, at most {meta['new_tokens']} new "
          f"tokens (EOS ends a text); prompts: " + ", ".join(f"{w} {n} tokens" for w, n in
                                                             meta["prompt_tokens"].items()))
    print(f"decode tok/s without and with speculation, best of {meta['repeats']} run(s) each, taking turns; "
          "accept: proposed tokens kept / proposed; tok/fwd: (new tokens - 1) / forwards after the prompt's "
          "(1.00 without speculation); fwd cost: ms of a forward with speculation / without, so speed-up = "
          "tok/fwd / fwd cost; text: speculating runs with the same tokens as the run without")
    print(f"{'system':<13} {'weights':<12} {'workload':<10} {'speculation':<23} {'tokens':>6} {'plain tok/s':>11} "
          f"{'spec tok/s':>10} {'speed-up':>8} {'accept':>6} {'tok/fwd':>7} {'fwd cost':>8}  text")
    for r in rows:
        head = f"{r['system']:<13} {r['weights']:<12} {r['workload']:<10} {r['speculation']:<23} "
        if r["spec_tok_s"] is None:
            print(head + str(r["note"]))
            continue
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(head + f"{r['tokens']:>6} {cell(r['plain_tok_s']):>11} {cell(r['spec_tok_s']):>10} {speed:>8} "
              f"{cell(r['acceptance'], '.2f'):>6} {cell(r['tokens_per_forward'], '.2f'):>7} "
              f"{cell(r['forward_cost'], '.2f'):>8}  {_text_cell(r)}")
    for peer in dict.fromkeys(x["peer"] for x in rat):
        pair = next(x["pair"] for x in rat if x["peer"] == peer)
        print(f"\nkvcache {pair} / {peer} {pair}, decode tok/s in this run")
        for w in dict.fromkeys(x["workload"] for x in rat if x["peer"] == peer):
            mine = [x for x in rat if x["peer"] == peer and x["workload"] == w]
            spec = ", ".join(f"{'prompt lookup' if x['method'] == 'lookup' else 'a draft'} {x['spec']:.2f}x"
                             for x in mine)
            print(f"  {w:<10} without speculation {mine[0]['plain']:.2f}x, {spec}")
    for r in rows:
        if r["system"] != "kvcache" or not r["speedup"]:
            continue
        if (r["workload"], r["method"]) == ("free text", "lookup"):
            where = f"free text, {r['weights']}: speculation"
        elif r["method"] == "miss":
            where = f"{r['workload']}, {r['weights']}: a prediction that misses"
        else:
            continue
        cost = 1 - r["speedup_median"]
        verdict = f"costs {cost * 100:.1f}%" if cost > 0 else f"gains {-cost * 100:.1f}%"
        limit = "met" if cost <= FREE_COST_LIMIT else "MISSED"
        print(f"{where} {verdict} (median of {len(r['spec_tok_s_runs'])} rounds' ratios; {r['verifying_forwards']} "
              f"of {r['forwards']} forwards verified {r['proposed']} proposals, {r['accepted']} kept); where little "
              f"matches it should cost at most {FREE_COST_LIMIT * 100:.0f}%: {limit}")
    bad = [r for r in rows if r["system"] == "kvcache" and not r["identical"]]
    if bad:
        print(f"TEXT DIFFERS: {len(bad)} kvcache row(s) gave another text with speculation than without")


def headline(d: dict) -> list[Headline]:
    """``bench spec``: prompt lookup beside the peers' own (transformers on fp32 weights,
    llama-server on the file); a prediction on the file's weights beside the same run without."""
    meta, results = d.get("meta", {}), d["results"]
    rows = []
    for p in results:
        if p["system"] == "kvcache" or p["method"] != "lookup" or (p.get("spec_tok_s") is None and p.get("note")):
            continue  # kvcache's own, or a peer that was skipped (its note says why)
        k = one(results, system="kvcache", pair=p["pair"], workload=p["workload"], method="lookup")
        weights = "fp32 weights" if p["pair"] == "fp32" else model_name(meta, str(k["weights"]))
        rows.append(Headline(f"{p['workload']}: prompt-lookup decode tok/s, {weights}", positive(k["spec_tok_s"]),
                        p["system"], positive(p["spec_tok_s"]), "tok/s"))
    for k in results:
        if k["system"] == "kvcache" and k["pair"] == "file" and k["method"] == "prediction":
            rows.append(Headline(f"{k['workload']}: decode tok/s with the file as `prediction`, "
                            f"{model_name(meta, str(k['weights']))}", positive(k["spec_tok_s"]),
                            "kvcache without speculation", positive(k["plain_tok_s"]), "tok/s"))
    return rows

