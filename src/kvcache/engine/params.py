"""SamplingParams (vLLM's names) and what a request gives back: streamed deltas and its outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvcache.engine.grammar import Constraint
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

    ``logit_bias`` ({token id: bias in [-100, 100]}) is added to the logits; ``repetition_penalty``
    (1 off) divides the positive logits of tokens seen in the prompt or the output and multiplies
    the negative ones; ``frequency_penalty`` and ``presence_penalty`` (0 off, -2 to 2) subtract
    count x frequency and presence once from the tokens of the output. ``min_tokens`` holds back
    EOS and ``stop_token_ids`` until that many tokens are out; ``stop_token_ids`` end the text like
    EOS (the token is not part of it). ``constraint`` (engine/grammar.py) makes the text follow a
    JSON schema, a regex, a choice or a grammar. All of them apply to greedy decoding too.

    Speculative decoding (engine/speculate.py): ``prompt_lookup`` (up to that many tokens proposed
    per forward from n-grams of the prompt and output; None, the default: the scheduler's default,
    ``SchedulerConfig.prompt_lookup`` or ``serve --prompt-lookup``, off where it has none; 0: off
    for this request, whatever the default) and ``prediction`` (token ids of the text expected,
    OpenAI's predicted outputs) propose tokens that one forward verifies; the text is the text
    without them (greedy token for token; sampled, the same distribution). With both, the
    prediction proposes first, the lookup where the prediction has nothing to propose or rests
    after failing. A draft model (``LLM(draft_model=...)``) proposes for every request.
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
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    constraint: Constraint | None = None
    prompt_lookup: int | None = None
    prediction: tuple[int, ...] = ()
    # token ids written into the text even where the tokenizer counts them special (the markers
    # of a tool call: a parser reads them); every other special token is left out of the text
    keep_special: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self._convert()
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
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            _check(_number(v) and lo <= v <= hi, f"{name} must be between {lo:g} and {hi:g}, got {v!r}")
        _check(_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10] (1 is off), got {self.repetition_penalty!r}")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _check(len(self.stop_token_ids) <= MAX_STOP_IDS and all(_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be at most {MAX_STOP_IDS} token ids (integers >= 0)")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias has {len(self.logit_bias)} entries, over the "
                                                        f"limit of {MAX_LOGIT_BIAS}")
        for t, b in self.logit_bias:
            _check(_int(t) and t >= 0, f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            _check(_number(b) and -100.0 <= b <= 100.0, f"logit_bias values must be between -100 and 100, "
                                                        f"got {b!r} for token {t}")
        _check(self.prompt_lookup is None or (_int(self.prompt_lookup) and 0 <= self.prompt_lookup <= MAX_LOOKUP),
               f"prompt_lookup must be None (the default) or between 0 (off) and {MAX_LOOKUP} proposed tokens, "
               f"got {self.prompt_lookup!r}")
        _check(len(self.prediction) <= MAX_PREDICTION and all(_int(t) and t >= 0 for t in self.prediction),
               f"prediction must be at most {MAX_PREDICTION} token ids")
        _check(self.constraint is None or isinstance(self.constraint, Constraint),
               f"constraint must be a kvcache.engine.grammar.Constraint, got {type(self.constraint).__name__}")

    def _convert(self) -> None:
        """logit_bias from a dict (keys may be strings of ints, as JSON writes them), stop_token_ids
        from a list: both kept as tuples (the parameters are frozen)."""
        bias = self.logit_bias
        if isinstance(bias, dict):
            pairs = []
            for k, v in bias.items():
                try:
                    tok = int(k) if isinstance(k, str) else k
                except ValueError:
                    raise InvalidParams(f"logit_bias keys must be token ids, got {k!r}") from None
                pairs.append((tok, float(v) if _number(v) else v))
            object.__setattr__(self, "logit_bias", tuple(pairs))
        elif bias is None:
            object.__setattr__(self, "logit_bias", ())
        else:
            object.__setattr__(self, "logit_bias", tuple(tuple(x) for x in bias))
        ids = self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", () if ids is None else tuple(ids))
        object.__setattr__(self, "prediction", () if self.prediction is None else tuple(self.prediction))

    def check_vocab(self, vocab: int) -> None:
        """Token ids in ``logit_bias`` and ``stop_token_ids`` within the model's vocabulary."""
        bad = ([t for t, _ in self.logit_bias if t >= vocab] + [t for t in self.stop_token_ids if t >= vocab]
               + [t for t in self.prediction if t >= vocab])
        if bad:
            where = ("logit_bias" if any(t == bad[0] for t, _ in self.logit_bias) else
                     "stop_token_ids" if bad[0] in self.stop_token_ids else "prediction")
            raise InvalidParams(f"{where}: token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})")


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_LOOKUP = 32  # tokens proposed per forward at most
MAX_PREDICTION = 32768
MAX_STOP_IDS = 64


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
