"""Cache against no cache over a long generation: the cost of each new token as the sequence grows.

Greedy decoding of ``new`` tokens after the same short prompt, step by step, timing every step:
kvcache with its dynamic cache and with ``none`` (every step recomputes the whole sequence), and
transformers with its DynamicCache and with ``use_cache=False``. Without a cache the cost per token
grows with the sequence, so those runs stop once they have used ``budget_s`` seconds; the table
shows how far they got (measured, never extrapolated).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcache.cache.config import parse_kv_spec
from kvcache.engine.llm import LLM
from kvcache.engine.runner import ModelRunner


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
    from transformers import DynamicCache

    run = Run("transformers", "DynamicCache" if use_cache else "use_cache=False")
    seq = list(ids)
    cache = DynamicCache(config=model.config) if use_cache else None
    with torch.inference_mode():
        out = model(torch.tensor([seq]), past_key_values=cache, use_cache=use_cache)
        first = int(out.logits[0, -1].argmax())

        def step(tok: int) -> int:
            seq.append(tok)
            inp = torch.tensor([[tok]]) if use_cache else torch.tensor([seq])
            o = model(inp, past_key_values=cache, use_cache=use_cache)
            return int(o.logits[0, -1].argmax())

        _loop(step, first, new, budget_s, run, tick)
    return run
