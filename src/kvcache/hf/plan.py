"""Which cached positions one forward returns to HF attention, and where they lie in the pages.

HF builds each layer type's mask from ``get_mask_sizes``: the returned keys are taken to sit at
positions ``kv_offset .. kv_offset + kv_length - 1``. A group's visible keys are its window
``lo .. end - 1`` (``lo``: the first position the forward's first query may see), so they meet that
contract as they are; with attention sinks the first ``sinks`` tokens come first and are placed,
and re-rotated, just before the window (positions ``lo - sinks ..``: StreamingLLM's cache positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.cache.groups import LayerGroup
from kvcache.cache.sequence import HOLE


def visible_span(group: LayerGroup, old: int, end: int) -> tuple[int, int, int]:
    """(lo, n_sink, kv_offset) for a forward that extends ``old`` cached tokens to ``end``:
    positions ``[0, n_sink) + [lo, end)`` are returned, at mask positions from ``kv_offset``."""
    lo = group.dead_before(old)
    if group.sinks and lo > group.sinks:
        return lo, group.sinks, lo - group.sinks
    if group.sinks:
        return 0, 0, 0  # the sinks are part of the window still
    return lo, 0, lo


def mask_sizes(group: LayerGroup, old: int, query_length: int) -> tuple[int, int]:
    """(kv_length, kv_offset) as transformers' ``get_mask_sizes`` returns them."""
    lo, n_sink, offset = visible_span(group, old, old + query_length)
    return n_sink + old + query_length - lo, offset


def _span(idx: torch.Tensor) -> int | None:
    """idx[0] when ``idx`` ([n] int64) is a run start, start + 1, ..., else None."""
    if idx.numel() == 0:
        return 0
    first = int(idx[0])
    return first if torch.equal(idx, torch.arange(first, first + idx.numel())) else None


@dataclass
class ReadPlan:
    """One row's reads in one layer group during one forward."""

    positions: torch.Tensor  # [L] int64, increasing
    n_sink: int  # the first n_sink positions are sinks, re-rotated by ``shift``
    shift: int
    # float pools: slot of each position ([L] int64), or the first slot of a consecutive run
    slots: torch.Tensor | None = None
    first_slot: int | None = None
    # quantized pools: the sealed pages to dequantize ([m] int64, or a run from ``page_run``),
    # then the fp32 tail and the new tokens; ``index`` ([L] int64) picks the visible tokens from
    # that buffer, or ``index_start`` when they are a consecutive run of it
    pages: torch.Tensor | None = None
    page_run: int | None = None
    n_pages: int = 0
    index: torch.Tensor | None = None
    index_start: int | None = None


def plan_float(table: list[int], page_size: int, group: LayerGroup, old: int, end: int) -> ReadPlan:
    lo, n_sink, offset = visible_span(group, old, end)
    pos = torch.cat((torch.arange(n_sink), torch.arange(lo, end)))  # [L]
    pages = torch.tensor(table, dtype=torch.long)[pos // page_size]
    assert bool((pages != HOLE).all()), "a visible token's page was released"
    slots = pages * page_size + pos % page_size  # [L]
    first = _span(slots)
    return ReadPlan(pos, n_sink, offset if n_sink else 0, None if first is not None else slots, first)


def plan_quant(table: list[int], sealed_pages: int, page_size: int, group: LayerGroup, old: int,
               end: int) -> ReadPlan:
    """``sealed_pages``: pages the row's table held before this forward (its new pages are
    written from the fp32 tail after attention reads it, as kvcache's own forward does)."""
    lo, n_sink, offset = visible_span(group, old, end)
    pos = torch.cat((torch.arange(n_sink), torch.arange(lo, end)))  # [L]
    sealed = sealed_pages * page_size
    logical = torch.unique(pos[pos < sealed] // page_size)  # [m] pages holding visible tokens
    phys = torch.tensor(table, dtype=torch.long)[logical] if logical.numel() else logical
    assert bool((phys != HOLE).all()), "a visible token's page was released"
    rank = torch.full((max(sealed_pages, 1),), -1, dtype=torch.long)
    rank[logical] = torch.arange(logical.numel())
    in_pages = pos < sealed
    local = torch.where(in_pages, rank[(pos // page_size).clamp(max=max(sealed_pages - 1, 0))] * page_size
                        + pos % page_size, logical.numel() * page_size + pos - sealed)
    run = _span(phys)
    start = _span(local)
    return ReadPlan(pos, n_sink, offset if n_sink else 0, pages=None if run is not None else phys,
                    page_run=run, n_pages=int(logical.numel()), index=None if start is not None else local,
                    index_start=start)
