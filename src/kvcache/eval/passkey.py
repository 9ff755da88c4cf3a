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


def passkey_cases(tokenizer, n_tokens: int, depths: tuple[float, ...], seed: int = 0) -> list[tuple[list[int], list[int], int]]:
    """(context, question, key) per depth: the prompts of ``passkey`` cut before the question, with
    the same keys."""
    rng = random.Random(seed)
    question = tokenizer.encode(QUESTION)
    out = []
    for d in depths:
        key = rng.randint(10000, 99999)
        ids = passkey_prompt(tokenizer, n_tokens, d, key)
        out.append((ids[: len(ids) - len(question)], ids[len(ids) - len(question):], key))
    return out


def answer_after(runner: ModelRunner, context: list[int], question: list[int], n: int,
                 eos: tuple[int, ...]) -> list[int]:
    """Greedy answer ids when the question comes after a context already prefilled (and pressed):
    the question in one forward, then token by token, stopping at an end-of-sequence token."""
    seq = runner.new_sequence()
    try:
        runner.step([seq], [context])
        # the question is read through the pressed context, not pressed itself (as kvpress does)
        out = [int(runner.step([seq], [question], prompt_end=False)[0].argmax())]
        while len(out) < n and out[-1] not in eos:
            out.append(int(runner.step([seq], [[out[-1]]])[0].argmax()))
    finally:
        runner.free(seq)
    return out


def passkey_after(llm, spec: str, n_tokens: int, depths: tuple[float, ...], seed: int = 0,
                  answer_tokens: int = 8) -> Passkey:  # llm: LLM
    """Passkey retrieval with the question asked after the context was prefilled on its own (a
    press compresses the context without seeing the question, as kvpress's pipeline does)."""
    runner = ModelRunner(llm.model, parse_kv_spec(spec))
    found, length = [], 0
    for context, question, key in passkey_cases(llm.tokenizer, n_tokens, depths, seed):
        ids = answer_after(runner, context, question, answer_tokens, llm.tokenizer.eos_token_ids)
        found.append(str(key) in llm.tokenizer.decode(ids))
        length = len(context) + len(question)
    return Passkey(runner.cache_config.spec(), length, depths, tuple(found))


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
