"""A request as the scheduler holds it: its samples, timings, outcome and how a failure is reported.

``Request`` is what callers submit (prompt token ids, SamplingParams, tenant salt, a delta
callback, optionally a sequence to continue) and what they get back when it ends (``samples``,
``error`` and ``error_kind``). ``Sample`` is one of its ``n`` continuations: its sequence, the
tokens still to feed, its tokens, text and, when asked for, each token's log-probability with the
most likely alternatives. ``Sample.take`` is the one place that decides when a sample ends (EOS, a
stop string, ``max_tokens``, the context) and which text is safe to stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcache.engine.params import CompletionOutput, Delta, RequestOutput, SamplingParams, TokenLogprob
from kvcache.engine.runner import Seq
from kvcache.engine.stops import TextTracker
from kvcache.errors import CacheFull, ConstraintFault, ContextOverflow, InvalidParams


class Sample:
    __slots__ = ("index", "seq", "feed", "tokens", "text", "gen", "reason", "logprobs", "lp_sent", "matcher",
                 "counts", "seen", "spec", "draft", "follow")

    def __init__(self, index: int, text: TextTracker, gen: torch.Generator | None) -> None:
        self.index = index
        self.seq: Seq | None = None
        self.feed: list[int] = []
        self.tokens: list[int] = []
        self.text = text
        self.gen = gen
        self.reason: str | None = None
        self.logprobs: list[TokenLogprob] = []  # one per token, when params.logprobs is set
        self.lp_sent = 0  # of those, how many went out with a Delta
        self.matcher: Any = None  # the constraint's matcher, in the state after ``tokens`` (engine/grammar.py)
        self.counts: torch.Tensor | None = None  # output token counts [V], for frequency/presence penalties
        self.seen: torch.Tensor | None = None  # prompt and output tokens [V], for the repetition penalty
        self.spec: Any = None  # its Speculator, when it speculates (engine/speculate.py)
        self.draft = 0  # proposed tokens at the end of ``feed``, verified in its next forward
        self.follow: Any = None  # its donor and the tokens it will take, or False (engine/inflight.py)

    def start(self, params: SamplingParams, prompt_ids: list[int], vocab: int, matcher: Any = None) -> None:
        """What the sampler needs from this sample's history, for the parameters that use it."""
        from kvcache.engine.sampler import needs_counts, needs_seen

        self.matcher = matcher
        if needs_counts(params):
            self.counts = torch.zeros(vocab, dtype=torch.float32)
        if needs_seen(params):
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[torch.tensor(prompt_ids, dtype=torch.long).clamp_(0, vocab - 1)] = True

    def fork_state(self, twin: "Sample") -> None:
        """Give ``twin`` (a new sample of the same request, before any token) this one's state."""
        twin.matcher = self.matcher.deep_copy() if self.matcher is not None else None
        twin.counts = self.counts.clone() if self.counts is not None else None
        twin.seen = self.seen.clone() if self.seen is not None else None

    def take(self, tok: int, entry: TokenLogprob | None, eos: set[int], params: SamplingParams, room: int) -> str:
        """Add a sampled token (and its log-probability entry, if asked for). The sample ends on
        EOS or one of ``stop_token_ids`` (the token is dropped), a stop string, the end of its
        constraint, ``max_tokens``, or when ``room`` tokens (what the context leaves after the
        prompt) are generated: prompt and completion together never exceed the context. A
        constrained sample cut by ``max_tokens`` ends with "length", never as complete text.
        Returns the text now safe to stream."""
        self.tokens.append(tok)
        if entry is not None:
            self.logprobs.append(entry)
        if self.counts is not None:
            self.counts[tok] += 1
        if self.seen is not None:
            self.seen[tok] = True
        grammar_end = False
        if self.matcher is not None:
            if not self.matcher.consume_token(tok):
                raise ConstraintFault(f"the constraint refused token {tok}: {self.matcher.get_error()}")
            grammar_end = self.matcher.is_stopped()
        if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids or (
                grammar_end and tok in eos):
            self.tokens.pop()
            del self.logprobs[len(self.tokens) :]
            self.reason = "stop"
        elif self.text.add(tok) or grammar_end:
            self.reason = "stop"
        elif len(self.tokens) >= params.max_tokens or len(self.tokens) >= room:
            self.reason = "length"
        return self.text.pending(final=self.reason is not None)

    def delta(self, piece: str, tok: int, logprobs: bool) -> Delta:
        """A streamed piece, with (when ``logprobs``) the entries of the tokens since the last one."""
        lps = None
        if logprobs:
            lps, self.lp_sent = self.logprobs[self.lp_sent :], len(self.logprobs)
        return Delta(self.index, piece, tok, self.reason, lps)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    priority: int = 0
    on_delta: Callable[[Delta], None] | None = None  # called on the engine thread
    prompt: str | None = None
    samples: list[Sample] = field(default_factory=list)
    arrival: int = 0
    cached_tokens: int = -1  # prompt tokens reused at first admission (-1: not admitted yet)
    preemptions: int = 0
    error: str | None = None  # set when the request could not be served
    error_kind: str | None = None  # with error: "capacity", "invalid" or "internal" (see error_kind)
    t_arrival: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    # a sequence the first sample continues (a chat session's, a loaded prompt cache): the tokens
    # it shares with the prompt are kept, the rest recomputed; None: the prefix cache's longest match
    seq: Seq | None = None
    keep_seq: bool = False  # the caller keeps ``seq`` when the request ends (else released like any)
    record_stats: bool = False  # take the cache's statistics as the request ends, before its pages go back
    kv_stats: Any = None  # those statistics (CacheStats), with record_stats
    exception: Exception | None = field(default=None, repr=False)  # the failure behind ``error``

    @property
    def finished(self) -> bool:
        return self.error is not None or (bool(self.samples) and all(s.reason for s in self.samples))

    def output(self) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text.text, list(s.tokens), s.reason or "abort",
                                 list(s.logprobs) if self.params.logprobs is not None else None)
                for s in self.samples]
        r = RequestOutput(prompt=self.prompt, prompt_token_ids=self.prompt_ids, outputs=outs,
                          cached_tokens=max(0, self.cached_tokens))
        r.prefill_s = max(0.0, self.t_first - self.t_arrival) if self.t_first else 0.0
        r.decode_s = max(0.0, self.t_end - self.t_first) if self.t_first else 0.0
        r.metrics = {"preemptions": self.preemptions}
        specs = [s.spec for s in self.samples if s.spec is not None]
        if specs:  # speculative decoding: proposals verified and kept, verifying forwards, the prediction's share
            for name in ("proposed", "accepted", "forwards", "pred_accepted", "pred_rejected"):
                r.metrics[f"spec_{name}"] = sum(getattr(sp, name) for sp in specs)
        if self.kv_stats is not None:
            r.kv_stats, r.kv_bytes = self.kv_stats, self.kv_stats.bytes_used
        return r


def check_prompt(prompt_ids: list[int], capacity: int) -> None:
    """Refuse a prompt that leaves no room in the context for one new token."""
    if not prompt_ids:
        raise ContextOverflow("the prompt is empty: give at least one token")
    if len(prompt_ids) >= capacity:
        raise ContextOverflow(f"prompt of {len(prompt_ids)} tokens does not fit the context of {capacity} "
                              "tokens (it needs room for at least one new token)")


def error_kind(error: Exception) -> str:
    """How a request's failure is reported: "capacity" (the KV pool is full: retry later),
    "invalid" (the request cannot be served as asked: too long, out of range) or "internal" (a
    fault of the engine or of the machine under it, a full disk among them)."""
    if isinstance(error, CacheFull):
        return "capacity"
    if isinstance(error, (ContextOverflow, InvalidParams)):
        return "invalid"
    return "internal"
