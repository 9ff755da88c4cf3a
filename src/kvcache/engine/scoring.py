"""Prompt log-probabilities: each prompt token's log-probability given the tokens before it (what
an OpenAI completions request with ``echo`` and ``logprobs`` returns for the prompt, and what
evaluation harnesses sum for a loglikelihood).

The prompt runs through the cache from its start in chunks of ``SCORE_CHUNK`` tokens (the logits
of every position are needed, so a cached prefix cannot stand in for them; a chunk's logits are
[chunk, vocab] at most); afterwards its pages go to the prefix index, so the generation that
follows reuses them. Runs on the engine thread (the caller serialises it with the scheduler).
"""

from __future__ import annotations

from kvcache.engine.params import TokenLogprob
from kvcache.engine.runner import ModelRunner
from kvcache.engine.sampler import log_probs, token_logprob

SCORE_CHUNK = 256


def prompt_logprobs(runner: ModelRunner, ids: list[int], k: int, salt: str | None = None) -> list[TokenLogprob | None]:
    """One entry per prompt token: None for the first (nothing precedes it), then each token's
    log-probability and the ``k`` most likely tokens at its position."""
    out: list[TokenLogprob | None] = [None]
    seq = runner.new_sequence()
    try:
        prev = None  # log-probabilities after the previous chunk's last token: [V]
        for a in range(0, len(ids), SCORE_CHUNK):
            chunk = ids[a : a + SCORE_CHUNK]
            lp = log_probs(runner.score(seq, chunk))  # [len(chunk), V]
            rows = ([prev] if prev is not None else []) + list(lp[:-1])
            for row, tok in zip(rows, chunk if prev is not None else chunk[1:]):
                out.append(token_logprob(row, tok, k))
            prev = lp[-1]
    finally:
        runner.release(seq, salt)
    return out
