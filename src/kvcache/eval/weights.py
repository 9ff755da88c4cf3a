"""Fidelity of quantized weights: perplexity by llama.cpp's rule, and KL / top-1 agreement against
the same model with fp32 weights.

llama.cpp's ``llama-perplexity`` cuts the tokenized text into chunks of ``ctx`` tokens, evaluates
each chunk from an empty cache (its first token replaced by BOS when the model adds one) and
scores only the second half of every chunk, where each prediction has at least ctx / 2 tokens of
context. ``chunked_logprobs`` follows that rule exactly, so its perplexity and llama.cpp's on the
same file and text can be compared number for number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvcache.errors import InvalidParams


def chunks(ids: list[int], ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    """The chunks llama-perplexity evaluates: whole ``ctx``-token slices, BOS first when given."""
    if ctx < 4:
        raise InvalidParams(f"the perplexity context must be at least 4 tokens, got {ctx}")
    n = len(ids) // ctx if n_chunks is None else min(n_chunks, len(ids) // ctx)
    if n < 1:
        raise InvalidParams(f"the text gives {len(ids)} tokens: fewer than one chunk of {ctx}")
    out = []
    for i in range(n):
        c = list(ids[i * ctx : (i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def chunked_logprobs(llm, parts: list[list[int]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk: (log-probabilities [ctx/2 - 1, V] of the scored positions, their targets)."""
    runner = llm.runner
    for c in parts:
        first = len(c) // 2
        seq = runner.new_sequence()
        try:
            logits = runner.score(seq, c)  # [ctx, V]
        finally:
            runner.free(seq)
        yield torch.log_softmax(logits[first : len(c) - 1].float(), -1), torch.tensor(c[first + 1 :])


@dataclass(frozen=True)
class WeightsFidelity:
    weights: str
    tokens: int  # positions scored
    ppl: float
    ppl_ref: float  # the same model with fp32 weights
    kl: float  # mean KL(fp32 || this), nats
    agreement: float  # share of positions whose most likely token equals fp32's
    weight_bytes: int
    weight_kinds: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def compare_weights(llm, reference, parts: list[list[int]],
                    progress: Callable[[int], None] | None = None) -> WeightsFidelity:
    """``llm`` against ``reference`` (the same model with fp32 weights) over llama.cpp's chunks."""
    nll = nll_ref = kl = 0.0
    agree = n = 0
    for (lp, target), (lr, _) in zip(chunked_logprobs(llm, parts), chunked_logprobs(reference, parts)):
        rows = torch.arange(lp.shape[0])
        nll -= float(lp[rows, target].sum())
        nll_ref -= float(lr[rows, target].sum())
        kl += float((lr.exp() * (lr - lp)).sum())
        agree += int((lr.argmax(-1) == lp.argmax(-1)).sum())
        n += lp.shape[0]
        if progress:
            progress(1)
    return WeightsFidelity(llm.weights, n, math.exp(nll / n), math.exp(nll_ref / n), kl / n, agree / n,
                           llm.model.weight_bytes(), llm.model.weight_kinds())


def perplexity(llm, parts: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of each part's scored tokens (llama.cpp's rule: the
    second half of each chunk), the figure ``llama-perplexity`` prints for the same file and text."""
    nll, n = 0.0, 0
    for lp, target in chunked_logprobs(llm, parts):
        nll -= float(lp[torch.arange(lp.shape[0]), target].sum())
        n += lp.shape[0]
    return math.exp(nll / n)
