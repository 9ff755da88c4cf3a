"""One sequence's view of the cache: its page table and how many tokens it holds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqKV:
    seq_id: int
    pages: list[int] = field(default_factory=list)  # page table: logical page i -> pool page
    length: int = 0  # tokens whose K/V are stored; slot i holds the token at position i

    def first_page_if_contiguous(self) -> int | None:
        """The first page when the page table is a run of consecutive ids (read as a view)."""
        if not self.pages:
            return None
        first = self.pages[0]
        if self.pages[-1] - first == len(self.pages) - 1 and all(
            p == first + i for i, p in enumerate(self.pages)
        ):
            return first
        return None
