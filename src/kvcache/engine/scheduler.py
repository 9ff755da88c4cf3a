"""Scheduler: continuous batching over the paged cache, and the engine's only generation loop.

Every request runs here: several prompts and the server's (through EngineLoop), and a single one
too (``engine.generate.RequestRun``: LLM.generate of one prompt, LLM.stream, chat sessions, a
scheduler of one request). Where a sample's sequence starts (prefix reuse), when the ``n`` samples
fork and when a sample ends (``Sample.take``) is decided here and nowhere else.

Every ``step`` runs one model forward over a batch of sequences of different lengths:

1. waiting requests are admitted (FIFO, or by priority) while fewer than ``max_running`` are
   served and the pool has room; each sample's sequence starts from the prefix cache, or from the
   sequence the request brought (its tokens shared with the prompt are kept; never all of them:
   the last prompt token is recomputed for its logits);
2. the batch is planned: every decoding sample feeds its last token, then samples still
   prefilling feed a chunk of their prompt, so at most ``max_batch_tokens`` tokens go into one
   forward and a long prompt never stalls the others' decoding (chunked prefill). The prompts
   share the tokens the decodes leave max-min fairly (``fair_shares``, water-filling): a prompt
   whose remainder is within the equal share goes in whole, the others split what is left
   equally. So a short chat that arrives while a long document is prefilled has its first
   token after the next step instead of after the whole document, and the document still
   advances at least every other step, however many short prompts keep coming.
   Shortest-remaining-first would give short prompts the same first step but lets a steady flow
   of them starve a long one; fixed round-robin quanta would split a short prompt that fits the
   equal share, or leave part of the budget unused. One exception keeps that first step short:
   when the split would finish some prompt, the prompts longer than a whole step
   (``max_batch_tokens``) sit that step out, never two steps in a row. A chunk deep in a long
   document costs many times a short prompt (each of its tokens attends to every token before
   it), so the newcomer waits for the step already running and for its own prompt, not for a
   document chunk as well; the document loses a short prompt's time. The budget counts work,
   not tokens (``step_work``): a prompt token at depth ``p`` costs its attention over ``p`` keys
   besides its weights, so a step deep in a document is about as long as one at its start, and
   the step a newcomer waits for is short too (while the engine is shared; a prompt alone is
   counted with a lower attention cost, ``ALONE_ATTENTION_WEIGHT``: its steps deep in the prompt
   carry more tokens and read its keys fewer times). ``document_work`` (serve --document-step-work)
   caps what a document (a prompt of more than ``DOCUMENT_STEPS`` whole steps, with more than a
   step still to feed) takes of any step while the engine is shared
   (another request running or waiting, or gone less than ``SHARED_S`` ago), so that even the
   steps that carry only a document are short: a newcomer's wait for the step already running
   shrinks with it, and the document pays in steps; a document alone takes whole steps. Under
   the priority policy each priority level shares what the higher levels leave. Chunking never
   changes a sequence's bits (batch invariance): how the budget is split decides when tokens
   come, never which;
3. the step's pages are asked of the cache's page manager (``runner.reserve``) before the forward
   runs, so attention only writes pages it was given; when the pool cannot give them (a typed
   refusal), the latest-admitted, lowest-priority request is preempted: its
   pages go to the prefix index (still reusable, evictable under pressure) and it waits again at
   its original place in the queue; resumed, it refills from the index or recomputes;
4. samples whose feed is done get their next token sampled; a request's first completed prefill
   forks its ``n`` samples (shared pages).

Each sample has a ``feed``: the tokens whose K/V must be computed before it can sample again
(the prompt after the cached prefix; then its last sampled token). A preempted sample's feed is
its prompt and generated tokens after whatever prefix is still cached.

Locking: none; one thread calls add/abort/step (EngineLoop serialises callers).
"""

from __future__ import annotations

import logging
import itertools
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcache import hugepages, kernels
from kvcache.engine import faults
from kvcache.engine.request import Request, Sample, check_prompt, error_kind
from kvcache.engine.grammar import Grammars, grammars_for
from kvcache.engine.inflight import InflightSharing
from kvcache.engine.params import MAX_LOOKUP
from kvcache.engine.runner import ModelRunner
from kvcache.engine.sampler import Row, choose, log_probs, make_generator, token_logprob
from kvcache.engine.speculate import Speculator, speculative, verify, verify_constrained, verify_rows
from kvcache.engine.step_work import ALONE_ATTENTION_WEIGHT, token_work
from kvcache.engine.stops import TextTracker
from kvcache.errors import CacheFull, InvalidParams, KVCacheError
from kvcache.models.tokenizer import Tokenizer
from kvcache.prefix.radix import common_prefix

__all__ = ["Item", "Request", "Sample", "Scheduler", "SchedulerConfig", "error_kind", "fair_shares"]
log = logging.getLogger("kvcache.engine")


@dataclass
class Item:
    """One sample's part of a step: ``n`` tokens of its feed go into the forward."""

    req: Request
    sample: Sample
    n: int

    @property
    def want(self) -> int:
        """Logits rows this item needs: one, or 1 + k when it verifies k proposed tokens."""
        return 1 + self.sample.draft if self.sample.draft and self.n == len(self.sample.feed) else 1


SPEC_MAX_DECODES = 8  # with this many decodes in a step, no sample speculates (see _plan)
# a document's steps stay capped (document_work) this long after the engine last held another
# request: chats come one after another, and the next one should not wait behind a whole step
SHARED_S = 5.0
# a prompt of more than this many whole steps (max_batch_tokens) is a document for document_work: a
# prompt of a few steps (a long chat, a retrieved passage) is never slowed by the cap
DOCUMENT_STEPS = 8


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 256  # tokens per forward: decodes first, then prefill chunks (shared fairly)
    max_running: int = 32  # requests served at once
    policy: str = "fifo"  # fifo | priority (higher first, then arrival)
    prompt_lookup: int = 0  # prompt lookup for requests that leave it None (serve --prompt-lookup; 0: off)
    # the prompts' share of max_batch_tokens counts work (step_work: a token deep in a long prompt
    # costs its attention too), so a step deep in a document is as short as one at its start;
    # False: tokens (a single run that prefills its whole prompt in one forward)
    count_work: bool = True
    # work a prompt of more than DOCUMENT_STEPS steps (a document) may take of a step while the engine
    # is shared (another request running or waiting, now or within the last SHARED_S seconds): steps
    # that carry only a document stay this short, so a newcomer waits less for the step already
    # running, at the price of the document's own speed; alone, a document takes whole steps (None:
    # never capped; serve --document-step-work, whose default is 32)
    document_work: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_running < 1:
            raise InvalidParams("max_batch_tokens and max_running must be at least 1")
        if self.document_work is not None and self.document_work < 1:
            raise InvalidParams(f"--document-step-work must be at least 1, got {self.document_work}")
        if not 0 <= self.prompt_lookup <= MAX_LOOKUP:
            raise InvalidParams(f"--prompt-lookup must be between 0 (off) and {MAX_LOOKUP}, got {self.prompt_lookup}")
        if self.policy not in ("fifo", "priority"):
            raise InvalidParams(f"unknown scheduling policy {self.policy!r}: fifo or priority")


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: SchedulerConfig | None = None,
                 grammars: Grammars | None = None) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        self.config = config or SchedulerConfig()
        self.vocab = runner.config.vocab_size
        self.grammars = grammars or grammars_for(tokenizer, self.vocab)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.eos = set(tokenizer.eos_token_ids) | set(runner.config.eos_token_ids)
        self._arrivals = itertools.count()
        self.preemptions = 0
        self.steps = 0
        self._held_back = False  # a preemption happened: admit nothing more until a request ends
        self._sat_out = False  # the last step left out the prompts longer than a whole step (_plan)
        self._shared_at = float("-inf")  # when the engine last had more than one request (_plan)
        self.sharing = InflightSharing(runner)
        # what a prompt token costs while other requests are about, and while one prompt is alone (step_work.py)
        self._work = token_work(runner.config) if self.config.count_work else (lambda position: 1.0)
        self._work_alone = (token_work(runner.config, ALONE_ATTENTION_WEIGHT) if self.config.count_work
                            else self._work)

    # -- requests --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request; a prompt that cannot fit the context is refused here."""
        check_prompt(req.prompt_ids, self.runner.capacity)
        req.arrival = next(self._arrivals)
        req.t_arrival = req.t_arrival or time.perf_counter()
        p = req.params
        p.check_vocab(self.vocab)
        matcher = self.grammars.compile(p.constraint).matcher() if p.constraint is not None else None
        first = Sample(0, TextTracker(self.tokenizer, p.stop, p.keep_special), make_generator(p, 0))
        first.start(p, req.prompt_ids, self.vocab, matcher)
        first.spec = self._speculator(req)
        req.samples = [first]
        self.waiting.append(req)

    def _speculator(self, req: Request) -> Speculator | None:
        """A sample's proposer, when its request speculates. Every cache speculates. Windows (the
        model's own sliding layers and cache windows): a step gives back only the pages dead before
        its first new token, so a refused token never costs the window a page the kept ones still
        see, and the native attention gives a windowed row the bits of one-token decoding. A press
        reads a verifying forward as decodes, never as a prompt, and a decode-time press (H2O,
        TOVA) takes in the attention of kept tokens' queries only. With sinks, a lossy encoding or
        a decode-time press the text may differ from one-token decoding (the verified tokens see
        each other at full precision, and no eviction falls between them)."""
        p = req.params
        if p.prompt_lookup is None:  # left to the scheduler's default (a request's 0 is off)
            p = replace(p, prompt_lookup=self.config.prompt_lookup)
        draft = self.runner.draft
        if not speculative(p, draft is not None):
            return None
        return Speculator(p, req.prompt_ids, draft)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give back its pages; False if it is unknown or finished."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._drop_pages(req)
                    self._held_back = False
                    for s in req.samples:
                        s.reason = s.reason or "abort"
                    req.t_end = time.perf_counter()
                    return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit, run one forward, sample; returns the requests that finished in this step.

        A failure while one request is admitted, forwarded, forked or sampled fails that request
        alone (``Request.error``, ``error_kind``); the others go on. When a forward of several
        requests fails, each request's rows run again on their own, so the one at fault is found."""
        done: list[Request] = []
        self._admit(done)
        plan = self._plan()
        masks, mask_of = self._start_masks(plan)  # computed while the forward runs
        batch, logits = self._forward(plan, done)
        mask_rows = masks.result() if masks is not None else None
        if logits is None:
            return done
        self.steps += 1
        ready: list[tuple[int, Item]] = []
        checks: list[tuple[Item, int, list[int]]] = []
        last = []
        at = 0
        for item in batch:
            at += item.want
            last.append(at - 1)
        rows_logits = logits
        if at != len(last):  # some rows verify proposals: each item's own rows, and its last for the rest
            logits = logits[last]
        for row, item in enumerate(batch):
            if item.req.error is not None:
                continue
            want = item.want
            draft = item.sample.feed[1 : 1 + item.sample.draft] if want > 1 else []
            del item.sample.feed[: item.n]
            if not item.sample.feed:
                if want > 1:
                    checks.append((item, last[row] + 1 - want, draft))
                else:
                    ready.append((row, item))
            item.sample.draft = 0
        self._sample(ready, logits, mask_rows, mask_of, done)
        for item, start, draft in checks:
            try:
                self._verify(item, rows_logits[start : start + 1 + len(draft)], draft)
            except Exception as e:
                self._fail(item.req, e, done)
        for item in batch:
            req = item.req
            if req.finished and req in self.running:
                self.running.remove(req)
                req.t_end = time.perf_counter()
                done.append(req)
                self._held_back = False
        return done

    def _start_masks(self, plan: list[Item]) -> tuple[Any, dict[int, int]]:
        """The grammar masks of the constrained samples that pick a token in this step, as a future
        (None when there are none), and each such sample's row in them (by ``id``)."""
        masked = [it.sample for it in plan
                  if it.sample.matcher is not None and it.n == len(it.sample.feed) and not it.sample.draft]
        worker = self.grammars.worker() if masked else None
        if worker is None or not worker.spare_core:
            return None, {}  # none, or checked after the choice (``_lazy``)
        return worker.start([s.matcher for s in masked]), {id(s): i for i, s in enumerate(masked)}

    def _run(self, batch: list[Item]) -> torch.Tensor:
        """The step's pages are asked for first (a refusal raises here, before any forward), then
        the forward runs over them."""
        seqs = [b.sample.seq for b in batch]
        want = [b.want for b in batch]
        refusal = self.runner.reserve(seqs, [b.n for b in batch], want)  # type: ignore[arg-type]
        if refusal is not None:
            raise refusal.error()
        return self.runner.step(seqs, [b.sample.feed[: b.n] for b in batch],  # type: ignore[arg-type]
                                prompt_end=[b.n == len(b.sample.feed) for b in batch],
                                want=want if any(w > 1 for w in want) else None)

    def _forward(self, batch: list[Item],
                 done: list[Request]) -> tuple[list[Item], torch.Tensor | None]:
        """One forward over ``batch``: the rows that ran and their logits [rows, V] (None: none ran).
        A full pool preempts (or, alone, fails) the latest request and retries; any other failure
        isolates the request at fault (see step)."""
        while batch:
            try:
                return batch, self._run(batch)
            except CacheFull as e:
                batch = self._resync(batch)
                victim = self._victim()
                if victim is None or len(self.running) == 1:
                    victim = victim or self.running[0]
                    self._fail(victim, CacheFull(f"{e}; the request needs more KV pages than the pool holds"), done)
                else:
                    self._preempt(victim)
                batch = [b for b in batch if b.req in self.running]
            except Exception as e:
                batch = self._resync(batch)
                return self._forward_each(batch, done, e)
        return [], None

    def _forward_each(self, batch: list[Item], done: list[Request],
                      error: Exception) -> tuple[list[Item], torch.Tensor | None]:
        """A forward of several requests failed with ``error``: run each request's rows alone;
        those that fail again (or the only request) fail, the rest keep their logits."""
        reqs = list(dict.fromkeys(b.req for b in batch))
        if len(reqs) == 1:
            self._fail(reqs[0], error, done)
            return [], None
        kept: list[Item] = []
        rows: list[torch.Tensor] = []
        for req in reqs:
            part = [b for b in batch if b.req is req]
            try:
                rows.append(self._run(part))
                kept += part
            except Exception as e:
                self._resync(part)
                self._fail(req, e, done)
        return kept, (torch.cat(rows) if rows else None)

    def _resync(self, batch: list[Item]) -> list[Item]:
        """After a failed forward: undo the cache's half-done step (or, when it cannot be undone,
        start the sample again from the prefix cache), recompute each sample's feed from its
        tokens, and return the batch with counts of what is still to feed."""
        out = []
        for item in batch:
            req, s, n = item.req, item.sample, item.n
            seq = s.seq
            if seq is None or req.error is not None or s.reason is not None:
                continue
            full = req.prompt_ids + s.tokens
            if not self.runner.rollback(seq) and not _kept(req, s):  # a kept one was emptied in place
                self.runner.free(seq)
                s.seq = seq = self.runner.lookup(full, req.salt)
            before = len(s.feed)
            s.feed, s.draft = full[len(seq.tokens):], 0
            n -= before - len(s.feed)
            if n > 0:
                out.append(Item(req, s, n))
        return out

    def _order(self, reqs: list[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(reqs, key=lambda r: (-r.priority, r.arrival))
        return sorted(reqs, key=lambda r: r.arrival)

    def _admit(self, done: list[Request]) -> None:
        """Admit waiting requests in order while there is room. After a preemption nothing more is
        admitted until a request ends (or nothing runs): otherwise the preempted request, whose
        pages are still cached and count as room, comes straight back and is preempted again."""
        self.waiting = self._order(self.waiting)
        if self.running and self._held_back:
            return
        self._held_back = False
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if self.running and not self._room_for(req):
                break
            self.waiting.pop(0)
            try:
                if faults.ACTIVE:
                    faults.check("admit", req.prompt_ids)
                for s in req.samples:
                    if s.reason is None:
                        self._start(req, s)
            except Exception as e:
                self._fail(req, e, done)
                continue
            if req.cached_tokens < 0:
                req.cached_tokens = len(req.samples[0].seq.tokens)  # type: ignore[union-attr]
            self.running.append(req)

    def _start(self, req: Request, s: Sample) -> None:
        """Give ``s`` its sequence and feed: the request's own sequence for its first sample (cut
        to the tokens it shares with the prompt and generated tokens, never all of them, and to
        what a window still lets a query see), else the prefix cache's longest match."""
        full = req.prompt_ids + s.tokens
        if s.index == 0 and req.seq is not None:
            seq = req.seq
            if not req.keep_seq:
                req.seq = None  # the request's own now: given back like any, never taken twice
        else:
            seq = self.runner.lookup(full, req.salt)
        keep = min(common_prefix(seq.tokens, full), len(full) - 1)
        keep = self.runner.reusable(seq, keep)
        if keep < len(seq.tokens):
            self.runner.truncate(seq, keep)
        s.seq, s.feed, s.draft, s.follow = seq, full[keep:], 0, None

    def _room_for(self, req: Request) -> bool:
        """Whether a static pool, or a dynamic one at its budget, has the pages for the request's
        first prefill (pages the prefix index could evict count as room); beyond that it waits."""
        cache = self.runner.cache
        room = cache.room(0) if cache is not None else None
        if room is None:
            return True
        need = -(-len(req.prompt_ids) // cache.page_size) + 1  # type: ignore[union-attr]
        cached = self.runner.prefix.cached_pages(0) if self.runner.prefix is not None else 0
        return cache.pages.free(0) + cached + room >= need  # type: ignore[union-attr]

    def idle(self) -> int:
        """Nothing runs: dynamic pools give back the pages beyond those in use (the prefix index's
        cached pages stay), and the heap what the last steps freed (a prefill's scratch: tens of
        MiB at 1B). Returns the pool bytes given back."""
        if self.has_work or self.runner.cache is None:
            return 0
        given = self.runner.cache.shrink()
        kernels.release_scratch()  # this thread ran the steps: their scratch goes back
        hugepages.trim()
        return given

    def _plan(self) -> list[Item]:
        """Decodes first, one token each (with their proposed tokens when they speculate and the
        step has room), then the prompts still prefilling share what is left of
        ``max_batch_tokens`` (``fair_shares``; under the priority policy a higher level's prompts
        first). When that would finish some prompt, the prompts with more than
        ``max_batch_tokens`` still to feed sit the step out (never two steps in a row), so the
        step that gives a newcomer its first token is not also a chunk of a document at depth.
        With ``SPEC_MAX_DECODES`` or more decodes in the step, nothing is proposed: the batch
        already reads each weight once for many tokens, and verifying proposals would only add
        work."""
        budget = self.config.max_batch_tokens
        if len(self.running) > 1 or self.waiting:
            self._shared_at = time.monotonic()
        batch: list[Item] = []
        decodes = [(req, s) for req in self.running for s in req.samples
                   if s.reason is None and s.tokens and len(s.feed) == 1 + s.draft]
        busy = len(decodes) >= SPEC_MAX_DECODES
        for req, s in decodes:  # decodes first
            if budget <= 0:
                break
            if s.draft and (busy or 1 + s.draft > budget):
                keep = 0 if busy else budget - 1
                del s.feed[1 + keep :]
                s.draft = keep
            batch.append(Item(req, s, len(s.feed)))
            budget -= len(s.feed)
        prefills = [(req, s) for req in self.running for s in req.samples  # in admission order
                    if s.reason is None and s.feed and not (s.tokens and len(s.feed) == 1 + s.draft)]
        prefills = self.sharing.arrange(self.running, prefills)  # a prompt another running one is computing
        chunks = self._chunks(prefills, budget)  # then prompt chunks, shared fairly
        step = self.config.max_batch_tokens
        longer = any(len(c.sample.feed) > step for c in chunks)
        if longer and not self._sat_out and any(c.n == len(c.sample.feed) for c in chunks):
            chunks = self._chunks([(r, s) for r, s in prefills if len(s.feed) <= step], budget)
            self._sat_out = True
        else:
            self._sat_out = False
        return batch + chunks

    def _chunks(self, prefills: list[tuple[Request, Sample]], budget: float) -> list[Item]:
        """The prompts' chunks: ``budget`` (work: ``step_work``, in tokens at depth 0) shared by
        ``fair_shares`` (under the priority policy each level shares what the higher levels leave,
        highest first)."""
        levels = sorted({req.priority for req, _ in prefills}, reverse=True) if self.config.policy == "priority" else [None]
        out = []
        step = self.config.max_batch_tokens
        shared = time.monotonic() - self._shared_at < SHARED_S
        cap = self.config.document_work if shared else None
        work = self._work if shared else self._work_alone
        for level in levels:
            group = [(req, s) for req, s in prefills if level is None or req.priority == level]
            cost = [work(len(s.seq.tokens) if s.seq is not None else 0) for _, s in group]
            shares = fair_shares([len(s.feed) for _, s in group], budget, cost)
            for (req, s), n, c in zip(group, shares, cost):
                if cap is not None and len(s.feed) > step and len(req.prompt_ids) > DOCUMENT_STEPS * step:  # a document
                    n = min(n, max(1, int(cap / c)))
                if n:
                    out.append(Item(req, s, n))
                    budget -= n * c
        return out

    def _sample(self, ready: list[tuple[int, Item]], logits: torch.Tensor, masks: torch.Tensor | None,
                mask_row: dict[int, int], done: list[Request]) -> None:
        """Pick the next token of every sample whose feed is done, in one batched choice: a
        request's first completed prefill forks its ``n`` samples first (shared pages, each with
        its own copy of the matcher and penalty state). A failure fails its request alone."""
        groups: list[tuple[Request, list[tuple[Sample, int, int | None]]]] = []
        for row, item in ready:
            req, s = item.req, item.sample
            try:
                m = mask_row.get(id(s))
                if m is not None:
                    _check_mask(s, masks[m])  # type: ignore[index]
                group = [(x, row, m) for x in self._fork(req, s)]
            except Exception as e:
                self._fail(req, e, done)
                continue
            if groups and groups[-1][0] is req:
                groups[-1][1].extend(group)
            else:
                groups.append((req, group))
        if not groups:
            return
        toks = self._choose_each(logits, groups, masks, done)
        self._lazy(groups, toks, logits, done)
        at = 0
        for req, group in groups:
            picked, at = toks[at : at + len(group)], at + len(group)
            if req.error is None:
                try:
                    self._took(req, group, picked, logits)
                except Exception as e:
                    self._fail(req, e, done)

    def _lazy(self, groups: list[tuple[Request, list[tuple[Sample, int, int | None]]]], toks: list[int | None],
              logits: torch.Tensor, done: list[Request]) -> None:
        """Constrained samples whose masks were not computed beside the forward (no core to spare):
        the token chosen without the mask is kept when the grammar accepts it, which is exact (a
        greedy row's argmax over the allowed tokens is the same token; a sampled row's draw, kept
        when allowed and drawn again under the mask otherwise, has the masked distribution, as in
        rejection sampling). Only the samples whose choice the grammar refuses get a mask, computed
        here, and choose again. Most steps of a model that writes the format well compute none."""
        misses: list[tuple[int, Request, tuple[Sample, int, int | None]]] = []
        at = 0
        for req, group in groups:
            for entry in group:
                x, _, m = entry
                tok = toks[at]
                if (x.matcher is not None and m is None and tok is not None and req.error is None
                        and not _allowed(x.matcher, tok, self.eos)):
                    misses.append((at, req, entry))
                at += 1
        if not misses:
            return
        masks = self.grammars.worker().compute([x.matcher for _, _, (x, _, _) in misses])
        again = []
        for k, (at, req, (x, row, _)) in enumerate(misses):
            toks[at] = None
            if req.error is None:
                try:
                    _check_mask(x, masks[k])
                    again.append((at, req, (x, row, k)))
                except Exception as e:
                    self._fail(req, e, done)
        picked = self._choose_each(logits, [(req, [entry]) for _, req, entry in again], masks, done)
        for (at, _, _), tok in zip(again, picked):
            toks[at] = tok

    def _choose_each(self, logits: torch.Tensor, groups: list[tuple[Request, list[tuple[Sample, int, int | None]]]],
                     masks: torch.Tensor | None, done: list[Request]) -> list[int | None]:
        """``_choose`` for all groups at once; when that fails, each request's group on its own, so
        that only the request at fault fails (its entries are None)."""
        try:
            return self._choose(logits, groups, masks)
        except Exception:
            toks: list[int | None] = []
            for req, group in groups:
                try:
                    toks += self._choose(logits, [(req, group)], masks)
                except Exception as e:
                    self._fail(req, e, done)
                    toks += [None] * len(group)
            return toks

    def _choose(self, logits: torch.Tensor, groups: list[tuple[Request, list[tuple[Sample, int, int | None]]]],
                masks: torch.Tensor | None) -> list[int | None]:
        rows = [Row(req.params, x.gen, len(x.tokens), x.counts, x.seen, m) for req, group in groups
                for x, _, m in group]
        at = [r for _, group in groups for _, r, _ in group]
        picked = logits if at == list(range(logits.shape[0])) else logits[at]  # every row in order: no copy
        return list(choose(picked, rows, masks, tuple(self.eos)))

    def _fork(self, req: Request, s: Sample) -> list[Sample]:
        """``s`` and, when its prompt is now in and ``n`` > 1, its new twins."""
        p = req.params
        group = [s]
        if faults.ACTIVE:
            faults.check("sample", req.prompt_ids)
        if not s.tokens and len(req.samples) == 1 and p.n > 1:  # the prompt is in: fork the samples
            if faults.ACTIVE:
                faults.check("fork", req.prompt_ids)
            for i in range(1, p.n):
                twin = Sample(i, TextTracker(self.tokenizer, p.stop, p.keep_special), make_generator(p, i))
                twin.seq = self.runner.fork(s.seq)  # type: ignore[arg-type]
                s.fork_state(twin)
                twin.spec = self._speculator(req)
                req.samples.append(twin)
                group.append(twin)
        if not req.t_first:
            req.t_first = time.perf_counter()
        return group

    def _took(self, req: Request, group: list[tuple[Sample, int, int | None]], toks: list[int | None],
              logits: torch.Tensor) -> None:
        p = req.params
        room = self.runner.capacity - len(req.prompt_ids)
        ended = []
        lps: dict[int, torch.Tensor] = {}
        for (x, row, _), tok in zip(group, toks):
            assert tok is not None
            entry = None
            if p.logprobs is not None:
                if row not in lps:
                    lps[row] = log_probs(logits[row])
                entry = token_logprob(lps[row], tok, p.logprobs or 0)
            piece = x.take(tok, entry, self.eos, p, room)
            if req.on_delta is not None and (piece or x.reason is not None):
                req.on_delta(x.delta(piece, tok, p.logprobs is not None))
            if x.reason is None:
                x.feed = [tok]
                if x.spec is not None:
                    x.spec.took([tok])
                    self._propose(req, x)
            else:
                ended.append(x)
        if ended and req.record_stats and req.finished:
            req.kv_stats = self.runner.stats()  # before the last samples' pages go back
        for x in ended:
            self._give_back(req, x)

    def _propose(self, req: Request, x: Sample) -> None:
        """Append the speculator's proposals to ``x``'s feed (its last token): at most what the
        request may still generate after the next token, and what the context still holds."""
        room = self.runner.capacity - len(req.prompt_ids) - len(x.tokens)
        limit = min(req.params.max_tokens - len(x.tokens), room) - 1
        draft = x.spec.propose(limit) if x.spec is not None and limit > 0 else []
        x.feed += draft
        x.draft = len(draft)

    def _verify(self, item: Item, logits: torch.Tensor, draft: list[int]) -> None:
        """One speculating sample after its verifying forward: keep the proposals the model agrees
        with and one token of its own (engine/speculate.py ``verify``), take them in order (a stop
        may end the sample early), and cut the cache back to what a plain decode of those tokens
        would hold, before anything else (the prefix index, a tier) sees the refused ones."""
        req, x = item.req, item.sample
        p = req.params
        if faults.ACTIVE:
            faults.check("sample", req.prompt_ids)
        rows = verify_rows(p, x.gen, len(x.tokens), x.counts, x.seen, draft)
        if x.matcher is None:
            new = verify(logits, draft, p, x.gen, rows, tuple(self.eos))
        else:
            worker = self.grammars.worker()
            new = verify_constrained(logits, draft, p, x.gen, rows, tuple(self.eos), x.matcher,
                                     lambda m: worker.compute([m]), lambda m, t: _allowed(m, t, self.eos))
        x.spec.verified(len(draft), len(new) - 1)  # type: ignore[union-attr]
        seq = x.seq
        assert seq is not None
        fed = len(seq.tokens) - (1 + len(draft))  # tokens before this step's feed
        room = self.runner.capacity - len(req.prompt_ids)
        taken = 0
        for tok in new:
            # the row after the last fed token is the logits a one-token decode would have seen
            entry = token_logprob(log_probs(logits[taken]), tok, p.logprobs or 0) if p.logprobs is not None else None
            taken += 1
            piece = x.take(tok, entry, self.eos, p, room)
            if req.on_delta is not None and (piece or x.reason is not None):
                req.on_delta(x.delta(piece, tok, p.logprobs is not None))
            if x.reason is not None:
                break
        keep = fed + taken  # a plain decode has fed every taken token but the last
        if keep < len(seq.tokens):
            self.runner.truncate(seq, keep)
        if x.reason is None:
            x.feed = [new[taken - 1]]
            x.spec.took(new[:taken])  # type: ignore[union-attr]
            self._propose(req, x)
            return
        if req.record_stats and req.finished:
            req.kv_stats = self.runner.stats()
        self._give_back(req, x)

    # -- pressure ---------------------------------------------------------------------------------
    def _victim(self) -> Request | None:
        """The running request to preempt: the latest arrival (under the priority policy, the
        lowest priority first; under FIFO a request's priority changes nothing)."""
        if len(self.running) < 2:
            return None
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (-r.priority, r.arrival))
        return max(self.running, key=lambda r: r.arrival)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_pages(req)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.append(req)
        self._held_back = True

    def _drop_pages(self, req: Request) -> None:
        for s in req.samples:
            self._give_back(req, s)
            s.feed = []

    def _give_back(self, req: Request, s: Sample) -> None:
        """The sample is done with its sequence: released (computed K/V stay reusable in the prefix
        index), or, when the caller keeps it, left holding the tokens it has computed."""
        if s.spec is not None:
            s.spec.close()
        if s.seq is None:
            return
        if _kept(req, s):
            self.runner.rollback(s.seq)  # after a failed forward: back to what its tokens say
        else:
            self.runner.release(s.seq, req.salt)
        s.seq = None

    def _fail(self, req: Request, error: Exception, done: list[Request]) -> None:
        """End ``req`` with ``error``: out of the queues, its pages back, reported as done."""
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        self._drop_pages(req)
        self._held_back = False
        req.error = str(error) if isinstance(error, KVCacheError) else f"internal error: {type(error).__name__}: {error}"
        req.error_kind = error_kind(error)
        req.exception = error
        req.t_end = time.perf_counter()
        if req.error_kind == "internal":  # the server's fault: the operator hears of it, with the request's id
            log.error("request %s failed: %s", req.request_id, req.error)
        done.append(req)


def fair_shares(remaining: list[int], budget: float, cost: list[float] | None = None) -> list[int]:
    """How many tokens each prompt feeds in a step, given the ``remaining`` tokens of each (listed
    in admission order) and the step's ``budget``: max-min fair (water-filling). A prompt whose
    remainder is within the equal share feeds it whole; what it leaves is shared equally by the
    others. What does not divide evenly goes a token each to the earliest admitted, and so does all
    of it when there is less than a token a prompt. Nothing is left over while a prompt still has
    tokens it could pay for.

    ``cost`` is each prompt's work per token (>= 1, ``step_work``; default 1: the budget counts
    tokens): a prompt deep in a long document gets as much of the step's work as a short one, so
    fewer tokens. The first prompt still feeds one token when the budget is below its cost, so
    every step advances some prompt."""
    cost = cost if cost is not None else [1.0] * len(remaining)
    give = [0] * len(remaining)
    todo = list(range(len(remaining)))
    left = float(budget)
    while todo and left > 0:
        share = left / len(todo)
        whole = [i for i in todo if remaining[i] * cost[i] <= share]
        if not whole:
            for i in todo:
                give[i] = min(remaining[i], int(share / cost[i]))
                left -= give[i] * cost[i]
            paid = True
            while paid:  # what the rounding left: a token each to the earliest, while it pays for one
                paid = False
                for i in todo:
                    if give[i] < remaining[i] and cost[i] <= left + 1e-9:
                        give[i] += 1
                        left -= cost[i]
                        paid = True
            break
        for i in whole:
            give[i] = remaining[i]
            left -= remaining[i] * cost[i]
        todo = [i for i in todo if remaining[i] * cost[i] > share]
    if budget > 0 and not any(give):
        first = next((i for i, r in enumerate(remaining) if r), None)
        if first is not None:
            give[first] = 1
    return give


def _allowed(matcher: Any, tok: int, eos: set[int]) -> bool:
    """Whether the grammar's mask would allow ``tok`` next (an end-of-sequence token: whether the text
    is complete). Where the grammar forces the next bytes, llguidance's mask keeps the canonical
    tokenization of them while its parser would take others: there a choice is allowed when it is
    the first forced token (always in the mask), and otherwise the mask decides. Elsewhere the
    parser's answer is the mask's."""
    if tok in eos:
        return bool(matcher.is_accepting())
    if matcher.compute_ff_bytes():
        forced = matcher.compute_ff_tokens()
        return bool(forced) and forced[0] == tok
    return bool(matcher.validate_tokens([tok]) == 1)


def _check_mask(s: Sample, mask: torch.Tensor) -> None:
    """A constrained sample's matcher failed (a grammar past its limits) or allows no token."""
    if s.matcher.is_error():
        raise InvalidParams(f"the constraint failed: {' '.join(str(s.matcher.get_error()).split())[:300]}")
    if not bool(mask.any()):
        raise InvalidParams("the constraint allows no token after the text so far")


def _kept(req: Request, s: Sample) -> bool:
    """Whether ``s`` runs on the sequence its request brought and the caller keeps."""
    return req.keep_seq and s.seq is not None and s.seq is req.seq
