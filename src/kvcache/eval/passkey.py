"""Passkey retrieval: a number hidden at several depths of a long filler; can the model, reading
through a given cache, say it back at the end?"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvcache.cache.config import parse_kv_spec
from kvcache.engine.generate import RequestRun
from kvcache.engine.params import SamplingParams
from kvcache.engine.runner import ModelRunner

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> list[int]:
    """At most about ``n_tokens`` tokens (within one filler sentence group): filler with the key
    sentence at ``depth`` (0 start .. 1 end), ending with the question."""
    unit = tokenizer.encode(FILLER)
    needle = tokenizer.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode(QUESTION)
    reps = max(1, (n_tokens - len(needle) - len(question)) // max(1, len(unit)))
    cut = int(round(reps * depth))
    return unit * cut + needle + unit * (reps - cut) + question  # pieces joined as token ids


@dataclass(frozen=True)
class Passkey:
    spec: str
    tokens: int
    depths: tuple[float, ...]
    found: tuple[bool, ...]

    @property
    def accuracy(self) -> float:
        return sum(self.found) / len(self.found)


def passkey(llm, spec: str, n_tokens: int, depths: tuple[float, ...], seed: int = 0) -> Passkey:  # llm: LLM
    rng = random.Random(seed)
    runner = ModelRunner(llm.model, parse_kv_spec(spec))
    found = []
    length = 0
    for d in depths:
        key = rng.randint(10000, 99999)
        ids = passkey_prompt(llm.tokenizer, n_tokens, d, key)
        length = len(ids)
        run = RequestRun(runner, llm.tokenizer, ids, SamplingParams(max_tokens=8))
        for _ in run:
            pass
        found.append(str(key) in run.result.text)
    return Passkey(runner.cache_config.spec(), length, depths, tuple(found))


def greedy_agreement(llm, spec: str, prompt: list[int], n: int) -> float:  # llm: LLM
    """Share of ``n`` greedily generated tokens (EOS ignored) that equal the full cache's, position
    by position."""
    outs = []
    for s in ("dynamic", spec):
        run = RequestRun(ModelRunner(llm.model, parse_kv_spec(s)), llm.tokenizer, prompt,
                         SamplingParams(max_tokens=n, ignore_eos=True))
        for _ in run:
            pass
        outs.append(run.result.token_ids)
    return sum(a == b for a, b in zip(*outs)) / n
