"""One request's life: reuse what the sequence already holds, prefill, fork for n, decode, stop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvcache.engine.params import CompletionOutput, RequestOutput, SamplingParams
from kvcache.engine.runner import ModelRunner, Seq
from kvcache.engine.sampler import log_probs, make_generator, sample, token_logprob
from kvcache.engine.stops import TextTracker
from kvcache.errors import ContextOverflow
from kvcache.models.tokenizer import Tokenizer


@dataclass
class Delta:
    """A streamed piece of sample ``index``'s text; ``finish_reason`` is set on its last piece."""

    index: int
    text: str
    token_id: int | None
    finish_reason: str | None = None
    logprobs: list | None = None  # TokenLogprob of the tokens since the last Delta, when asked for


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RequestRun:
    """Iterate to run the request; ``result`` is complete when iteration ends.

    ``seq`` may already hold tokens (a chat session, a loaded prompt cache); without one, the
    prefix cache gives a sequence holding the longest cached prefix of the prompt. The longest
    common prefix with the prompt is kept (never the whole prompt: its last token is recomputed for
    its logits) and only the rest is prefilled. With ``keep_seq`` the first sample's sequence is
    left in place for the next turn; the others go to the prefix cache (under ``salt``) or are
    freed.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        seq: Seq | None = None,
        keep_seq: bool = False,
        salt: str | None = None,
    ) -> None:
        if not prompt_ids:
            raise ContextOverflow("the prompt is empty: give at least one token")
        if len(prompt_ids) >= runner.capacity:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {runner.capacity} "
                "tokens (it needs room for at least one new token)"
            )
        self.runner = runner
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.params = params
        self.seq = seq  # None: looked up in the prefix cache when the run starts
        self.keep_seq = keep_seq
        self.salt = salt
        self.eos = set(tokenizer.eos_token_ids) | set(runner.config.eos_token_ids)
        self.result = RequestOutput(prompt=prompt, prompt_token_ids=list(prompt_ids), outputs=[])

    def __iter__(self) -> Iterator[Delta]:
        p, runner = self.params, self.runner
        t0 = time.perf_counter()
        if self.seq is None:
            self.seq = runner.lookup(self.prompt_ids, self.salt)
        reuse = min(common_prefix(self.seq.tokens, self.prompt_ids), len(self.prompt_ids) - 1)
        reuse = runner.reusable(self.seq, reuse)
        runner.truncate(self.seq, reuse)
        self.result.cached_tokens = reuse
        seqs = [self.seq]
        try:
            logits = runner.step(seqs, [self.prompt_ids[reuse:]])  # [1, V]
            seqs += [runner.fork(self.seq) for _ in range(p.n - 1)]
            logits = logits.expand(p.n, -1)
            gens = [make_generator(p, i) for i in range(p.n)]
            texts = [TextTracker(self.tokenizer, p.stop) for _ in range(p.n)]
            tokens: list[list[int]] = [[] for _ in range(p.n)]
            reasons: list[str | None] = [None] * p.n
            lps: list[list] = [[] for _ in range(p.n)]
            sent = [0] * p.n
            t_first = 0.0
            while True:
                feed: list[int] = []
                for i in range(p.n):
                    if reasons[i] is not None:
                        continue
                    row = logits[len(feed)]
                    tok = sample(row, p, gens[i])
                    feed.append(i)
                    tokens[i].append(tok)
                    if p.logprobs is not None:
                        lps[i].append(token_logprob(log_probs(row), tok, p.logprobs))
                    if tok in self.eos and not p.ignore_eos:
                        tokens[i].pop()
                        del lps[i][len(tokens[i]) :]
                        reasons[i] = "stop"
                    elif texts[i].add(tok):
                        reasons[i] = "stop"
                    elif len(tokens[i]) >= p.max_tokens or len(seqs[i].tokens) >= runner.capacity:
                        reasons[i] = "length"
                    piece = texts[i].pending(final=reasons[i] is not None)
                    if piece or reasons[i] is not None:
                        yield Delta(i, piece, tok, reasons[i], lps[i][sent[i] :] if p.logprobs is not None else None)
                        sent[i] = len(lps[i])
                if not t_first:
                    t_first = time.perf_counter()
                live = [i for i in range(p.n) if reasons[i] is None]
                if not live:
                    break
                logits = runner.step([seqs[i] for i in live], [[tokens[i][-1]] for i in live])
            t_end = time.perf_counter()
        finally:
            stats = runner.stats()
            self.result.kv_stats = stats
            self.result.kv_bytes = stats.bytes_used if stats is not None else 0
            for i, s in enumerate(seqs):
                if not (self.keep_seq and i == 0):
                    runner.release(s, self.salt)  # frees a sequence whose last forward failed
        self.result.prefill_s = t_first - t0
        self.result.decode_s = t_end - t_first
        self.result.outputs = [
            CompletionOutput(i, texts[i].text, tokens[i], reasons[i] or "length",
                             lps[i] if p.logprobs is not None else None) for i in range(p.n)
        ]
