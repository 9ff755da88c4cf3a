"""The proposers of speculative decoding (engine/speculate.py's ``Speculator`` asks them each step).

Each proposer sees the sample's history (prompt and output tokens) and proposes up to k tokens to
follow it, with its evidence for them (a length in tokens: the Speculator takes the proposal with
the most); each has its own ``Pace``: an adaptive k, and a rest for one that keeps failing.
- ``PredictionProposer``: the text the caller expects (OpenAI's ``prediction``), followed from
  where the output agrees with it and realigned where it departs; evidence: the output tokens in
  a row that agree with it;
- ``DraftProposer``: a draft model's greedy tokens on its own sequence; evidence MAX_NGRAM (it
  never rests: what it costs is its own forwards);
- ``LookupProposer``: the longest recent n-gram (4 down to 2 tokens) at the end of the history
  that occurred before in the prompt or the output proposes what followed it; evidence: n. (A
  single token's match was measured to propose what the model keeps about one time in twenty:
  less than a verifying forward costs.)
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import torch

MAX_NGRAM, MIN_NGRAM = 4, 2
# a proposer refused REST_AFTER times in a row rests REST_STEPS steps; after a rest a single refusal
# rests it again, twice as long each time until a proposal is kept, at most REST_MAX steps
REST_AFTER, REST_STEPS, REST_MAX = 3, 8, 64
SEARCH_LIMIT = 8192  # the last tokens of a sequence searched for an n-gram
DEFAULT_K = 8  # proposals per forward for a prediction or a draft model
# a prediction: its first k (unproven), the tokens a verification must keep to end its refusals (a
# single token kept is as likely luck: it neither counts as refused nor ends a run of refusals), and
# the output tokens in a row that agree with it that end its rest
PRED_FIRST_K, PRED_ENOUGH, WAKE_RUN = 4, 2, 2 * MAX_NGRAM


class Pace:
    """One proposer's k and rest. k starts at ``first`` (default ``k_max``), grows by 2 after a
    fully kept proposal (at most ``k_max``) and falls to one more than what was kept otherwise.
    With ``rests``, REST_AFTER proposals in a row of which nothing is kept rest the proposer
    REST_STEPS steps; after a rest one such proposal rests it again, twice as long each time (at
    most REST_MAX), until a proposal is kept (``enough`` tokens of it or more): a proposer that
    never hits costs a few probes of one token."""

    def __init__(self, k_max: int, rests: bool = True, first: int | None = None, enough: int = 1) -> None:
        self.k_max = k_max
        self.k = min(k_max, first or k_max)
        self.rests = rests
        self.enough = enough  # tokens a verification must keep to count as kept
        self.refused = 0  # proposals in a row of which nothing was kept
        self.rest = 0  # steps left to rest
        self.pause = REST_STEPS  # the next rest's length

    def step(self) -> bool:
        """One step passes: whether the proposer may propose in it (False while it rests)."""
        if self.rest > 0:
            self.rest -= 1
            return False
        return True

    def wake(self) -> None:
        """End a rest early (the next refused proposal starts the next, longer one)."""
        self.rest = 0

    def verified(self, proposed: int, accepted: int) -> None:
        """A verification of this proposer's ``proposed`` tokens kept ``accepted`` of them."""
        self.k = min(self.k_max, self.k + 2) if accepted == proposed else max(1, accepted + 1)
        if not self.rests:
            return
        if accepted >= self.enough:
            self.refused, self.pause = 0, REST_STEPS
            return
        if accepted:  # fewer than enough: neither refused nor kept
            return
        self.refused += 1
        if self.refused >= REST_AFTER:
            self.rest, self.refused = self.pause, REST_AFTER - 1  # after it, one probe refused rests again
            self.pause = min(REST_MAX, 2 * self.pause)


class PredictionProposer:
    """A prediction's tokens from where the output follows it. Where the output departs, it is
    realigned at the first occurrence, from where the output last followed the prediction on, of
    the longest n-gram at the end of the output (4 tokens down to 1; the latest occurrence where
    none lies ahead): a prediction is read forward, as the output is written. While it rests the
    output is still followed, and a rest ends early where the output has followed the prediction
    for WAKE_RUN tokens in a row (it rejoined the text after an edit)."""

    def __init__(self, prediction: list[int], k_max: int = DEFAULT_K) -> None:
        self.tokens = prediction
        self.pace = Pace(k_max, first=PRED_FIRST_K, enough=PRED_ENOUGH)
        self.at: int | None = 0  # the next prediction token expected
        self.cursor = 0  # just after the prediction token the output last agreed with
        self.run = MAX_NGRAM  # output tokens in a row that agree with the prediction where ``at`` points
        self._grams: dict[tuple[int, ...], list[int]] | None = None  # n-gram -> the ends of its occurrences

    def propose(self, history: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the evidence for them: the output tokens in a row that agree with
        the prediction (MAX_NGRAM before the first token)."""
        if self.at is None:
            return [], 0
        return self.tokens[self.at : self.at + k], self.run

    def took(self, history: list[int], tokens: list[int]) -> None:
        """The sample's new tokens (``history`` ends with them)."""
        for t in tokens:
            if self.at is not None and self.at < len(self.tokens) and self.tokens[self.at] == t:
                self.at += 1
                self.cursor, self.run = self.at, self.run + 1
            else:
                self.at = None
        if self.at is None:
            self.at, self.run = self._realign(history)
        if self.run >= WAKE_RUN:
            self.pace.wake()

    def _realign(self, history: list[int]) -> tuple[int | None, int]:
        """Where the output's last tokens occur in the prediction, and that n-gram's length."""
        if self._grams is None:
            self._grams = {}
            for end in range(1, len(self.tokens) + 1):
                for n in range(1, min(MAX_NGRAM, end) + 1):
                    self._grams.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
        for n in range(min(MAX_NGRAM, len(history)), 0, -1):
            ends = self._grams.get(tuple(history[-n:]))
            if ends:
                i = bisect_left(ends, self.cursor)
                return ends[min(i, len(ends) - 1)], n
        return None, 0


class LookupProposer:
    """Prompt lookup over the sample's history, with an index of its n-grams kept as it grows."""

    def __init__(self, history: list[int], k_max: int) -> None:
        self.pace = Pace(k_max)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        self.indexed = 0
        self._index_upto(history, len(history) - 1)  # the last token's n-grams have no continuation yet

    def _index_upto(self, history: list[int], upto: int) -> None:
        for end in range(max(1, self.indexed + 1), upto + 1):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end - n >= 0:
                    self.index[tuple(history[end - n : end])] = end
        self.indexed = max(self.indexed, upto)

    def took(self, history: list[int], tokens: list[int]) -> None:
        # index the n-grams ending one before the end: the latest occurrence must have a continuation
        self._index_upto(history, len(history) - 1)

    def propose(self, history: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the length of the n-gram that found them."""
        h = history
        for n in range(min(MAX_NGRAM, len(h) - 1), MIN_NGRAM - 1, -1):
            end = self.index.get(tuple(h[-n:]))
            if end is not None and end < len(h) and len(h) - end <= SEARCH_LIMIT:
                return h[end : end + k], n
        return [], 0


class DraftProposer:
    """A draft model's proposals for one sample: its own sequence on the draft's runner (no prefix
    cache), brought up to the sample's history (what it holds beyond the longest common prefix is
    cut first: the proposals the target refused), then k greedy one-token steps."""

    STRENGTH = MAX_NGRAM  # beats a lookup's n-gram or a prediction just realigned; not one followed longer

    def __init__(self, runner: Any, k_max: int = DEFAULT_K) -> None:
        self.runner = runner
        self.pace = Pace(k_max, rests=False)
        self.seq: Any = None

    def took(self, history: list[int], tokens: list[int]) -> None:
        pass

    def propose(self, history: list[int], k: int) -> tuple[list[int], int]:
        """k greedy tokens of the draft, with the evidence ``STRENGTH``."""
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
        return out, self.STRENGTH

    def close(self) -> None:
        if self.seq is not None:
            self.runner.free(self.seq)
            self.seq = None
