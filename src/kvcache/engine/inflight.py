"""Prompts that share their start with a sequence running now take its K/V instead of computing it.

The prefix index holds the pages of requests that ended; a request that arrives while another with
the same long start (a system prompt, tool declarations, a few-shot preamble) is still prefilling or
decoding would otherwise compute that start again. Several such requests arriving together (a batch,
an agent's parallel calls) would each compute all of it. Here, once per sample, at its first step:

- a *donor* is a sample of another running request with the same tenant salt whose tokens share at
  least one whole page more with the sample's prompt than the sample already holds (from the index);
  the earliest-admitted such sample with the longest shared start is chosen (a sample admitted later
  is a donor only once it holds the shared pages: two new prompts never wait for each other);
- when the donor already holds the shared pages, the sample forks the donor's sequence, cut back to
  the shared whole pages (``ModelRunner.fork``/``truncate``: pages are shared, a page written into
  later is copied first), and feeds only the rest of its prompt;
- while the donor is still computing them, the sample sits out the step (its prompt gets no share of
  the budget) and takes them when they are there; if the donor goes away first (finished, preempted,
  failed, aborted), the sample computes its prompt itself.
The tokens taken count as prefix hits (``PrefixStats.hit_tokens``, and ``running_tokens`` of them)
and in the request's ``cached_tokens``.

A prompt's K/V at a position depend only on the tokens before it, however they were chunked, so a
sample's bits are those it would compute itself (as with any prefix-cache hit). Nothing is shared
without the prefix cache (``prefix=False``: every request computes its own prompt), across salts,
with a press (a pressed prompt's pages are not the uncompressed prompt's), or into a sequence the
caller keeps (a session's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.prefix.radix import common_prefix

if TYPE_CHECKING:
    from kvcache.engine.request import Request, Sample
    from kvcache.engine.runner import ModelRunner

NO_DONOR = False  # Sample.follow: decided, nothing to take


class InflightSharing:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        cache = runner.cache
        self.on = runner.prefix is not None and cache is not None and cache.config.press is None
        self.page = cache.page_size if cache is not None else 0

    def arrange(self, running: list[Request],
                prefills: list[tuple[Request, Sample]]) -> list[tuple[Request, Sample]]:
        """The prefills that feed in this step: those that took a donor's pages now feed the rest
        of their prompt; those whose donor is still computing the shared pages are left out."""
        if not self.on or all(s.follow is NO_DONOR for _, s in prefills):
            return prefills
        order = [(req, x) for req in running for x in req.samples if x.reason is None and x.seq is not None]
        out = []
        for req, s in prefills:
            if s.follow is None:
                s.follow = self._donor(req, s, order) if not (s.tokens or req.keep_seq) else NO_DONOR
            if s.follow is not NO_DONOR and not self._take(req, s, running):
                continue  # waits for its donor this step
            out.append((req, s))
        return out

    def _donor(self, req: Request, s: Sample, order: list[tuple[Request, Sample]]) -> object:
        """(donor sample, shared whole-page tokens) or NO_DONOR."""
        ps = self.page
        prompt = req.prompt_ids
        held = len(s.seq.tokens)  # type: ignore[union-attr]
        if len(prompt) - 1 < held + ps:
            return NO_DONOR
        best, best_n, earlier = None, held + ps - 1, True
        for other_req, x in order:
            if x is s:
                earlier = False  # later samples are donors only for the pages they already hold
                continue
            if other_req is req or other_req.salt != req.salt or (x.follow not in (None, NO_DONOR)):
                continue
            theirs = other_req.prompt_ids
            if theirs[:ps] != prompt[:ps]:
                continue
            n = common_prefix(prompt, theirs)
            if n == len(theirs) and x.tokens:  # their output may go on matching the prompt
                n += common_prefix(prompt[n:], x.tokens)
            n = min(n, len(prompt) - 1) // ps * ps
            if not earlier:
                n = min(n, len(x.seq.tokens) // ps * ps)  # type: ignore[union-attr]
            if n > best_n:
                best, best_n = x, n
        return (best, best_n) if best is not None else NO_DONOR

    def _take(self, req: Request, s: Sample, running: list[Request]) -> bool:
        """Whether ``s`` feeds in this step: it took its donor's pages, or stopped waiting."""
        donor, n = s.follow  # type: ignore[misc]
        alive = donor.reason is None and donor.seq is not None and any(x is donor for r in running for x in r.samples)
        if alive and len(donor.seq.tokens) < n:
            return False
        s.follow = NO_DONOR
        runner, seq = self.runner, s.seq
        full = req.prompt_ids  # a follower has no tokens of its own yet (arrange)
        held = len(seq.tokens)  # type: ignore[union-attr]
        if not alive:  # gone before the pages were there (preempted, failed, aborted)
            return True
        new = runner.fork(donor.seq)
        keep = runner.reusable(new, min(n, common_prefix(new.tokens, full)))
        if keep <= held:
            runner.free(new)
            return True
        runner.truncate(new, keep)
        runner.free(seq)  # type: ignore[arg-type]
        s.seq, s.feed = new, full[keep:]
        if runner.prefix is not None:
            runner.prefix.stats_.hit_tokens += keep - held
            runner.prefix.stats_.running_tokens += keep - held
        if s.index == 0:
            req.cached_tokens = max(req.cached_tokens, keep)
        return True
