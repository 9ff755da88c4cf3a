"""``kvcache bench prefix``: time to first token with a long shared system prompt, in one run.

Cases, all on the same model, fp32 weights, prompt and thread count:

- cold: no prefix cache, the whole prompt is prefilled;
- warm: the system prompt's pages are in the RAM radix index (an earlier request left them);
- disk / redis: the RAM index is cleared before each request, the pages come back from a tier;
- transformers: the pattern its docs show for prefix reuse, prefill the system prompt once into a
  DynamicCache, then ``copy.deepcopy`` it for every request and run the question over the copy
  (asking for the last position's logits only, as ``generate`` does).

A multi-turn chat workload (several sessions sharing the system prompt, several turns each) reports
hit rate and TTFT with the prefix cache against sessions that only reuse their own K/V.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.rows import Headline, one, positive
from kvcache.peers.redis_server import local_redis
from kvcache.bench.report import cell, run_meta
from kvcache.cliargs import one_weights
from kvcache.engine.params import SamplingParams
from kvcache.errors import InvalidParams

if TYPE_CHECKING:
    from kvcache.engine.llm import LLM
    from kvcache.prefix.config import PrefixConfig

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "prefix"
ORDER = 80
OPTIONS = ("repeats", "system_tokens", "redis", "new_tokens", "weights")
QUICK = {"system_tokens": 128, "repeats": 1, "new_tokens": 4}

QUESTIONS = [
    "Summarize the text above in one sentence.",
    "Which programming language is the text about?",
    "List three keywords that appear in the text.",
    "Is the text written for beginners or experts?",
    "What would be a good title for the text?",
    "Name one statement the text uses.",
    "Explain the first topic in simple words.",
    "How many topics does the text cover, roughly?",
]
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


@dataclass
class Case:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, object]:
        med = statistics.median(self.ttft_s) if self.ttft_s else None
        return {"case": self.name, "ttft_ms": None if med is None else med * 1000,
                "ttft_ms_min": min(self.ttft_s, default=0) * 1000 or None,
                "ttft_ms_max": max(self.ttft_s, default=0) * 1000 or None,
                "reused_tokens": statistics.median(self.reused) if self.reused else None, "note": self.note}


def system_text(llm: LLM, tokens: int) -> str:
    """About ``tokens`` tokens of real English text (the standard library's pydoc topics)."""
    from kvcache.eval.fidelity import builtin_text

    ids = llm.tokenizer.encode(builtin_text())[:tokens]
    return llm.tokenizer.decode(ids)


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _use(llm: LLM, prefix: PrefixConfig | None) -> None:
    from kvcache.engine.runner import ModelRunner

    llm.runner = ModelRunner(llm.model, llm.cache_config, prefix, llm.fingerprint)


def _ttft(llm: LLM, system: str, question: str, case: Case) -> None:
    r = llm.generate([messages(system, question)], ONE)[0]
    case.ttft_s.append(r.prefill_s)
    case.reused.append(r.cached_tokens)


def bench_kvcache(llm: LLM, system: str, repeats: int, redis_url: str | None,
                  progress: Callable[[], None] | None = None) -> list[Case]:
    from kvcache.prefix.config import PrefixConfig

    tick = progress or (lambda: None)
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(repeats + 1)]
    cold = Case("kvcache cold (prefill all)")
    _use(llm, None)
    _ttft(llm, "Hi.", "Hi.", Case("warm-up"))
    for q in qs[:repeats]:
        _ttft(llm, system, q, cold)
        tick()
    warm = Case("kvcache warm (RAM radix)")
    _use(llm, PrefixConfig())
    _ttft(llm, system, qs[-1], Case("prime"))
    for q in qs[:repeats]:
        _ttft(llm, system, q, warm)
        tick()
    cases = [cold, warm]
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-prefix-") as d:
        for name, cfg in (("kvcache restored from disk", PrefixConfig(disk=d)),
                          ("kvcache restored from Redis", PrefixConfig(redis=redis_url) if redis_url else None)):
            case = Case(name)
            cases.append(case)
            if cfg is None:
                case.note = "no redis-server installed: skipped"
                continue
            _use(llm, cfg)
            _ttft(llm, system, qs[-1], Case("prime"))
            llm.flush()
            for q in qs[:repeats]:
                llm.clear_prefix_cache()  # RAM forgets: the pages must come from the tier
                _ttft(llm, system, q, case)
                tick()
            stats = llm.prefix_stats()
            if stats is not None and stats.tier_tokens == 0:
                case.note = "no page came back from the tier"
            assert llm.runner.prefix is not None
            llm.runner.prefix.close()
    _use(llm, None)
    return cases


def bench_transformers(model_dir: str, llm: LLM, system: str, repeats: int,
                       progress: Callable[[], None] | None = None) -> Case:
    """Prefill + deepcopy: the documented way to reuse a prompt's cache in transformers."""
    from kvcache.peers.hf_transformers import deepcopy_ttft
    from kvcache.prefix.radix import common_prefix

    case = Case("transformers prefill + deepcopy")
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(repeats)]
    prompts = [llm.encode(messages(system, q)) for q in qs + [QUESTIONS[-1]]]
    n = min(common_prefix(prompts[0], prompts[1]), min(len(p) for p in prompts) - 1)
    ttft, case.note = deepcopy_ttft(model_dir, prompts[:repeats], n, progress)
    case.ttft_s, case.reused = ttft, [n] * len(ttft)
    return case


@dataclass
class ChatResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_tokens: int = 0

    def summary(self) -> dict[str, object]:
        ts = sorted(self.ttft_s)
        return {"case": self.name, "turns": len(ts), "hit_rate": self.reused_tokens / max(1, self.prompt_tokens),
                "ttft_ms_p50": statistics.median(ts) * 1000 if ts else None,
                "ttft_ms_max": ts[-1] * 1000 if ts else None,
                "ttft_s_total": sum(ts)}


def bench_chat(llm: LLM, system: str, sessions: int, turns: int, new_tokens: int,
               progress: Callable[[], None] | None = None) -> list[ChatResult]:
    """``sessions`` chats with the same system prompt, turns interleaved round-robin."""
    from kvcache.prefix.config import PrefixConfig

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    out = []
    for name, prefix in (("kvcache prefix cache (shared radix)", PrefixConfig()),
                         ("kvcache per-session cache only", None)):
        _use(llm, prefix)
        res = ChatResult(name)
        chats = [llm.chat_session(system=system) for _ in range(sessions)]
        for t in range(turns):
            for i, chat in enumerate(chats):
                r = chat.send(QUESTIONS[(i + t) % len(QUESTIONS)], params)
                res.ttft_s.append(r.prefill_s)
                res.prompt_tokens += len(r.prompt_token_ids)
                res.reused_tokens += r.cached_tokens
                if progress:
                    progress()
        for chat in chats:
            chat.close()
        out.append(res)
    _use(llm, None)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.engine.llm import LLM

    quick = args.quick
    weights = one_weights(args)
    system_tokens = args.system_tokens if args.system_tokens is not None else (256 if quick else 2000)
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    new = args.new_tokens if args.new_tokens is not None else (8 if quick else 24)
    sessions, turns = (2, 2) if quick else (4, 3)
    if system_tokens < 16:
        raise InvalidParams(f"--system-tokens must be at least 16, got {system_tokens}")
    if repeats < 1 or new < 1:
        raise InvalidParams("--repeats and --new-tokens must be at least 1")

    from tqdm import tqdm

    from kvcache.models.loading import fp32_folder

    llm = LLM(args.model, threads=args.threads, prefix=False, weights=weights)
    system = system_text(llm, system_tokens)
    bar = tqdm(total=5 * repeats + sessions * turns * 2, desc="bench prefix", file=sys.stderr)
    with (nullcontext(args.redis) if args.redis else local_redis()) as url:
        cases = bench_kvcache(llm, system, repeats, url, bar.update)
    cases.append(bench_transformers(str(fp32_folder(args.model)), llm, system, repeats, bar.update))
    chat = bench_chat(llm, system, sessions, turns, new, bar.update)
    bar.close()
    rows = [c.summary() for c in cases]
    by = {r["case"]: r["ttft_ms"] for r in rows}
    cold = rows[0]["ttft_ms"]
    print(f"\nprefix: {llm.model_name}, shared system prompt of {system_tokens} tokens of English text + a short "
          f"question, batch 1, {llm.weights} weights, {torch.get_num_threads()} threads; time to first token, "
          f"median of {repeats}")
    print(f"{'case':<34} {'TTFT ms':>9} {'min-max':>15} {'reused tok':>10} {'cold/this':>9}")
    for r in rows:
        if r["ttft_ms"] is None:
            print(f"{r['case']:<34} {r['note']}")
            continue
        rng = f"{r['ttft_ms_min']:.0f}-{r['ttft_ms_max']:.0f}"
        print(f"{r['case']:<34} {r['ttft_ms']:>9.1f} {rng:>15} {cell(r['reused_tokens'], '.0f'):>10} "
              f"{cold / r['ttft_ms']:>8.1f}x" + (f"  ({r['note']})" if r["note"] else ""))
    warm, hf = by.get("kvcache warm (RAM radix)"), by.get("transformers prefill + deepcopy")
    goals = []
    if warm and cold:
        goals.append(f"warm vs cold {cold / warm:.1f}x lower (goal 20x)")
    if warm and hf:
        goals.append(f"warm vs transformers deepcopy {hf / warm:.1f}x lower (goal 2x)")
    for tier in ("disk", "Redis"):
        t = by.get(f"kvcache restored from {tier}")
        if t and cold:
            goals.append(f"{tier} restore vs recompute {cold / t:.1f}x faster (goal 5x)")
    print("; ".join(goals))
    results_chat = [c.summary() for c in chat]
    print(f"\nchat: {sessions} sessions x {turns} turns, same system prompt, {new} new tokens per turn, "
          "turns interleaved round-robin")
    print(f"{'case':<38} {'hit rate':>8} {'TTFT p50 ms':>11} {'TTFT max ms':>11} {'sum TTFT s':>10}")
    for c in results_chat:
        print(f"{c['case']:<38} {c['hit_rate']:>8.1%} {cell(c['ttft_ms_p50'], '.0f'):>11} "
              f"{cell(c['ttft_ms_max'], '.0f'):>11} {c['ttft_s_total']:>10.2f}")
    if args.json:
        meta = run_meta(model=llm.model_name, weights=llm.weights, system_tokens=system_tokens, repeats=repeats,
                        sessions=sessions, turns=turns, new_tokens=new)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows, "chat": results_chat}, indent=2))
    return 0


def headline(d: dict) -> list[Headline]:
    """``bench prefix``: TTFT with a shared system prompt already cached (RAM, disk, Redis) beside
    prefilling it, and beside transformers' prefill + deepcopy."""
    meta, results = d["meta"], d["results"]
    cold = one(results, case="kvcache cold (prefill all)")
    n = meta.get("system_tokens", "?")
    rows = []
    for r in results:
        case = r["case"]
        if case.startswith("kvcache") and "cold" not in case:
            where = case.removeprefix("kvcache ").strip()
            rows.append(Headline(f"TTFT ms, {n}-token shared system prompt, {where}", positive(r["ttft_ms"]),
                            "kvcache prefilling it", positive(cold["ttft_ms"]), "ms", higher_better=False))
    warm = next(r for r in results if r["case"].startswith("kvcache warm"))
    for r in results:
        if r["case"].startswith("transformers"):
            rows.append(Headline(f"TTFT ms, {n}-token shared system prompt, warm", positive(warm["ttft_ms"]), r["case"],
                            positive(r["ttft_ms"]), "ms", higher_better=False))
    return rows


def plot(plt, data: dict):
    from kvcache.bench.plots import bars

    rows = [r for r in data["results"] if r.get("ttft_ms")]
    if not rows:
        return None
    return bars(plt, [r["case"] for r in rows], [r["ttft_ms"] for r in rows],
                 f"time to first token, {data['meta'].get('system_tokens')}-token shared prompt (log scale)",
                 "TTFT (ms)", log=True)
