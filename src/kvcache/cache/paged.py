"""PagedKVCache: pool + allocator + page tables, for the dynamic and static strategies."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kvcache.cache.allocator import PageAllocator
from kvcache.cache.pool import PagePool
from kvcache.cache.sequence import SeqKV
from kvcache.config import CacheConfig
from kvcache.errors import ContextOverflow
from kvcache.models.config import ModelConfig


@dataclass(frozen=True)
class CacheStats:
    strategy: str
    page_size: int
    bytes_per_token: int
    pages_total: int
    pages_used: int
    tokens_stored: int
    bytes_allocated: int
    bytes_used: int  # tokens_stored * bytes_per_token
    per_layer_bytes_allocated: tuple[int, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class PagedKVCache:
    """K/V of many sequences in one page pool.

    dynamic: starts with room for ``initial_tokens`` and doubles the pool when it runs out.
    static: room for ``max_seqs`` x ``max_tokens`` preallocated; a sequence longer than
    ``max_tokens`` is refused (ContextOverflow) before anything is written.
    """

    def __init__(
        self,
        model: ModelConfig,
        config: CacheConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not config.uses_cache:
            raise ValueError("PagedKVCache needs a caching strategy, not 'none'")
        config = config.with_capacity(model.max_position)
        self.model = model
        self.config = config
        ps = config.page_size
        if config.strategy == "static":
            assert config.max_tokens is not None
            pages = config.max_seqs * -(-config.max_tokens // ps)
        else:
            pages = -(-config.initial_tokens // ps)
        self.pool = PagePool(model.num_layers, model.num_kv_heads, model.head_dim, ps, pages, dtype, device)
        self.allocator = PageAllocator(pages)
        self._ids = itertools.count()
        self.sequences: dict[int, SeqKV] = {}

    # -- sequences ---------------------------------------------------------------------------
    def new_sequence(self) -> SeqKV:
        seq = SeqKV(next(self._ids))
        self.sequences[seq.seq_id] = seq
        return seq

    def capacity_per_sequence(self) -> int | None:
        return self.config.max_tokens if self.config.strategy == "static" else None

    def reserve(self, seq: SeqKV, new_tokens: int) -> None:
        """Make sure ``seq`` has pages for ``new_tokens`` more tokens."""
        total = seq.length + new_tokens
        cap = self.capacity_per_sequence()
        if cap is not None and total > cap:
            raise ContextOverflow(
                f"sequence of {total} tokens exceeds the static cache capacity of {cap} tokens "
                "(raise it with --kv static,max_tokens=N)"
            )
        need = -(-total // self.config.page_size) - len(seq.pages)
        if need <= 0:
            return
        seq.pages.extend(self._take_pages(need))

    def fork(self, seq: SeqKV) -> SeqKV:
        """A new sequence with the same tokens: full pages are shared (ref + 1); a partly filled
        last page is copied, since the branches will write into it."""
        child = self.new_sequence()
        ps = self.config.page_size
        full = seq.length // ps
        shared = seq.pages[:full]
        self.allocator.incref(shared)
        child.pages = list(shared)
        child.length = full * ps
        rest = seq.length - child.length
        if rest:
            self.reserve(child, rest)
            self.pool.copy_page(seq.pages[full], child.pages[-1])
            child.length = seq.length
        return child

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Forget tokens from ``length`` on; pages no longer needed go back to the pool."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate a sequence of {seq.length} tokens to {length}")
        keep = -(-length // self.config.page_size)
        last_shared = keep and self.allocator.refcount(seq.pages[keep - 1]) > 1
        if last_shared and length % self.config.page_size:
            # the kept partial page is shared: give this sequence its own copy before writing
            old = seq.pages[keep - 1]
            (new,) = self._take_pages(1)
            self.pool.copy_page(old, new)
            self.allocator.release([old])
            seq.pages[keep - 1] = new
        self.allocator.release(seq.pages[keep:])
        del seq.pages[keep:]
        seq.length = length

    def _take_pages(self, n: int) -> list[int]:
        """Allocate ``n`` pages; a dynamic pool at least doubles when it runs out."""
        if n > self.allocator.num_free and self.config.strategy == "dynamic":
            extra = max(self.allocator.total, n - self.allocator.num_free)
            self.pool.resize(self.pool.num_pages + extra)
            self.allocator.grow(extra)
        return self.allocator.allocate(n)

    def free(self, seq: SeqKV) -> None:
        self.allocator.release(seq.pages)
        seq.pages = []
        seq.length = 0
        self.sequences.pop(seq.seq_id, None)

    # -- accounting ----------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        bpt = self.pool.page_bytes // self.config.page_size
        tokens = sum(s.length for s in self.sequences.values())
        per_layer = self.pool.nbytes // self.model.num_layers
        return CacheStats(
            strategy=self.config.strategy,
            page_size=self.config.page_size,
            bytes_per_token=bpt,
            pages_total=self.allocator.total,
            pages_used=self.allocator.num_referenced,
            tokens_stored=tokens,
            bytes_allocated=self.pool.nbytes,
            bytes_used=tokens * bpt,
            per_layer_bytes_allocated=(per_layer,) * self.model.num_layers,
        )

    def check_integrity(self) -> None:
        """Page accounting: allocator consistent, and every referenced page's count equals the
        number of sequences whose page table holds it."""
        self.allocator.check_integrity()
        counts: dict[int, int] = {}
        for s in self.sequences.values():
            if len(s.pages) != -(-s.length // self.config.page_size):
                raise AssertionError(f"sequence {s.seq_id}: {len(s.pages)} pages for {s.length} tokens")
            for p in s.pages:
                counts[p] = counts.get(p, 0) + 1
        for p in range(self.allocator.total):
            if self.allocator.refcount(p) != counts.get(p, 0):
                raise AssertionError(
                    f"page {p}: ref count {self.allocator.refcount(p)} but {counts.get(p, 0)} holders"
                )
