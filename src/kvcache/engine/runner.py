"""ModelRunner: turns "feed these tokens to these sequences" into one model forward.

With a cache, only the new tokens are computed; with the ``none`` strategy the whole sequence is
recomputed every step (the baseline). Either way the runner returns the last token's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.attention.context import RecomputeContext
from kvcache.cache.context import PagedContext
from kvcache.cache.paged import CacheStats, PagedKVCache
from kvcache.cache.sequence import SeqKV
from kvcache.config import CacheConfig
from kvcache.errors import ContextOverflow
from kvcache.models.base import CausalLM


class Seq:
    """An engine sequence: the tokens whose K/V are computed, and its cache pages if any."""

    __slots__ = ("tokens", "kv")

    def __init__(self, kv: SeqKV | None) -> None:
        self.tokens: list[int] = []
        self.kv = kv


class ModelRunner:
    def __init__(self, model: CausalLM, cache_config: CacheConfig) -> None:
        self.model = model
        self.config = model.config
        self.cache_config = cache_config.with_capacity(model.config.max_position)
        self.cache = PagedKVCache(model.config, self.cache_config) if cache_config.uses_cache else None

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold: the model's context, or a static cache's size."""
        cap = self.config.max_position
        if self.cache is not None and self.cache.capacity_per_sequence() is not None:
            cap = min(cap, self.cache.capacity_per_sequence())  # type: ignore[type-var]
        return cap

    def new_sequence(self) -> Seq:
        return Seq(self.cache.new_sequence() if self.cache is not None else None)

    def fork(self, seq: Seq) -> Seq:
        child = Seq(self.cache.fork(seq.kv) if self.cache is not None and seq.kv else None)
        child.tokens = list(seq.tokens)
        return child

    def truncate(self, seq: Seq, length: int) -> None:
        """Keep only the first ``length`` tokens (their K/V stay cached)."""
        del seq.tokens[length:]
        if self.cache is not None and seq.kv is not None:
            self.cache.truncate(seq.kv, length)

    def free(self, seq: Seq) -> None:
        if self.cache is not None and seq.kv is not None:
            self.cache.free(seq.kv)
        seq.tokens = []

    @torch.inference_mode()
    def step(self, seqs: Sequence[Seq], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``new_tokens[i]`` to ``seqs[i]`` and return the logits after each: [B, vocab]."""
        for seq, toks in zip(seqs, new_tokens):
            if not toks:
                raise ValueError("a step needs at least one new token per sequence")
            if len(seq.tokens) + len(toks) > self.capacity:
                raise ContextOverflow(
                    f"sequence of {len(seq.tokens) + len(toks)} tokens exceeds the capacity of "
                    f"{self.capacity} tokens"
                )
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
            ctx = RecomputeContext(lens, positions, self.config.layer_windows)
        else:
            ctx = PagedContext(self.cache, [s.kv for s in seqs], lens, positions)  # type: ignore[misc]
        rows = torch.tensor(lens).cumsum(0) - 1  # [B] last token of each sequence
        logits = self.model(ids, positions, ctx, logits_rows=rows)  # [B, vocab]
        for seq, toks in zip(seqs, new_tokens):
            seq.tokens.extend(toks)
        return logits

    def stats(self) -> CacheStats | None:
        return self.cache.stats() if self.cache is not None else None

    def check_integrity(self) -> None:
        if self.cache is not None:
            self.cache.check_integrity()
