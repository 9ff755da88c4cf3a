"""SamplingParams (vLLM's names) and what a request gives back: streamed deltas and its outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvcache.errors import InvalidParams


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 (or anything below 1e-6) is greedy. top_k 0 (or -1), top_p 1.0 and min_p 0 turn those
    filters off; min_p keeps the tokens whose probability (after temperature) is at least min_p times
    the most likely token's. ``stop`` strings
    end the text before the match; EOS ends it unless ``ignore_eos``. ``n`` samples share the
    prompt's cache pages. Any integer seed is accepted: sample i uses (seed + i) mod 2^64.
    ``logprobs``: record each generated token's log-probability under the model (log-softmax of
    its logits, before temperature and filters) and that many of the most likely alternatives
    (0 to MAX_LOGPROBS); None records nothing.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
               and 0.0 <= self.temperature <= 100.0,
               f"temperature must be between 0 and 100, got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
               f"top_k must be an integer >= 1, or 0 or -1 for off, got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and not isinstance(self.min_p, bool)
               and 0.0 <= self.min_p <= 1.0, f"min_p must be between 0 and 1, got {self.min_p!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               f"seed must be an integer, got {self.seed!r}")
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, f"n must be between 1 and 128, got {self.n!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")


MAX_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """A token, its log-probability, and the most likely tokens with theirs (best first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidParams(message)


@dataclass
class Delta:
    """A streamed piece of sample ``index``'s text; ``finish_reason`` is set on its last piece."""

    index: int
    text: str
    token_id: int | None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # the tokens' entries since the last Delta, when asked for


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    """One prompt's result. ``text``, ``token_ids`` and ``finish_reason`` are those of the first
    sample; ``outputs`` holds all ``n``."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int = 0  # prompt tokens whose K/V came from the cache (not recomputed)
    prefill_s: float = 0.0  # time to first token
    decode_s: float = 0.0  # time for the remaining tokens
    kv_bytes: int = 0  # K/V bytes held for this request at its end
    kv_stats: Any = None  # the cache's CacheStats at the request's end, before its pages are freed
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def decode_tok_s(self) -> float:
        """New tokens per second after the first one (decode speed)."""
        steps = max(len(o.token_ids) for o in self.outputs) - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0
