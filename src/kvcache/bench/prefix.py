"""Prefix benchmark: time to first token with a long shared system prompt, in one run.

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

import copy
import inspect
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcache.engine.llm import LLM
from kvcache.engine.params import SamplingParams
from kvcache.engine.runner import ModelRunner
from kvcache.prefix.config import PrefixConfig

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
    llm.runner = ModelRunner(llm.model, llm.cache_config, prefix, llm.fingerprint)


def _ttft(llm: LLM, system: str, question: str, case: Case) -> None:
    r = llm.generate([messages(system, question)], ONE)[0]
    case.ttft_s.append(r.prefill_s)
    case.reused.append(r.cached_tokens)


def bench_kvcache(llm: LLM, system: str, repeats: int, redis_url: str | None,
                  progress: Callable[[], None] | None = None) -> list[Case]:
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
    case = Case("transformers prefill + deepcopy")
    try:
        from transformers import AutoModelForCausalLM, DynamicCache
    except ImportError:
        case.note = "transformers not installed: skipped"
        return case
    from kvcache.prefix.radix import common_prefix

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # generate() asks for the last position's logits only; a forward does too when it can
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(repeats)]
    prompts = [llm.encode(messages(system, q)) for q in qs + [QUESTIONS[-1]]]
    n = min(common_prefix(prompts[0], prompts[1]), min(len(p) for p in prompts) - 1)
    with torch.inference_mode():
        prompt_cache = DynamicCache(config=model.config)
        model(torch.tensor([prompts[0][:n]]), past_key_values=prompt_cache, use_cache=True)
        for ids in prompts[:repeats]:
            t0 = time.perf_counter()
            cache = copy.deepcopy(prompt_cache)
            out = model(torch.tensor([ids[n:]]), past_key_values=cache, use_cache=True, **keep)
            int(out.logits[0, -1].argmax())
            case.ttft_s.append(time.perf_counter() - t0)
            case.reused.append(n)
            if progress:
                progress()
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
