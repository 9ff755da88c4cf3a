"""``kvcache bench structured``: JSON-schema constrained decoding against free decoding, the grammar
masks' cost per token, schema compile times, and the grammar engines side by side.

Speed. The same requests ("Describe ... as JSON", a different subject each) run constrained by one
schema (a nested object, an array, an enum, integer bounds, strings with maxLength) and free, at
batch N (every request at once, continuous batching, as ``LLM.generate_batch`` runs them) and at
batch 1 (a few of the requests, one at a time). A constrained output ends where its JSON ends; the
free run of the same prompt is held to exactly that many tokens (EOS ignored), so both runs
generate the same tokens per request in the same steps with the same batch shapes, and output
tokens / wall time compares like with like (the prompts prefill alike: no prefix cache). Free and
constrained runs alternate; the best of ``--repeats`` runs counts (the machine may be shared).
Every step is timed: the median step of each side, and the masks' time from the engine's
``MaskWorker`` (computed on its thread while the forward runs) per token and per step, say whether
the masks were hidden behind the forward. Every constrained output is parsed and validated
against the schema with ``jsonschema``.

Compile. A schema the cache cannot hold (a fresh property name) compiled cold, then the same again
(a cache hit and the matcher copy each request takes).

Engines. llguidance (the engine kvcache runs) and xgrammar side by side (peers/grammar_engines.py,
each in a child process): the model's tokenizer, the same schema and JSON options, the same token
sequence (a valid JSON text): tokenizer setup, schema compile, the first mask, and the mean and max
time of one token mask as later requests see it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.bench.rows import Headline, positive
from kvcache.bench.report import cell, run_meta
from kvcache.errors import InvalidParams, KVCacheError
from kvcache.peers.grammar_engines import ENGINES, engine_row

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "structured"
ORDER = 60
OPTIONS = ("new_tokens", "repeats", "requests", "peers")
QUICK = {"requests": 4, "repeats": 1}

DEFAULT_MAX_TOKENS = 320  # a cap no output of SCHEMA reaches: its strings are bounded
BATCH1_REQUESTS = 4  # requests run one at a time (at most --requests)
WALKS = 4  # engines: walks over the token sequence (the first cold, then fresh matchers)

SUBJECTS = (
    ("a famous novel", "book"), ("a city in Italy", "city"), ("a famous scientist", "person"),
    ("an animal of the Arctic", "animal"), ("a classic film", "film"), ("a dish from Japan", "dish"),
    ("a planet of the solar system", "planet"), ("a technology company", "company"), ("a popular song", "song"),
    ("a board game", "game"), ("a river in Africa", "river"), ("an invention of the 19th century", "invention"),
    ("a team sport", "sport"), ("a language spoken in Asia", "language"), ("a musical instrument", "instrument"),
    ("a famous building", "building"),
)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "kind": {"type": "string", "enum": [k for _, k in SUBJECTS]},
        "year": {"type": "integer", "minimum": -3000, "maximum": 2100},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "details": {
            "type": "object",
            "properties": {
                "summary": {"type": "string", "maxLength": 160},
                "origin": {"type": "string", "maxLength": 40},
                "popular": {"type": "boolean"},
            },
            "required": ["summary", "origin", "popular"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "year", "rating", "tags", "details"],
    "additionalProperties": False,
}
# the engines' token sequence: a valid text of SCHEMA as the constrained outputs are written
SAMPLE: dict[str, Any] = {
    "name": "Dune", "kind": "book", "year": 1965, "rating": 9,
    "tags": ["science fiction", "desert planet", "politics", "ecology"],
    "details": {"summary": "A noble family takes charge of a desert planet, the only source of a precious spice, "
                           "and is betrayed by its rivals.",
                "origin": "United States", "popular": True},
}


def prompts(count: int) -> list[str]:
    """``count`` requests for JSON, a different subject each (cycling through SUBJECTS)."""
    out = []
    for i in range(count):
        subject, _ = SUBJECTS[i % len(SUBJECTS)]
        again = f" (example {i // len(SUBJECTS) + 1})" if i >= len(SUBJECTS) else ""
        out.append(f"Describe {subject}{again} as JSON: its name, kind, year, a rating from 1 to 10, a few tags, "
                   "and details (a one-sentence summary, its origin, whether it is popular).")
    return out


def fresh_schema() -> dict[str, Any]:
    """SCHEMA with one more property of a random name: a schema no cache holds."""
    schema = json.loads(json.dumps(SCHEMA))
    name = f"note_{uuid.uuid4().hex[:12]}"
    schema["properties"][name] = {"type": "string", "maxLength": 20}
    schema["required"].append(name)
    return schema


def valid(text: str, schema: dict[str, Any] = SCHEMA) -> bool:
    """Whether ``text`` is JSON valid under ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# -- speed: free against constrained -------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    steps_s: list[float]
    outputs: list[Any]  # RequestOutput

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def drive(llm: Any, ids: list[list[int]], params: list[Any], single: bool = False) -> Run:
    """The requests served together by the engine's scheduler, as ``LLM.generate_batch`` serves them
    (``single``: one request whose prompt goes in one forward, as ``LLM.generate`` runs it), each
    step timed. The wall time runs from the requests' arrival to the last token."""
    from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig

    config = (SchedulerConfig(max_batch_tokens=len(ids[0]) + 1, max_running=1) if single
              else SchedulerConfig(max_running=len(ids)))
    sched = Scheduler(llm.runner, llm.tokenizer, config)
    reqs = [Request(str(i), list(p), sp) for i, (p, sp) in enumerate(zip(ids, params))]
    steps: list[float] = []
    t0 = time.perf_counter()
    for r in reqs:
        sched.add(r)
    try:
        while sched.has_work:
            t = time.perf_counter()
            sched.step()
            steps.append(time.perf_counter() - t)
    finally:
        for r in reqs:
            sched.abort(r.request_id)
    wall = time.perf_counter() - t0
    failed = [r for r in reqs if r.error]
    if failed:
        raise KVCacheError(f"bench structured: request {failed[0].request_id} failed: {failed[0].error}")
    return Run(wall, steps, [r.output() for r in reqs])


@dataclass
class Side:
    """One side (free or constrained) of a speed row: its timed runs, each a list of ``Run``s."""

    runs: list[list[Run]] = field(default_factory=list)

    def tok_s(self, runs: list[Run]) -> float:
        wall = sum(r.wall_s for r in runs)
        return sum(r.tokens for r in runs) / wall if wall else 0.0

    @property
    def best(self) -> list[Run]:
        return max(self.runs, key=self.tok_s)

    def step_ms(self, runs: list[Run]) -> float:
        return statistics.median(s for r in runs for s in r.steps_s) * 1000


def bench_speed(llm: Any, ids: list[list[int]], batch: int, max_tokens: int, repeats: int,
                constraint: Any, tick: Any = None) -> dict[str, object]:
    """Free against constrained on the requests ``ids``: all at once (batch = len(ids)) or one at a
    time (batch 1). The free run of each request makes as many tokens as its constrained output."""
    from kvcache.engine.params import SamplingParams

    single = batch == 1
    con = SamplingParams(max_tokens=max_tokens, constraint=constraint)

    def go(constrained: bool, lengths: list[int]) -> list[Run]:
        groups = [[i] for i in range(len(ids))] if single else [list(range(len(ids)))]
        out = []
        for g in groups:
            ps = [con if constrained else SamplingParams(max_tokens=lengths[i], ignore_eos=True) for i in g]
            out.append(drive(llm, [ids[i] for i in g], ps, single))
        return out

    def outputs(runs: list[Run]) -> list[Any]:
        return [o for r in runs for o in r.outputs]

    warm = outputs(go(True, []))  # warm-up; it fixes each request's length
    lengths = [len(o.token_ids) for o in warm]
    go(False, lengths)
    worker = llm.grammars.worker()
    free, constrained = Side(), Side()
    texts = [o.text for o in warm]
    mask_s, masks, mask_steps = 0.0, 0, 0
    for rep in range(repeats):
        for is_con in ((True, False) if rep % 2 == 0 else (False, True)):
            s0, m0 = worker.mask_s, worker.masks
            runs = go(is_con, lengths)
            if is_con:
                mask_s, masks = mask_s + worker.mask_s - s0, masks + worker.masks - m0
                mask_steps += sum(len(r.steps_s) for r in runs)
                texts += [o.text for o in outputs(runs)]
                constrained.runs.append(runs)
            else:
                free.runs.append(runs)
            if tick:
                tick()
    fb, cb = free.best, constrained.best
    f_tok, c_tok = free.tok_s(fb), constrained.tok_s(cb)
    f_step, c_step = free.step_ms(fb), constrained.step_ms(cb)
    per_step = mask_s / mask_steps * 1000 if mask_steps else None
    ok = sum(valid(t) for t in texts)
    return {
        "batch": batch, "requests": len(ids), "tokens": sum(lengths), "free_tokens": sum(r.tokens for r in fb),
        "constrained_tokens": sum(r.tokens for r in cb), "steps": sum(len(r.steps_s) for r in cb),
        "free_tok_s": f_tok, "constrained_tok_s": c_tok, "ratio": c_tok / f_tok if f_tok else None,
        "free_step_ms": f_step, "constrained_step_ms": c_step, "step_overhead_ms": c_step - f_step,
        "mask_us_per_token": mask_s / masks * 1e6 if masks else None, "mask_ms_per_step": per_step,
        "masks_per_token": masks / (repeats * sum(lengths)) if lengths else None,
        "mask_mode": "beside the forward" if worker.spare_core else "on refusal",
        "mask_share": per_step / c_step if per_step is not None and c_step else None,
        "valid": ok, "outputs": len(texts),
        "finish": sorted({o.finish_reason for o in warm}),
        "free_tok_s_runs": [free.tok_s(r) for r in free.runs],
        "constrained_tok_s_runs": [constrained.tok_s(r) for r in constrained.runs],
        "sample_output": texts[0] if texts else "",
    }


def bench_compile(llm: Any, repeats: int) -> dict[str, object]:
    """Cold: a schema never seen (fresh property name) through ``Grammars.compile``; cached: the
    same schema again (the cache hit and the matcher copy a request takes). Medians."""
    from kvcache.engine.grammar import Constraint

    grammars = llm.grammars
    grammars.tokenizer()  # the tokenizer is built once per model: not part of a schema's compile
    cold, cached, lookup = [], [], []
    for _ in range(max(3, repeats)):
        c = Constraint.json_schema(fresh_schema())
        t0 = time.perf_counter()
        grammars.compile(c)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hit = grammars.compile(c)
        t1 = time.perf_counter()
        hit.matcher()
        t2 = time.perf_counter()
        lookup.append(t1 - t0)
        cached.append(t2 - t0)
    return {"cold_s": statistics.median(cold), "cached_s": statistics.median(cached),
            "lookup_s": statistics.median(lookup), "schemas": len(cold)}


# -- the suite ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    count = args.requests if args.requests is not None else (4 if quick else 16)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    max_tokens = args.new_tokens if args.new_tokens is not None else DEFAULT_MAX_TOKENS
    engines = [p for p in (args.peers if args.peers is not None else ",".join(ENGINES)).split(",") if p]
    for e in engines:
        if e not in ENGINES:
            raise InvalidParams(f"unknown grammar engine {e!r}; engines: {', '.join(ENGINES)}")
    if count < 1 or repeats < 1 or max_tokens < 16:
        raise InvalidParams("--requests and --repeats must be at least 1, --new-tokens (the most tokens a "
                            "constrained output may have) at least 16")
    single = min(count, 2 if quick else BATCH1_REQUESTS)

    import torch
    from tqdm import tqdm

    from kvcache.engine.grammar import JSON_OPTIONS, Constraint
    from kvcache.engine.llm import LLM

    llm = LLM(args.model, threads=args.threads, prefix=False)
    threads = torch.get_num_threads()
    ids = [llm.encode(p, chat=True) for p in prompts(count)]
    constraint = Constraint.json_schema(SCHEMA)
    bar = tqdm(total=2 * repeats * (1 + (count > 1)) + 1 + len(engines), desc="bench structured", file=sys.stderr)
    speed = []
    if count > 1:
        speed.append(bench_speed(llm, ids, count, max_tokens, repeats, constraint, bar.update))
    speed.append(bench_speed(llm, ids[:single], 1, max_tokens, repeats, constraint, bar.update))
    comp = bench_compile(llm, repeats)
    bar.update()
    sample_ids = llm.tokenizer.encode(json.dumps(SAMPLE), add_special_tokens=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-structured-") as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        tok_file.write_text(llm.tokenizer.backend.to_str())
        for e in engines:
            rows.append(engine_row(e, str(tok_file), llm.config.vocab_size, list(llm.tokenizer.eos_token_ids),
                                   sample_ids, threads, json.dumps(SCHEMA), dict(JSON_OPTIONS), WALKS))
            bar.update()
    bar.close()
    _print(llm.model_name, speed, comp, rows, repeats, max_tokens, threads, len(sample_ids))
    if args.json:
        meta = run_meta(model=llm.model_name, requests=count, batch1_requests=single, repeats=repeats,
                        max_tokens=max_tokens, schema=SCHEMA, engine_text=json.dumps(SAMPLE),
                        compared="output tokens / wall time; the free run of each request makes as many tokens "
                                 "as its constrained output (EOS ignored); best of the alternating runs")
        Path(args.json).write_text(json.dumps({"meta": meta, "results": speed, "compile": comp, "engines": rows},
                                              indent=2))
    return 0


def _verdict(r: dict[str, Any], threads: int) -> str:
    """Whether a row's masks were hidden behind the forward: their time per step on the mask
    thread against the free step (the forward they run beside), and what the constrained step
    costs beyond the free one."""
    mask, free, extra = r["mask_ms_per_step"], r["free_step_ms"], r["step_overhead_ms"]
    if r.get("mask_mode") == "on refusal":
        share = r.get("masks_per_token") or 0.0
        return (f"batch {r['batch']}: no core to spare, so each choice is checked against its grammar and a mask "
                f"is computed only where the grammar refuses it: {share * 100:.1f}% of the tokens, "
                f"{(mask or 0.0):.2f} ms per step; constrained step - free step {extra:+.2f} ms "
                f"({extra / free * 100:+.0f}%)")
    if mask is None:
        return f"batch {r['batch']}: no masks computed"
    text = (f"batch {r['batch']}: masks {mask:.2f} ms per step on the mask thread "
            f"({r['mask_share'] * 100:.0f}% of a constrained step), ")
    if mask < free:
        text += f"less than the forward they run beside (free step {free:.2f} ms): hidden behind it; "
    else:
        text += f"more than the free step ({free:.2f} ms): the step waits for them, not hidden; "
    text += f"constrained step - free step {extra:+.2f} ms ({extra / free * 100:+.0f}%)"
    if extra > 0 and mask < free:
        text += (f" (applying the masks in sampling, advancing the matchers, the mask thread taking CPU from "
                 f"the forward's {threads} thread(s))")
    return text


def _print(model: str, speed: list[dict[str, Any]], comp: dict[str, Any], engines: list[dict[str, Any]],
           repeats: int, max_tokens: int, threads: int, sample_tokens: int) -> None:
    print(f"\nstructured: {model}, requests \"Describe <subject> as JSON\" (a different subject each), greedy, "
          f"{threads} threads; constrained by one JSON schema (nested object, array, enum, integer bounds, "
          f"maxLength), at most {max_tokens} tokens")
    print("compared: output tokens / wall time (prompts prefilled alike, no prefix cache); the free run of each "
          "request makes exactly as many tokens as its constrained output (EOS ignored), so both sides run the "
          f"same steps at the same batch sizes; best of {repeats} alternating run(s); step ms is the median step; "
          "mask us: the time to compute one mask; masks/tok: the share of tokens that needed one")
    print(f"{'batch':>5} {'reqs':>4} {'tokens':>6} {'free tok/s':>10} {'constr tok/s':>12} {'ratio':>6} "
          f"{'free step ms':>12} {'constr step ms':>14} {'mask us':>7} {'masks/tok':>9} {'mask ms/step':>12} "
          f"{'valid':>7}")
    for r in speed:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"{r['batch']:>5} {r['requests']:>4} {r['tokens']:>6} {cell(r['free_tok_s']):>10} "
              f"{cell(r['constrained_tok_s']):>12} {ratio:>6} {cell(r['free_step_ms'], '.2f'):>12} "
              f"{cell(r['constrained_step_ms'], '.2f'):>14} {cell(r['mask_us_per_token'], '.0f'):>7} "
              f"{cell(r.get('masks_per_token'), '.3f'):>9} "
              f"{cell(r['mask_ms_per_step'], '.2f'):>12} {str(r['valid']) + '/' + str(r['outputs']):>7}")
    for r in speed:
        print(_verdict(r, threads))
    print(f"schema compile (llguidance in the engine): cold {comp['cold_s'] * 1000:.2f} ms (a schema never seen), "
          f"cached {comp['cached_s'] * 1e6:.0f} us (cache hit {comp['lookup_s'] * 1e6:.0f} us + matcher copy); "
          f"median of {comp['schemas']} schemas")
    print(f"\ngrammar engines on this CPU, one child process each: the model's tokenizer, the same schema, the "
          f"same {sample_tokens}-token JSON text; first mask after compile, cold mean (first walk), mean and max "
          f"over {WALKS - 1} more walks from fresh matchers")
    print(f"{'engine':<11} {'version':<8} {'tokenizer s':>11} {'compile ms':>10} {'1st mask us':>11} "
          f"{'cold mean us':>12} {'mean mask us':>12} {'max mask us':>11} {'advance us':>10}  note")
    for e in engines:
        ms = None if e["compile_s"] is None else e["compile_s"] * 1000
        print(f"{e['engine']:<11} {e['version'] or '-':<8} {cell(e['tokenizer_s'], '.2f'):>11} {cell(ms, '.1f'):>10} "
              f"{cell(e['first_mask_us'], '.0f'):>11} {cell(e['cold_mean_us'], '.0f'):>12} "
              f"{cell(e['mask_mean_us'], '.0f'):>12} {cell(e['mask_max_us'], '.0f'):>11} "
              f"{cell(e['advance_us'], '.1f'):>10}  {e['note']}")


def headline(d: dict) -> list[Headline]:
    """``bench structured``: JSON-schema constrained decode beside the same requests unconstrained;
    the grammar engine kvcache uses (llguidance) beside xgrammar."""
    rows = []
    for r in d["results"]:
        rows.append(Headline(f"JSON-schema constrained decode tok/s, {r['requests']} requests, batch {r['batch']}",
                        positive(r["constrained_tok_s"]), "same requests unconstrained", positive(r["free_tok_s"]),
                        "tok/s"))
    engines = {e["engine"]: e for e in d.get("engines", [])}
    if all(engines.get(e, {}).get("mask_mean_us") is not None for e in ("llguidance", "xgrammar")):
        ll, xg = engines["llguidance"], engines["xgrammar"]
        rows.append(Headline("grammar engine: mean token mask, us", positive(ll["mask_mean_us"]), "xgrammar",
                        positive(xg["mask_mean_us"]), "us", higher_better=False))
        rows.append(Headline("grammar engine: schema compile, ms", positive(ll["compile_s"]) * 1e3, "xgrammar",
                        positive(xg["compile_s"]) * 1e3, "ms", higher_better=False))
    return rows

