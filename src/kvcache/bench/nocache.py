"""``kvcache bench cache-vs-none``: cache against no cache over a long generation: the cost of each new token as the sequence grows.

Greedy decoding of ``new`` tokens after the same short prompt, step by step, timing every step:
kvcache with its dynamic cache and with ``none`` (every step recomputes the whole sequence), and
transformers with its DynamicCache and with ``use_cache=False``. Without a cache the cost per token
grows with the sequence, so those runs stop once they have used ``budget_s`` seconds; the table
shows how far they got (measured, never extrapolated).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.report import cell, run_meta
from kvcache.bench.rows import Headline, one, positive
from kvcache.cliargs import one_weights
from kvcache.errors import InvalidParams

if TYPE_CHECKING:
    from kvcache.engine.llm import LLM

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "cache-vs-none"
ORDER = 90
OPTIONS = ("new_tokens", "time_budget", "peers", "weights")
QUICK = {"new_tokens": 24, "time_budget": 1.5, "peers": "dynamic,none"}

PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class Run:
    system: str
    cache: str
    step_s: list[float] = field(default_factory=list)  # seconds of step i (token i + 1)
    stopped: str = ""

    def buckets(self, size: int, total: int) -> list[float | None]:
        """Mean milliseconds per token in each ``size``-token bucket (None past where it stopped)."""
        out: list[float | None] = []
        for a in range(0, total, size):
            chunk = self.step_s[a : a + size]
            out.append(sum(chunk) / len(chunk) * 1000 if len(chunk) == min(size, total - a) else None)
        return out

    def summary(self, size: int, total: int) -> dict[str, object]:
        return {"system": self.system, "cache": self.cache, "tokens": len(self.step_s),
                "total_s": sum(self.step_s), "ms_per_token": self.buckets(size, total), "stopped": self.stopped}


def _loop(step: Callable[[int], int], first: int, new: int, budget_s: float, run: Run,
          tick: Callable[[], None]) -> None:
    tok, spent = first, 0.0
    for i in range(new - 1):
        t0 = time.perf_counter()
        tok = step(tok)
        dt = time.perf_counter() - t0
        run.step_s.append(dt)
        spent += dt
        tick()
        if spent > budget_s and i < new - 2:
            run.stopped = f"stopped after {len(run.step_s)} tokens: {budget_s:.0f} s budget spent"
            return


def bench_kvcache(llm: LLM, ids: list[int], spec: str, new: int, budget_s: float, tick: Callable[[], None]) -> Run:
    from kvcache.cache.config import parse_kv_spec
    from kvcache.engine.runner import ModelRunner

    runner = ModelRunner(llm.model, parse_kv_spec(spec))
    run = Run("kvcache", spec)
    seq = runner.new_sequence()
    first = int(runner.step([seq], [ids])[0].argmax())

    def step(tok: int) -> int:
        return int(runner.step([seq], [[tok]])[0].argmax())

    _loop(step, first, new, budget_s, run, tick)
    runner.free(seq)
    return run


def bench_transformers(model, ids: list[int], use_cache: bool, new: int, budget_s: float,
                       tick: Callable[[], None]) -> Run:
    from kvcache.peers.hf_transformers import greedy_stepper

    run = Run("transformers", "DynamicCache" if use_cache else "use_cache=False")
    first, step = greedy_stepper(model, ids, use_cache)
    _loop(step, first, new, budget_s, run, tick)
    return run


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.engine.llm import LLM

    quick = args.quick
    weights = one_weights(args)
    new = args.new_tokens if args.new_tokens is not None else (64 if quick else 1000)
    budget = args.time_budget if args.time_budget is not None else (10.0 if quick else 120.0)
    size = 16 if quick else 100
    if new < 2:
        raise InvalidParams(f"--new-tokens must be >= 2, got {new}")
    if budget <= 0:
        raise InvalidParams(f"--time-budget must be positive, got {budget}")
    peers = [p for p in (args.peers if args.peers is not None else "dynamic,none").split(",") if p]
    for p in peers:
        if p not in ("dynamic", "none"):
            raise InvalidParams(f"unknown transformers cache {p!r} for cache-vs-none; choose from dynamic, none")

    from tqdm import tqdm

    from kvcache.models.loading import fp32_folder

    llm = LLM(args.model, threads=args.threads, prefix=False, weights=weights)
    ids = llm.encode(PROMPT, chat=True)
    bar = tqdm(total=(2 + len(peers)) * (new - 1), desc="bench cache-vs-none", unit="tok", file=sys.stderr)
    # the time budget bounds the runs without a cache; those with one always finish
    runs = [bench_kvcache(llm, ids, spec, new, budget if spec == "none" else float("inf"), bar.update)
            for spec in ("dynamic", "none")]
    if peers:
        from kvcache.peers.hf_transformers import transformers_model

        model = transformers_model(fp32_folder(args.model))
        runs += [bench_transformers(model, ids, p == "dynamic", new, budget if p != "dynamic" else float("inf"),
                                    bar.update) for p in peers]
    bar.close()
    results = [r.summary(size, new - 1) for r in runs]
    print(f"\ncache-vs-none: {llm.model_name}, greedy, {new} new tokens after a {len(ids)}-token prompt, "
          f"{llm.weights} weights, {torch.get_num_threads()} threads; mean ms per new token in each {size}-token "
          f"stretch (runs without a cache stop after {budget:.0f} s)")
    names = [f"{r['system']} {r['cache']}" for r in results]
    print(f"{'tokens':<11} " + " ".join(f"{n:>26}" for n in names))
    for b in range(len(results[0]["ms_per_token"])):  # type: ignore[arg-type]
        a = b * size
        label = f"{a}-{min(a + size, new - 1)}"
        print(f"{label:<11} " + " ".join(f"{cell(r['ms_per_token'][b]):>26}" for r in results))  # type: ignore[index]
    print(f"{'total s':<11} " + " ".join(f"{r['total_s']:>26.1f}" for r in results))
    print(f"{'tokens made':<11} " + " ".join(f"{r['tokens']:>26}" for r in results))
    base = {r["cache"]: r for r in results if r["system"] == "kvcache"}
    reached = [x for x in base["none"]["ms_per_token"] if x is not None]  # type: ignore[union-attr]
    if reached:
        ratio = reached[-1] / base["dynamic"]["ms_per_token"][len(reached) - 1]  # type: ignore[index]
        print(f"in the last stretch kvcache none completed, a token cost {ratio:.1f}x what it costs with the cache")
    for r in results:
        if r["stopped"]:
            print(f"{r['system']} {r['cache']}: {r['stopped']}")
    if args.json:
        meta = run_meta(model=llm.model_name, weights=llm.weights, new_tokens=new, prompt_tokens=len(ids),
                        bucket=size, time_budget_s=budget)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def headline(d: dict) -> list[Headline]:
    """``bench cache-vs-none``: ms per token with kvcache's cache beside transformers' DynamicCache."""
    results = d["results"]
    k = one(results, system="kvcache", cache="dynamic")
    p = one(results, system="transformers", cache="DynamicCache")
    return [Headline(f"ms per token over {k['tokens']} new tokens, with a cache",
                positive(k["total_s"]) * 1e3 / positive(k["tokens"]), "transformers DynamicCache",
                positive(p["total_s"]) * 1e3 / positive(p["tokens"]), "ms", higher_better=False)]


def plot(plt, data: dict):
    from kvcache.bench.plots import finish

    size = data["meta"]["bucket"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in data["results"]:
        ys = [y for y in r["ms_per_token"] if y is not None]
        ax.plot([size * (i + 0.5) for i in range(len(ys))], ys, marker="o", label=f"{r['system']} {r['cache']}")
    ax.set_yscale("log")
    finish(ax, "new token index", "ms per new token (log)",
           "cost per token as the sequence grows, with and without a KV cache")
    return fig
