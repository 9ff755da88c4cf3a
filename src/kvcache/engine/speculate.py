"""Speculative decoding: proposals of the next tokens, and their verification.

A decoding sample with a ``Speculator`` feeds its last token and up to ``k`` proposed tokens in one
forward; the logits after each are checked in order (``verify``) and the sample keeps the proposals
the model agrees with plus one token of its own, so a forward gives 1 to k+1 tokens. The cache
then drops the K/V of the rejected tokens (``ModelRunner.truncate``) before anything else sees
them: the prefix index, the tiers and the next step find what a plain decode would have left.

Proposers, in this order of preference:
- a prediction (OpenAI's ``prediction`` content, ``SamplingParams.prediction``): the text the
  caller expects, followed from where the output agrees with it, realigned by n-gram where it
  departs;
- a draft model (``LLM(draft_model=...)``, ``--draft-model``): a smaller or more quantized model
  with the same tokenizer decodes k tokens greedily on its own cache, which is cut back to what
  the target kept, as the target's is;
- prompt lookup: the longest recent n-gram (4 down to 2 tokens) at the end of the sequence that
  occurred before in the prompt or the output proposes what followed it. (A single token's match
  was measured to propose what the model keeps about one time in twenty: less than a verifying
  forward costs.)

k adapts per sample: it grows after a fully accepted proposal and falls to one more than what was
accepted otherwise; a lookup that keeps failing rests, longer each time it fails again (8, 16, ...
up to 64 steps) until a proposal is kept.

Verification is exact. Greedy: proposals are kept while each equals the argmax after the one
before (and batch invariance makes those logits the bits a one-token decode gives), so the text is
the text without speculation. Sampled: a proposal d at a position whose distribution is p is kept
with probability p(d), else a token is drawn from p without d (renormalized), the standard
rejection step for a proposal that is a single token; the output keeps the target distribution.
Penalties, logit_bias and min_tokens apply at each position as a one-token decode there would
apply them: the position after proposals d1 .. di sees the sample's counts and seen tokens with
d1 .. di added and i more tokens out (``verify_rows``). Under a grammar (``verify_constrained``)
position i's choice is the one a constrained decode there makes: the grammar's matcher takes
d1 .. di in turn (and gives them back at the end); greedy rows check the unmasked argmax against
the grammar and compute a mask only where it is refused, as the engine's lazy path does; sampled
rows draw under each position's mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from kvcache.engine.params import SamplingParams
from kvcache.engine.sampler import Row, adjust, is_greedy, warp
from kvcache.errors import InvalidParams

MAX_NGRAM, MIN_NGRAM = 4, 2
# a lookup refused REST_AFTER times in a row rests REST_STEPS steps, twice as long after each such
# rest without a kept proposal in between, at most REST_MAX
REST_AFTER, REST_STEPS, REST_MAX = 3, 8, 64
SEARCH_LIMIT = 8192  # the last tokens of a sequence searched for an n-gram
DEFAULT_K = 8  # proposals per forward for a prediction or a draft model


def speculative(params: SamplingParams, draft: bool = False) -> bool:
    """Whether a request speculates: a prediction, prompt lookup or a draft model (``draft``).
    Penalties, bias and min_tokens apply per verified position (``verify_rows``), a grammar's mask
    too (``verify_constrained``); log-probabilities come from the verifying rows, the logits a
    one-token decode gives."""
    return bool(params.prompt_lookup or params.prediction or draft)


class Speculator:
    """One sample's proposer and its adaptive k, with what it proposed and what was kept."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], draft: Any = None) -> None:
        self.k_max = params.prompt_lookup or DEFAULT_K
        self.draft = DraftProposer(draft) if draft is not None else None
        self.k = self.k_max
        self.lookup = params.prompt_lookup > 0
        self.prediction = list(params.prediction)
        self.at: int | None = 0 if self.prediction else None  # next prediction token expected
        self.history = list(prompt_ids)  # prompt and output tokens, for the lookup
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        for end in range(1, len(self.history)):  # the last token's n-grams have no continuation yet
            self._index(end)
        self.refused = 0
        self.rest = 0
        self.pause = REST_STEPS  # the next rest's length
        self.proposed = self.accepted = 0  # tokens proposed and kept, all proposers
        self.forwards = 0  # verifying forwards
        self.pred_accepted = self.pred_rejected = 0  # of those, the prediction's
        self._from_prediction = False

    def _index(self, end: int) -> None:
        """Record the n-grams ending at ``end`` (the position after them) of the history."""
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            if end - n >= 0:
                self.index[tuple(self.history[end - n : end])] = end

    def took(self, tokens: list[int]) -> None:
        """The sample's new tokens (kept proposals and the model's own)."""
        for t in tokens:
            self.history.append(t)
            # index the n-grams ending one before the end: the latest occurrence must have a continuation
            self._index(len(self.history) - 1)
            if self.at is not None:
                if self.at < len(self.prediction) and self.prediction[self.at] == t:
                    self.at += 1
                else:
                    self.at = None
        if self.prediction and self.at is None:
            self.at = self._realign()

    def _realign(self) -> int | None:
        """Where the output's last tokens occur in the prediction (the longest n-gram that does, down
        to one token: the caller expects this text, so a single token's match is trusted)."""
        for n in range(MAX_NGRAM, 0, -1):
            if len(self.history) < n:
                continue
            tail = self.history[-n:]
            for i in range(len(self.prediction) - n, -1, -1):
                if self.prediction[i : i + n] == tail:
                    return i + n
        return None

    def propose(self, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens to verify after the sample's last token (which the history
        ends with)."""
        k = min(self.k, limit)
        self._from_prediction = False
        if k < 1:
            return []
        if self.at is not None and self.at < len(self.prediction):
            self._from_prediction = True
            return self.prediction[self.at : self.at + k]
        if self.draft is not None:
            return self.draft.propose(self.history, k)
        if not self.lookup:
            return []
        if self.rest > 0:
            self.rest -= 1
            return []
        h = self.history
        for n in range(min(MAX_NGRAM, len(h) - 1), MIN_NGRAM - 1, -1):
            end = self.index.get(tuple(h[-n:]))
            if end is not None and end < len(h) and len(h) - end <= SEARCH_LIMIT:
                return h[end : end + k]
        return []

    def close(self) -> None:
        """The sample gave its pages back (it ended, or was preempted): so does its draft."""
        if self.draft is not None:
            self.draft.close()

    def verified(self, proposed: int, accepted: int) -> None:
        """A verification's outcome: adapt k, rest a lookup that keeps failing, count."""
        self.forwards += 1
        self.proposed += proposed
        self.accepted += accepted
        if self._from_prediction:
            self.pred_accepted += accepted
            self.pred_rejected += proposed - accepted
        if accepted == proposed:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0 and not self._from_prediction and self.draft is None:
            self.refused += 1
            if self.refused >= REST_AFTER:
                self.rest, self.refused = self.pause, 0
                self.pause = min(REST_MAX, 2 * self.pause)
        else:
            self.refused = 0
            if accepted:
                self.pause = REST_STEPS



class DraftProposer:
    """A draft model's proposals for one sample: its own sequence on the draft's runner (no prefix
    cache), brought up to the sample's history (what it holds beyond the longest common prefix is
    cut first: the proposals the target refused), then k greedy one-token steps."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.seq: Any = None

    def propose(self, history: list[int], k: int) -> list[int]:
        from kvcache.prefix.radix import common_prefix

        if self.seq is None:
            self.seq = self.runner.new_sequence()
        seq = self.seq
        keep = min(common_prefix(seq.tokens, history), len(history) - 1)
        if keep < len(seq.tokens):
            self.runner.truncate(seq, keep)
        feed = history[keep:]
        room = self.runner.capacity - len(history)
        out: list[int] = []
        for _ in range(min(k, room)):
            logits = self.runner.step([seq], [feed])
            tok = int(torch.argmax(logits[0]))
            out.append(tok)
            feed = [tok]
        return out

    def close(self) -> None:
        if self.seq is not None:
            self.runner.free(self.seq)
            self.seq = None


def verify_rows(params: SamplingParams, gen: torch.Generator | None, n_out: int, counts: torch.Tensor | None,
                seen: torch.Tensor | None, draft: list[int]) -> list[Row]:
    """The sampler's rows of a verifying forward's k+1 positions: position i as a one-token decode
    would see it after proposals draft[:i] (``n_out + i`` tokens out; ``counts`` [V] and ``seen``
    [V], the sample's penalty state, with draft[:i] added; copies, the sample's own are untouched)."""
    rows = []
    for i in range(len(draft) + 1):
        rows.append(Row(params, gen, n_out + i, counts, seen))
        if i < len(draft):
            if counts is not None:
                counts = counts.clone()
                counts[draft[i]] += 1
            if seen is not None:
                seen = seen.clone()
                seen[draft[i]] = True
    return rows


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams, gen: torch.Generator | None,
           rows: list[Row] | None = None, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The tokens a sample keeps from one verifying forward: ``logits`` [k+1, V] are those after
    its last token and after each of the k proposals ``draft``; ``rows``: the sampler's rows of
    those positions (``verify_rows``; default: the parameters alone, no penalty state), with the
    end-of-sequence tokens ``stop_ids`` min_tokens holds back. Returns the kept proposals and one
    more token of the model's own (exact: see the module docstring)."""
    k = len(draft)
    rows = rows if rows is not None else [Row(params)] * (k + 1)
    scores = adjust(logits, rows, None, stop_ids)  # [k+1, V]: the logits themselves when nothing applies
    if is_greedy(params):
        best = torch.argmax(scores, dim=-1).tolist()
        out = []
        for i in range(k):
            if best[i] != draft[i]:
                return out + [int(best[i])]
            out.append(draft[i])
        return out + [int(best[k])]
    probs = warp(scores, [params] * (k + 1))
    out = []
    for i in range(k):
        t = _judge(probs[i], draft[i], gen)
        if t is not None:
            return out + [t]
        out.append(draft[i])
    return out + [int(torch.multinomial(probs[k], 1, generator=gen))]


def _judge(p: torch.Tensor, d: int, gen: torch.Generator | None) -> int | None:
    """The rejection step for proposal ``d`` where the target's probabilities are ``p`` [V]: None
    when it is kept (with probability p(d)), else a token drawn from p without d."""
    if float(torch.rand((), generator=gen)) < float(p[d]):
        return None
    rest = p.clone()
    rest[d] = 0.0
    total = float(rest.sum())
    if total <= 0.0:  # p was all on d: it would have been kept
        return None
    return int(torch.multinomial(rest / total, 1, generator=gen))


def verify_constrained(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                       gen: torch.Generator | None, rows: list[Row], stop_ids: tuple[int, ...], matcher: Any,
                       mask_of: Callable[[Any], torch.Tensor], allowed: Callable[[Any, int], bool]) -> list[int]:
    """``verify`` for a sample under a grammar: ``matcher`` is its state after the sample's last
    token; ``mask_of(matcher)`` gives the grammar's mask there ([1, W] int32), ``allowed(matcher,
    t)`` whether that mask allows t (engine/scheduler.py's check). The matcher takes each kept
    proposal to reach the next position and is given them back before this returns. A kept
    end-of-sequence token, or a grammar that stops, ends the verification there."""
    k = len(draft)
    scores = adjust(logits, rows, None, stop_ids)  # [k+1, V], unmasked
    greedy = is_greedy(params)
    out: list[int] = []
    taken = 0

    def masked(i: int) -> torch.Tensor:  # position i's scores under the grammar's mask: [V]
        mask = mask_of(matcher)
        if matcher.is_error() or not bool(mask.any()):
            raise InvalidParams("the constraint allows no token after the text so far")
        return adjust(logits[i : i + 1], [replace(rows[i], mask=0)], mask, stop_ids)[0]

    try:
        for i in range(k + 1):
            d = draft[i] if i < k else None
            if greedy:
                t = int(torch.argmax(scores[i]))
                if not allowed(matcher, t):
                    t = int(torch.argmax(masked(i)))
                keep = d is not None and t == d
            else:
                p = warp(masked(i)[None], [params])[0]
                if d is None:
                    t, keep = int(torch.multinomial(p, 1, generator=gen)), False
                else:
                    judged = _judge(p, d, gen)
                    t, keep = (d, True) if judged is None else (judged, False)
            if not keep:
                return out + [t]
            assert d is not None
            out.append(d)
            if not matcher.consume_token(d):
                raise InvalidParams(f"the constraint refused token {d}: {matcher.get_error()}")
            taken += 1
            if d in stop_ids or matcher.is_stopped():
                return out
        return out
    finally:
        if taken:
            matcher.rollback(taken)
