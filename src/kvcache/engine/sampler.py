"""Token selection: greedy, temperature, top-k, top-p, min-p, with per-sample seeded generators.

Inputs are bounded here rather than trusted: a seed is reduced modulo 2^64 (sample i of a request
uses seed + i, which may pass the top), and a temperature below ``GREEDY_BELOW`` picks greedily
(dividing logits by 1e-40 overflows float32 and turns the probabilities into NaN).
"""

from __future__ import annotations

import torch

from kvcache.engine.params import SamplingParams, TokenLogprob

SEED_SPACE = 2**64  # torch generators take seeds in [0, 2^64)
GREEDY_BELOW = 1e-6  # temperatures below this are greedy: sampling there differs from argmax only in ties


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """A generator for sample ``index`` of a request: seeded when params.seed is set."""
    if is_greedy(params):
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed((params.seed + index) % SEED_SPACE)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from logits [V] (float32)."""
    if is_greedy(params):
        return int(torch.argmax(logits))
    return int(torch.multinomial(distribution(logits, params), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities [V] a sampled token is drawn from: logits [V] divided by the temperature,
    then top-k, top-p and min-p, in transformers' order (its logits warpers give the same)."""
    scores = logits.float() / max(params.temperature, GREEDY_BELOW)
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, -1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, -1)
    if params.min_p > 0.0:  # keep p >= min_p * max p
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities under the model: log-softmax of the raw logits [..., V] (float32)."""
    return torch.log_softmax(logits.float(), -1)


def token_logprob(lp: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s entry in log-probabilities ``lp`` [V], with the ``k`` most likely tokens."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(int(token), float(lp[token]), top)
