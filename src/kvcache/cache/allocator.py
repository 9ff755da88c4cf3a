"""Tensor-free page allocator: a free list and reference counts.

Plain Python, no tensors, so it is unit-tested without a model. Pages are handed out lowest id
first, so a lone growing sequence gets consecutive pages and its K/V can be read as a view.

Locking: none; the engine calls it from one thread.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvcache.errors import CacheFull


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self._free: list[int] = list(range(num_pages))  # a heap
        self._ref: list[int] = [0] * num_pages

    @property
    def total(self) -> int:
        return len(self._ref)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_referenced(self) -> int:
        return self.total - self.num_free

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def grow(self, extra: int) -> None:
        """Add ``extra`` new free pages (ids continue after the current last one)."""
        start = self.total
        self._ref.extend([0] * extra)
        for p in range(start, start + extra):
            heapq.heappush(self._free, p)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (lowest ids first), each with ref count 1."""
        if n > len(self._free):
            raise CacheFull(
                f"KV cache is full: need {n} more pages, {len(self._free)} free of {self.total}"
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._ref[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._ref[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page whose count reaches 0 is free again."""
        for p in pages:
            if self._ref[p] <= 0:
                raise RuntimeError(f"release of free page {p}")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                heapq.heappush(self._free, p)

    def compact(self, keep: int) -> dict[int, int]:
        """Move every referenced page at or above ``keep`` to a free page below it (lowest first),
        counts and all; returns the moves (old -> new). The caller copies the data and updates the
        holders. Needs ``keep`` >= the referenced pages."""
        high = [p for p in range(keep, self.total) if self._ref[p] > 0]
        low = sorted(p for p in self._free if p < keep)[: len(high)]
        if len(low) < len(high):
            raise ValueError(f"cannot compact {self.num_referenced} referenced pages below {keep}")
        moves = dict(zip(high, low))
        for src, dst in moves.items():
            self._ref[dst], self._ref[src] = self._ref[src], 0
        taken = set(low)
        self._free = [p for p in self._free if p not in taken] + high
        heapq.heapify(self._free)
        return moves

    def truncate(self, keep: int) -> None:
        """Forget pages ``keep`` and above (they must all be free)."""
        if any(r > 0 for r in self._ref[keep:]):
            raise ValueError(f"pages at or above {keep} are still referenced")
        del self._ref[keep:]
        self._free = [p for p in self._free if p < keep]
        heapq.heapify(self._free)

    def check_integrity(self) -> None:
        """Every page is free (ref 0, on the free list once) or referenced (ref > 0)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        zero = {p for p, r in enumerate(self._ref) if r == 0}
        if free != zero:
            raise AssertionError(
                f"free list and ref counts disagree: {sorted(free ^ zero)[:8]} ..."
            )
        if any(r < 0 for r in self._ref):
            raise AssertionError("negative ref count")
        if len(free) + sum(1 for r in self._ref if r > 0) != self.total:
            raise AssertionError("free + referenced != total")
