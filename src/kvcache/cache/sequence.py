"""One sequence's view of the cache: a page table per layer group and its length."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HOLE = -1  # a page table entry whose page went back to the pool (out of the window)


@dataclass
class SeqKV:
    seq_id: int
    # per layer group: logical page i (positions i*ps .. i*ps+ps-1) -> pool page, or HOLE
    tables: list[list[int]] = field(default_factory=list)
    length: int = 0  # tokens whose K/V were stored; position i is the sequence's i-th token
    # quantized groups: per group, per layer of the group, the fp32 K/V of the tokens after the
    # last full page ([2, Hkv, t, D]); None for float groups
    tails: list[list[torch.Tensor] | None] = field(default_factory=list)

    @property
    def pages(self) -> list[int]:
        """The first group's page table (the only one for models without sliding layers)."""
        return self.tables[0]

    def first_page_if_contiguous(self, group: int = 0) -> int | None:
        """The first page when the group's page table is a run of consecutive ids (read as a view)."""
        table = self.tables[group]
        if not table:
            return None
        first = table[0]
        if first < 0 or table[-1] - first != len(table) - 1:
            return None
        if all(p == first + i for i, p in enumerate(table)):
            return first
        return None

    def tail_len(self, group: int) -> int:
        tails = self.tails[group]
        return 0 if not tails else int(tails[0].shape[2])
