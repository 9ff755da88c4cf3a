"""Fidelity after a compressed prompt: prefill a context through a cache strategy, then score a
continuation through what the cache kept.

This is how a cache is used when serving (the prompt is prefilled and compressed once, the answer
reads through what is left), and how kvpress measures its presses: the same protocol runs in its
child process (peers/kvpress_child.py), so the two give comparable figures on the same token ids.

- the context goes in through ``ModelRunner.step`` (one prefill; a press scores it at the end);
- the continuation's first token goes in as a decode step, the rest as one more forward, at
  positions counted from the context's length; every position's next-token distribution is
  compared with the full fp32 cache's (a prefill-time press gives the same logits as kvpress's
  single forward; a decode-time press may evict once more at that step);
- bytes per token are what the cache holds after that first step, over the tokens it has seen
  (slots, scales and the positions a press keeps per slot included): the compressed prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.engine.runner import ModelRunner
from kvcache.errors import InvalidParams


@dataclass(frozen=True)
class Reference:
    """The full cache's log-probabilities over a continuation: computed once, compared many times."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]
    logprobs: torch.Tensor  # [T, V], T = len(continuation) - 1
    nll: torch.Tensor  # [T] negative log-likelihood of each next token of the text

    @property
    def ppl(self) -> float:
        return math.exp(float(self.nll.mean()))


@dataclass(frozen=True)
class Measured:
    """One strategy against the full cache over a continuation (see the module docstring)."""

    spec: str
    context: int  # tokens prefilled
    tokens: int  # continuation positions scored
    ppl: float
    ppl_full: float
    kl: float  # mean KL(full || strategy) per position, nats
    kl_se: float  # its standard error over positions
    agreement: float  # share of positions whose most likely token equals the full cache's
    bytes_per_token: float  # bytes held after the whole text, over its tokens
    kl_each: tuple[float, ...] = ()  # per position (for noise estimates; not in as_dict)

    def as_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "kl_each"}


def split(ids: Sequence[int], continuation: int) -> tuple[list[int], list[int]]:
    """(context, continuation) of a token list: the last ``continuation`` + 1 tokens are scored
    (the first of them is the context's next token, so it is both context target and input)."""
    if continuation < 2:
        raise InvalidParams(f"the continuation must be at least 2 tokens, got {continuation}")
    if len(ids) < continuation + 2:
        raise InvalidParams(f"the text gives {len(ids)} tokens: fewer than a context plus a {continuation}-token "
                            "continuation")
    cut = len(ids) - continuation
    return list(ids[:cut]), list(ids[cut:])


def _prefill(runner: ModelRunner, context: Sequence[int]):
    if len(context) + 1 > runner.capacity:
        raise InvalidParams(f"the text has {len(context)} context tokens, more than this cache's capacity of "
                            f"{runner.capacity}; use fewer tokens")
    seq = runner.new_sequence()
    runner.step([seq], [list(context)])
    return seq


def _logprobs(runner: ModelRunner, context: Sequence[int], continuation: Sequence[int]) -> tuple[torch.Tensor, float]:
    """Log-probabilities [T, V] over ``continuation[:-1]`` after ``context``, and the bytes per
    token the cache holds once the prompt has settled. The continuation's first token goes in as a
    decode step (after which a quantized cache has sealed what its press kept and a window's pages
    are back in the pool: the bytes are read there), the rest as one teacher-forced forward."""
    seq = _prefill(runner, context)
    try:
        first = runner.step([seq], [[continuation[0]]])  # [1, V]
        stats = runner.stats()
        held = stats.bytes_used / max(1, stats.tokens_stored) if stats is not None else 0.0
        rest = [runner.score(seq, list(continuation[1:-1]))] if len(continuation) > 2 else []  # [T - 1, V]
        lp = torch.log_softmax(torch.cat([first, *rest]).float(), -1)
    finally:
        runner.free(seq)
    return lp, held


def reference(model: torch.nn.Module, context: Sequence[int], continuation: Sequence[int],
              spec: str | CacheConfig = "dynamic") -> Reference:
    if len(continuation) < 2 or not context:
        raise InvalidParams("the protocol needs a context and a continuation of at least 2 tokens")
    lp, _ = _logprobs(ModelRunner(model, parse_kv_spec(spec)), context, continuation)
    target = torch.tensor(continuation[1:])
    return Reference(tuple(context), tuple(continuation), lp, -lp[torch.arange(len(target)), target])


def measure(model: torch.nn.Module, ref: Reference, spec: str | CacheConfig) -> Measured:
    """``spec`` against the full cache ``ref`` on the same context and continuation."""
    cfg = parse_kv_spec(spec)
    if not cfg.uses_cache:
        raise InvalidParams(f"--kv {cfg.spec()!r}: 'none' recomputes exactly; compare cache strategies")
    lp, held = _logprobs(ModelRunner(model, cfg), ref.context, ref.continuation)
    target = torch.tensor(ref.continuation[1:])
    rows = torch.arange(len(target))
    kl = (ref.logprobs.exp() * (ref.logprobs - lp)).sum(-1).clamp_min(0)  # [T]
    n = len(target)
    se = float(kl.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    agree = float((ref.logprobs.argmax(-1) == lp.argmax(-1)).float().mean())
    return Measured(cfg.spec(), len(ref.context), n, math.exp(float(-lp[rows, target].mean())), ref.ppl,
                    float(kl.mean()), se, agree, held, tuple(kl.tolist()))
