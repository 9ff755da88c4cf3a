"""One sequence's view of the cache: a page table per layer group and its length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvcache.press.state import PressState

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
    # a press (cache/retention.py): per group, tokens whose slots were packed away or released,
    # and the retention state (which token each slot holds); empty and None without one
    dropped: list[int] = field(default_factory=list)
    press: "PressState | None" = None
    # per group, the table lengths before pages asked for a step (PageManager.ask) that no forward
    # has used yet; None when nothing is pending
    pending: list[int] | None = None
    # the step being asked for or run verifies proposals (speculation): its new tokens after the
    # first are tentative, so a press reads them as decodes (never as a prompt to score) and a
    # quantized press seals only pages of tokens from before the step (a cut never falls in them)
    verifying: bool = False

    def held(self, group: int = 0) -> int:
        """Slots the sequence uses in a group: its length, less what a press packed away."""
        return self.length - self.dropped[group] if self.dropped else self.length

    @property
    def pages(self) -> list[int]:
        """The first group's page table (the only one for models without sliding layers)."""
        return self.tables[0]

    def first_page_if_contiguous(self, group: int = 0) -> int | None:
        """The first page when the group's page table is a run of consecutive ids (read as a view)."""
        return run_start(self.tables[group])

    def tail_len(self, group: int) -> int:
        tails = self.tails[group]
        return 0 if not tails else int(tails[0].shape[2])


def run_start(pages: list[int]) -> int | None:
    """pages[0] when ``pages`` are consecutive ids (no holes), else None."""
    if not pages or pages[0] < 0 or pages[-1] - pages[0] != len(pages) - 1:
        return None
    first = pages[0]
    return first if all(p == first + i for i, p in enumerate(pages)) else None
