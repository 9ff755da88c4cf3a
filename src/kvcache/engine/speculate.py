"""Speculative decoding: proposals of the next tokens, and their verification.

A decoding sample with a ``Speculator`` feeds its last token and up to ``k`` proposed tokens in one
forward; the logits after each are checked in order (``verify``) and the sample keeps the proposals
the model agrees with plus one token of its own, so a forward gives 1 to k+1 tokens. The cache
then drops the K/V of the rejected tokens (``ModelRunner.truncate``) before anything else sees
them: the prefix index, the tiers and the next step find what a plain decode would have left.

Proposers (engine/proposers.py): a prediction (OpenAI's ``prediction`` content,
``SamplingParams.prediction``), a draft model (``LLM(draft_model=...)``, ``--draft-model``) and
prompt lookup (``SamplingParams.prompt_lookup``, or the scheduler's default for a request that
leaves it None); each step the one with the most evidence proposes (the output tokens in a row a
prediction agrees with; a lookup's n-gram; a draft model counts as a 4-gram), the earlier in that
order on a tie. Each has its own adaptive k (it grows after a fully accepted proposal and falls to
one more than what was accepted otherwise), and a prediction or a lookup that keeps failing rests,
longer each time it fails again (8, 16, ... up to 64 steps), until a proposal of its is kept: a
wrong prediction leaves the steps to the lookup, or to decoding without verifying forwards but a
few probes (measured at 0.97x or better of no speculation, BENCHMARKS.md).

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
from kvcache.engine.proposers import DraftProposer, LookupProposer, PredictionProposer
from kvcache.engine.sampler import Row, adjust, draw, is_greedy, warp
from kvcache.errors import ConstraintFault, InvalidParams


def speculative(params: SamplingParams, draft: bool = False) -> bool:
    """Whether a request speculates: a prediction, prompt lookup or a draft model (``draft``).
    ``params.prompt_lookup`` is the request's own (0 or None: none); the scheduler resolves its
    default before asking. Penalties, bias and min_tokens apply per verified position
    (``verify_rows``), a grammar's mask too (``verify_constrained``); log-probabilities come from
    the verifying rows, the logits a one-token decode gives."""
    return bool(params.prompt_lookup or params.prediction or draft)


class Speculator:
    """One sample's proposers (a prediction, a draft model, prompt lookup: those it has), and
    what was proposed and kept, all proposers and the prediction's."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], draft: Any = None) -> None:
        self.history = list(prompt_ids)  # prompt and output tokens
        self.prediction = PredictionProposer(list(params.prediction)) if params.prediction else None
        self.draft = DraftProposer(draft) if draft is not None else None
        self.lookup = LookupProposer(self.history, params.prompt_lookup) if params.prompt_lookup else None
        self.sources: list[Any] = [s for s in (self.prediction, self.draft, self.lookup) if s is not None]
        self.proposed = self.accepted = 0  # tokens proposed and kept, all proposers
        self.forwards = 0  # verifying forwards
        self.pred_accepted = self.pred_rejected = 0  # of those, the prediction's
        self._source: Any = None  # the proposer of the pending proposal

    def took(self, tokens: list[int]) -> None:
        """The sample's new tokens (kept proposals and the model's own)."""
        self.history += tokens
        for s in self.sources:
            s.took(self.history, tokens)

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens to verify after the sample's last token (which the history ends
        with): those of the proposer not resting with the most evidence, at most its k."""
        self._source = None
        if limit < 1:
            return []
        best: list[int] = []
        evidence = -1
        for s in [s for s in self.sources if s.pace.step()]:  # every proposer's rest counts this step
            if s is self.draft and best and evidence >= s.STRENGTH:
                continue  # the draft's forwards would not win
            got, ev = s.propose(self.history, min(s.pace.k, limit))
            if got and ev > evidence:
                best, evidence, self._source = got, ev, s
        return best

    def close(self) -> None:
        """The sample gave its pages back (it ended, or was preempted): so does its draft."""
        if self.draft is not None:
            self.draft.close()

    def verified(self, proposed: int, accepted: int) -> None:
        """A verification's outcome: the proposer's k and rest adapt; counts."""
        self.forwards += 1
        self.proposed += proposed
        self.accepted += accepted
        if self._source is self.prediction:
            self.pred_accepted += accepted
            self.pred_rejected += proposed - accepted
        if self._source is not None:
            self._source.pace.verified(proposed, accepted)


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
    return out + [draw(probs[k], gen)]


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
    return draw(rest, gen)


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
                    t, keep = draw(p, gen), False
                else:
                    judged = _judge(p, d, gen)
                    t, keep = (d, True) if judged is None else (judged, False)
            if not keep:
                return out + [t]
            assert d is not None
            out.append(d)
            if not matcher.consume_token(d):
                raise ConstraintFault(f"the constraint refused token {d}: {matcher.get_error()}")
            taken += 1
            if d in stop_ids or matcher.is_stopped():
                return out
        return out
    finally:
        if taken:
            matcher.rollback(taken)
