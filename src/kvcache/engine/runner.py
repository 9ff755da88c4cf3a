"""ModelRunner: turns "feed these tokens to these sequences" into one model forward.

With a cache, only the new tokens are computed; with the ``none`` strategy the whole sequence is
recomputed every step (the baseline). Either way the runner returns the last token's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.attention.backends import PagedContext
from kvcache.attention.recompute import RecomputeContext
from kvcache.cache.pages import Refusal
from kvcache.cache.paged import CacheStats, PagedKVCache
from kvcache.cache.sequence import SeqKV
from kvcache.cache.config import CacheConfig
from kvcache.engine import faults
from kvcache.errors import ContextOverflow, InvalidParams
from kvcache.models.base import CausalLM
from kvcache.prefix.cache import PrefixCache
from kvcache.prefix.config import PrefixConfig
from kvcache.press.kvzip import KVzipPress, ReplayPrompt


UNBOUNDED = 2**62


def _replays(seq: "Seq") -> bool:
    """Whether the prompt this sequence is reading is to be replayed for its press (KVzip)."""
    st = seq.kv.press if seq.kv is not None else None
    return st is not None and st.observing and st.press.replay
WINDOW_CHUNK = 512  # prefill tokens per forward when some layers see only a window


class Seq:
    """An engine sequence: the tokens whose K/V are computed, and its cache pages if any."""

    __slots__ = ("tokens", "kv")

    def __init__(self, kv: SeqKV | None) -> None:
        self.tokens: list[int] = []
        self.kv = kv



def _verifying(seqs: Sequence[Seq], want: Sequence[int] | None) -> None:
    """Mark the sequences whose step verifies proposals (they want logits after several tokens):
    the cache reads those tokens as decodes, not a prompt (cache/sequence.py ``verifying``)."""
    for i, s in enumerate(seqs):
        if s.kv is not None:
            s.kv.verifying = want is not None and want[i] > 1

class ModelRunner:
    def __init__(self, model: CausalLM, cache_config: CacheConfig, prefix: PrefixConfig | None = None,
                 fingerprint: str = "") -> None:
        self.model = model
        self.config = model.config
        self.draft: ModelRunner | None = None  # a draft model's runner, for speculative decoding (LLM(draft_model=))
        self.cache_config = cache_config.with_capacity(model.config.max_position)
        if cache_config.press is not None and model.config.attn_softcap is not None:
            raise InvalidParams(f"press={cache_config.press} scores attention without the soft cap this model puts on "
                                f"its attention logits ({model.config.attn_softcap:g}); use a window, sinks or a "
                                "quantized encoding to save memory with it")
        if cache_config.press is not None and model.config.attn_sink_logits:
            raise InvalidParams(f"press={cache_config.press} scores attention without the learned sink logits this "
                                "model adds to every softmax; use a window, sinks or a quantized encoding to save "
                                "memory with it")
        self.cache = PagedKVCache(model.config, self.cache_config) if cache_config.uses_cache else None
        self.rotaries = [model.rotary_for_layer(i) for i in range(model.config.num_layers)]
        self.capacity = self._capacity()  # fixed for the runner's life; checked every step
        self.windowed = self.cache is not None and any(g.window is not None for g in self.cache.groups)
        # KVzip's replay request, which LLM makes from the tokenizer and hangs on the model
        self.replay: ReplayPrompt | None = getattr(model, "replay_prompt", None)
        self.prefix: PrefixCache | None = None
        if self.cache is not None and prefix is not None and prefix.enabled:
            self.prefix = PrefixCache(self.cache, prefix, fingerprint)

    def _capacity(self) -> int:
        """Most tokens one sequence can hold: the model's context, or a static cache's size.
        When every layer sees only a window and positions are rotary, generation goes on past
        the model's context (positions stay relative; sinks are moved to their cache positions)."""
        cap = self.config.max_position
        if self.cache is not None:
            if all(g.window is not None for g in self.cache.groups) and all(r is not None for r in self.rotaries):
                cap = UNBOUNDED
            per_seq = self.cache.capacity_per_sequence()
            if per_seq is not None:
                cap = min(cap, per_seq)
        return cap

    def _check_room(self, seq: Seq, n: int) -> None:
        if len(seq.tokens) + n > self.capacity:
            raise ContextOverflow(
                f"sequence of {len(seq.tokens) + n} tokens exceeds the capacity of {self.capacity} tokens")

    def reusable(self, seq: Seq, length: int) -> int:
        """How many of ``seq``'s first ``length`` tokens can be kept for the next request: all of
        them, or 0 when a window has already dropped tokens a query there would see."""
        if self.cache is None or seq.kv is None or self.cache.can_truncate(seq.kv, length):
            return length
        return 0

    def new_sequence(self) -> Seq:
        return Seq(self.cache.new_sequence() if self.cache is not None else None)

    def lookup(self, tokens: list[int], salt: str | None = None, whole: bool = False) -> Seq:
        """A sequence already holding the longest cached prefix of ``tokens`` (never all of them
        unless ``whole``: a prompt's last token is recomputed for its logits), or an empty one
        without a prefix cache."""
        if self.prefix is None:
            return self.new_sequence()
        kv, n = self.prefix.lookup(tokens, salt, whole)
        seq = Seq(kv)
        seq.tokens = list(tokens[:n])
        return seq

    def reserve(self, seqs: Sequence[Seq], counts: Sequence[int], want: Sequence[int] | None = None) -> Refusal | None:
        """Ask the cache's page manager, before a step runs, for the pages of ``counts[i]`` new
        tokens of every ``seqs[i]``: None when they are in place (the step's forward takes
        nothing more), else the typed Refusal (nothing taken). A windowed prompt chunk longer
        than a forward's chunk reserves as it goes instead (pages leave the window between
        chunks), and so does recomputation (no cache). ``want`` as in ``step``: a sequence that
        wants logits after several tokens verifies proposals."""
        if self.cache is None or any(s.kv is None for s in seqs):
            return None
        _verifying(seqs, want)
        if self.windowed and any(n > WINDOW_CHUNK for n in counts):
            return None
        got = self.cache.pages.ask([s.kv for s in seqs], counts)  # type: ignore[misc]
        return got if isinstance(got, Refusal) else None

    def _unasked(self, seq: Seq) -> None:
        """Pages asked for a step that did not run go back."""
        if self.cache is not None and seq.kv is not None:
            self.cache.pages.cancel(seq.kv)

    def release(self, seq: Seq, salt: str | None = None) -> None:
        """A finished sequence: its pages go to the prefix index (when there is one), then it is
        freed."""
        self._unasked(seq)
        if self.prefix is not None and seq.kv is not None and seq.kv.length == len(seq.tokens):
            self.prefix.release(seq.kv, seq.tokens, salt)
            seq.tokens = []
        else:
            self.free(seq)

    def fork(self, seq: Seq) -> Seq:
        child = Seq(self.cache.fork(seq.kv) if self.cache is not None and seq.kv else None)
        child.tokens = list(seq.tokens)
        return child

    @torch.inference_mode()  # a press's state holds inference tensors, changed in place
    def truncate(self, seq: Seq, length: int) -> None:
        """Keep only the first ``length`` tokens (their K/V stay cached)."""
        self._unasked(seq)
        del seq.tokens[length:]
        if self.cache is not None and seq.kv is not None:
            self.cache.truncate(seq.kv, length)

    def free(self, seq: Seq) -> None:
        self._unasked(seq)
        if self.cache is not None and seq.kv is not None:
            self.cache.free(seq.kv)
        seq.tokens = []

    @torch.inference_mode()
    def step(self, seqs: Sequence[Seq], new_tokens: Sequence[Sequence[int]],
             prompt_end: bool | Sequence[bool] = True, want: Sequence[int] | None = None) -> torch.Tensor:
        """Append ``new_tokens[i]`` to ``seqs[i]`` and return the logits after each: [B, vocab].
        ``prompt_end`` (per sequence, or for all): whether this completes what the sequence reads
        before sampling (a prompt chunked over several steps passes False until its last); a
        cache with a press scores a completed prompt then. ``want``: how many of each sequence's
        last new tokens to return logits after (speculative verification; default one each):
        [sum(want), vocab], each sequence's rows in order."""
        ends = [prompt_end] * len(seqs) if isinstance(prompt_end, bool) else list(prompt_end)
        for seq, toks, end in zip(seqs, new_tokens, ends):
            if not toks:
                raise ValueError("a step needs at least one new token per sequence")
            self._check_room(seq, len(toks))
            if end and _replays(seq):
                self._replay_chunk(len(seq.tokens) + len(toks))  # refused before the prompt is read
        verifies = want is not None and any(w != 1 for w in want)
        if not verifies:
            _verifying(seqs, None)  # a plain step, whatever an earlier ask said
        if verifies:
            assert want is not None
            if any(not 1 <= w <= len(t) for w, t in zip(want, new_tokens)) or (
                    self.windowed and any(len(t) > WINDOW_CHUNK for t in new_tokens)):
                raise ValueError("logits of several rows per sequence need as many new tokens (at most "
                                 f"{WINDOW_CHUNK} a sequence with windows)")
            _verifying(seqs, want)
            try:
                logits = self._forward(seqs, new_tokens, want=want)
            finally:
                _verifying(seqs, None)  # until the next step that verifies says so
        elif self.windowed and any(len(t) > WINDOW_CHUNK for t in new_tokens):
            logits = self._chunked(seqs, new_tokens)
        else:
            logits = self._forward(seqs, new_tokens)
        if self.cache is not None and self.cache.config.press is not None:
            for seq, end in zip(seqs, ends):
                if end and seq.kv is not None:
                    if _replays(seq):
                        self._replay(seq)
                    self.cache.end_prompt(seq.kv)
        return logits

    def _replay_chunk(self, end: int) -> int:
        """Tokens of a prompt of ``end`` tokens replayed at once (press/kvzip.py); refuses a prompt
        that leaves no room for its replay."""
        if self.replay is None:
            raise InvalidParams("press=kvzip replays the prompt and needs the model's tokenizer: load the "
                                "model with kvcache.LLM (or set ModelRunner.replay)")
        chunk = min(KVzipPress.chunk, self.capacity - end - self.replay.overhead())
        if chunk < 1:
            raise InvalidParams(f"press=kvzip needs room after the prompt to replay it: the prompt holds {end} "
                                f"of the model's {self.capacity} tokens; shorten it or choose another press")
        return chunk

    def _replay(self, seq: Seq) -> None:
        """KVzip (press/kvzip.py): the model reads a request to repeat the prompt read since the
        last compression, then that prompt, a chunk at a time; the press gathers the attention the
        replayed tokens give each slot. The replayed tokens are dropped after each chunk."""
        kv = seq.kv
        assert kv is not None and kv.press is not None and self.replay is not None
        st, end, since = kv.press, kv.length, kv.press.since
        context = seq.tokens[since:end]
        chunk = self._replay_chunk(end)
        st.start_replay()
        try:
            for a in range(0, len(context), chunk):
                b = min(len(context), a + chunk)
                st.replay = (since + a, since + b, end)
                try:
                    self._forward([seq], [self.replay.ids(context, a, b)])
                finally:
                    self.truncate(seq, end)
        finally:
            st.replay = None
        # the scores stay in acc for end_prompt, which drops them

    def _chunked(self, seqs: Sequence[Seq], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Windowed layers: a long prefill goes in chunks, so masks stay [chunk, window] and pages
        leaving the window return to the pool between chunks. All or nothing: when a chunk fails,
        the chunks before it are taken back where the window still holds what the start needs
        (otherwise they stay, and ``seq.tokens`` says how far the sequence got)."""
        starts = [len(seq.tokens) for seq in seqs]
        out = []
        try:
            for seq, toks in zip(seqs, new_tokens):
                for a in range(0, len(toks), WINDOW_CHUNK):
                    logits = self._forward([seq], [toks[a : a + WINDOW_CHUNK]])
                out.append(logits[0])
        except Exception:
            for seq, start in zip(seqs, starts):
                self.rollback(seq)
                if len(seq.tokens) > start and self.reusable(seq, start) == start:
                    self.truncate(seq, start)
            raise
        return torch.stack(out)

    @torch.inference_mode()
    def rollback(self, seq: Seq) -> bool:
        """After a failed forward: give the sequence's cache back the state its ``tokens`` describe
        (the pages the forward reserved, or the scheduler asked for, return to the pool). False when that cannot be done (a
        quantized cache may have sealed pages of some layers): the sequence is then emptied (its
        pages freed, a fresh empty cache sequence in their place)."""
        self._unasked(seq)
        if self.cache is None or seq.kv is None or seq.kv.length == len(seq.tokens):
            return True
        if self.cache.quantized:
            self.free(seq)
            seq.kv = self.cache.new_sequence()
            return False
        self.cache.truncate(seq.kv, len(seq.tokens))
        return True

    @torch.inference_mode()
    def score(self, seq: Seq, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to one sequence and return the logits after every one of them:
        [len(tokens), vocab] (for perplexity and fidelity measurements)."""
        if not tokens:
            raise ValueError("score needs at least one token")
        self._check_room(seq, len(tokens))
        logits = self._forward([seq], [tokens], all_rows=True)[-len(tokens) :]  # none: the prefix is recomputed too
        if self.cache is not None and seq.kv is not None:
            self.cache.pass_span(seq.kv)  # scored text stays whole, as generated tokens do
        return logits

    def _forward(self, seqs: Sequence[Seq], new_tokens: Sequence[Sequence[int]], all_rows: bool = False,
                 want: Sequence[int] | None = None) -> torch.Tensor:
        if self.cache is None:
            feeds = [seq.tokens + list(toks) for seq, toks in zip(seqs, new_tokens)]
            starts = [0] * len(seqs)
        else:
            feeds = [list(toks) for toks in new_tokens]
            starts = [len(seq.tokens) for seq in seqs]
        lens = [len(f) for f in feeds]
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long)  # [N]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])  # [N]
        if self.cache is None:
            ctx = RecomputeContext(lens, positions, self.config.layer_windows, self.config.attn_softcap)
        else:
            ctx = PagedContext(self.cache, [s.kv for s in seqs], lens, positions, self.rotaries)  # type: ignore[misc]
        wanted = len(lens) if want is None else sum(want)  # logits rows: each sequence's last want[i] tokens
        if all_rows or wanted == len(ids):  # every row, in order (a decode step): no gather
            rows = None
        else:
            ends = torch.tensor(lens).cumsum(0)
            rows = ends - 1 if want is None else torch.cat([torch.arange(e - w, e) for e, w in zip(ends.tolist(), want)])
        if faults.ACTIVE:
            faults.check("forward", ids.tolist())
            faults.check("stall", ids.tolist())
        logits = self.model(ids, positions, ctx, logits_rows=rows)  # [B, vocab]
        for seq, toks in zip(seqs, new_tokens):
            seq.tokens.extend(toks)
        return logits

    def save(self, seq: Seq, path: str, fingerprint: str) -> int:
        """Write ``seq``'s K/V and token ids to a file; returns its size in bytes."""
        from kvcache.cache.persist import save_sequence

        if self.cache is None or seq.kv is None:
            raise InvalidParams("the 'none' strategy keeps no cache to save; use dynamic or static")
        return save_sequence(self.cache, seq.kv, seq.tokens, path, fingerprint)

    def load(self, path: str, fingerprint: str) -> Seq:
        """A sequence holding a saved cache (see save)."""
        from kvcache.cache.persist import load_sequence

        if self.cache is None:
            raise InvalidParams("the 'none' strategy keeps no cache to load into; use dynamic or static")
        kv, tokens = load_sequence(self.cache, path, fingerprint)
        seq = Seq(kv)
        seq.tokens = tokens
        return seq

    def stats(self) -> CacheStats | None:
        return self.cache.stats() if self.cache is not None else None

    def check_integrity(self) -> None:
        if self.cache is not None:
            self.cache.check_integrity()
