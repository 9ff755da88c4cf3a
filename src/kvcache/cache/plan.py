"""Read and write planning for one forward over the paged cache.

Owns what each sequence writes where and what it may read: the pages reserved for the new
tokens, the slots their K/V go to, the page tables batched for the native kernels, and per
sequence and layer group a ``ReadPlan``: the cached positions read, where they lie (slots, or the
sealed pages to dequantize) and the visibility they carry (a mask per query, sinks and how far
they turn). Two readers share it:

- the engine's ``PagedContext`` (attention/backends.py) reads every stored key and masks per
  query (``reads="stored"``);
- the transformers bridge (hf/store.py) returns the keys its first query may see, at the
  positions transformers' masks expect (``reads="window"``, ``mask_sizes``).

May not touch: K/V data and attention (attention/ computes, hf/store.py gathers); it changes the
cache only by reserving pages and advancing sequence lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvcache.cache.visibility import Mask, build_mask
from kvcache.cache.groups import LayerGroup
from kvcache.cache.paged import PagedKVCache
from kvcache.cache.sequence import HOLE, SeqKV, run_start


@dataclass
class ReadPlan:
    """The keys one sequence reads from one layer group in every layer of one forward."""

    positions: torch.Tensor  # [L] int64 cache positions, increasing
    # float pools: the slot of each position ([L] int64), or, when they are consecutive, None and
    # the first slot of the run (read as a view)
    slots: torch.Tensor | None = None
    first_slot: int | None = None
    # quantized pools: the sealed pages to dequantize ([m] int64, or the run from ``page_run``), then
    # the fp32 tail and the new tokens; ``index`` ([L] int64) picks the positions from that buffer,
    # or ``index_start`` when they are a consecutive run of it; ``new_pages`` ([k] int64) are the
    # pages this forward seals once attention has read the tail
    pages: torch.Tensor | None = None
    page_run: int | None = None
    n_pages: int = 0
    index: torch.Tensor | None = None
    index_start: int | None = None
    new_pages: torch.Tensor | None = None
    # sinks: the first n_sink positions are attention sinks
    n_sink: int = 0
    shift: int = 0  # window reads: the sinks turn by this many positions (they sit before the window)
    mask: Mask = None  # stored reads: which keys each query sees (attention/dense.py's forms)
    delta: torch.Tensor | None = None  # stored reads: [T] per query, how far its sinks turn; None: none do
    # a press: ``positions`` count slots, and when this is set attention masks each layer and KV
    # head by the token positions its slots hold (cache/retention.py), not by ``mask``
    press: bool = False


# -- what a query may see -------------------------------------------------------------------------
def visible_span(group: LayerGroup, old: int, end: int) -> tuple[int, int, int]:
    """(lo, n_sink, kv_offset) for a forward that extends ``old`` cached tokens to ``end``:
    positions ``[0, n_sink) + [lo, end)`` are what its first query may see, placed at mask
    positions from ``kv_offset`` (sinks just before the window: StreamingLLM's cache positions)."""
    lo = group.dead_before(old)
    if group.sinks and lo > group.sinks:
        return lo, group.sinks, lo - group.sinks
    if group.sinks:
        return 0, 0, 0  # the sinks are part of the window still
    return lo, 0, lo


def mask_sizes(group: LayerGroup, old: int, query_length: int) -> tuple[int, int]:
    """(kv_length, kv_offset) as transformers' ``get_mask_sizes`` returns them for window reads."""
    lo, n_sink, offset = visible_span(group, old, old + query_length)
    return n_sink + old + query_length - lo, offset


def stored_positions(table: list[int], page_size: int, length: int, sealed_pages: int) -> torch.Tensor:
    """Positions whose K/V are stored: the tokens of the live pages among the first ``sealed_pages``,
    below ``length``, then every position from there to ``length`` (a quantized group's fp32 tail
    and new tokens; nothing for float groups, whose pages all count as sealed): [L] int64."""
    idx = torch.tensor([i for i in range(sealed_pages) if table[i] != HOLE], dtype=torch.long)
    pos = (idx[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    if sealed_pages * page_size >= length:
        return pos[pos < length]
    return torch.cat((pos, torch.arange(sealed_pages * page_size, length)))


def _span(idx: torch.Tensor) -> int | None:
    """idx[0] when ``idx`` ([n] int64) is a run start, start + 1, ..., else None (0 when empty)."""
    if idx.numel() == 0:
        return 0
    first = int(idx[0])
    return first if torch.equal(idx, torch.arange(first, first + idx.numel())) else None


def _slots(table: list[int], page_size: int, pos: torch.Tensor) -> torch.Tensor:
    """Pool slots of positions ``pos`` ([L] int64) through a page table -> [L] int64."""
    pages = torch.tensor(table, dtype=torch.long)[pos // page_size]
    assert bool((pages != HOLE).all()), "a visible token's page was released"
    return pages * page_size + pos % page_size


# -- one sequence, one group ----------------------------------------------------------------------
def plan_stored(cache: PagedKVCache, seq: SeqKV, gi: int, q_pos: torch.Tensor, sealed_pages: int) -> ReadPlan:
    """Every key the group still stores for ``seq`` (now ``seq.length`` tokens, its queries at
    ``q_pos`` [T]), with the mask and sink shifts that give each query its window. With a press,
    positions are slots (``seq.held``) and ``press`` says whether attention masks by the tokens
    the slots hold."""
    g, ps, table = cache.groups[gi], cache.page_size, seq.tables[gi]
    length = seq.held(gi)
    if seq.press is not None:
        q_pos = torch.arange(length - q_pos.shape[0], length)
    if cache.quantized:
        live = [table[i] for i in range(sealed_pages) if table[i] != HOLE]
        run = run_start(live)
        pos = stored_positions(table, ps, length, sealed_pages)
        plan = ReadPlan(pos, pages=torch.tensor(live, dtype=torch.long) if run is None else None, page_run=run,
                        n_pages=len(live), index_start=0,
                        new_pages=torch.tensor(table[sealed_pages:], dtype=torch.long))
    else:
        pos = stored_positions(table, ps, length, len(table))
        first = run_start(table)  # no holes and consecutive: a view
        plan = ReadPlan(pos, first_slot=first * ps if first is not None else None,
                        slots=_slots(table, ps, pos) if first is None else None)
    plan.mask = build_mask(q_pos, pos, g.window, g.sinks)
    # attention sinks: a query at t sees the sink tokens as if they sat just before its window
    plan.n_sink = int((pos < g.sinks).sum()) if g.sinks else 0
    if plan.n_sink and g.window is not None:
        delta = (q_pos - (g.window - 1)).clamp(min=0)  # [T]
        if bool((delta > 0).any()):
            plan.delta = delta
    if seq.press is not None:
        plan.press = needs_mask(cache, seq, gi)
    return plan


def needs_mask(cache: PagedKVCache, seq: SeqKV, gi: int) -> bool:
    """Whether a press sequence's reads of group ``gi`` mask by token positions (and go through
    the press's attention): windows and sinks, slots marked evicted, and presses that score with
    the attention weights (H2O reading a prompt, decode-time presses while generating)."""
    st, g = seq.press, cache.groups[gi]
    assert st is not None
    if g.window is not None or g.sinks or st.masked(gi):
        return True
    return st.press.attention and (st.observing or st.press.decode)


def plan_window(table: list[int], page_size: int, group: LayerGroup, old: int, end: int,
                sealed_pages: int | None = None) -> ReadPlan:
    """The keys a forward extending ``old`` cached tokens to ``end`` returns to transformers: the
    first query's window (sinks first). ``sealed_pages``: quantized groups only, the pages the
    table held before this forward (its new pages are sealed from the fp32 tail after reading)."""
    lo, n_sink, offset = visible_span(group, old, end)
    pos = torch.cat((torch.arange(n_sink), torch.arange(lo, end)))  # [L]
    shift = offset if n_sink else 0
    if sealed_pages is None:
        slots = _slots(table, page_size, pos)
        first = _span(slots)
        return ReadPlan(pos, None if first is not None else slots, first, n_sink=n_sink, shift=shift)
    sealed = sealed_pages * page_size
    logical = torch.unique(pos[pos < sealed] // page_size)  # [m] pages holding visible tokens
    phys = torch.tensor(table, dtype=torch.long)[logical] if logical.numel() else logical
    assert bool((phys != HOLE).all()), "a visible token's page was released"
    rank = torch.full((max(sealed_pages, 1),), -1, dtype=torch.long)
    rank[logical] = torch.arange(logical.numel())
    in_pages = pos < sealed
    local = torch.where(in_pages, rank[(pos // page_size).clamp(max=max(sealed_pages - 1, 0))] * page_size
                        + pos % page_size, logical.numel() * page_size + pos - sealed)
    run, start = _span(phys), _span(local)
    return ReadPlan(pos, pages=None if run is not None else phys, page_run=run, n_pages=int(logical.numel()),
                    index=None if start is not None else local, index_start=start,
                    new_pages=torch.tensor(table[sealed_pages:], dtype=torch.long), n_sink=n_sink, shift=shift)


# -- one forward ----------------------------------------------------------------------------------
class ForwardPlan:
    """One forward's writes and reads. Building it reserves pages for the new tokens (all
    sequences or none) and advances each sequence's length; nothing is written.

    ``rows[i]``: sequence i's rows in the flat batch; ``reads[i][g]``: its ReadPlan in group g;
    ``write_slots[g]``: float groups, the slots of every new token in batch order ([N] int64);
    ``sealed[i][g]``: the group's table length before this forward.
    """

    def __init__(self, cache: PagedKVCache, seqs: Sequence[SeqKV], new_tokens: Sequence[int],
                 positions: torch.Tensor | None = None, reads: Literal["stored", "window"] = "stored") -> None:
        self.cache, self.seqs, self.new_tokens = cache, list(seqs), list(new_tokens)
        if positions is not None:
            start = 0
            for seq, n in zip(seqs, new_tokens):  # check everything before touching the cache
                q_pos = positions[start : start + n]
                if n and (int(q_pos[0]) != seq.length or int(q_pos[-1]) != seq.length + n - 1):
                    raise ValueError(
                        f"positions {int(q_pos[0])}..{int(q_pos[-1])} do not continue a sequence of "
                        f"{seq.length} cached tokens")
                start += n
        # every reservation before any length moves; pages the scheduler asked for are already there
        self.sealed = cache.pages.reserve_all(seqs, new_tokens)
        self.rows: list[slice] = []
        self._reads: list[list[ReadPlan]] = []
        # fp32 pools without presses: the stored reads are planned when first asked for (the fused
        # native paths read the page tables instead, and a decode step then plans nothing more);
        # nothing they are made of changes before the forward is over
        lazy = reads == "stored" and not cache.quantized and all(seq.press is None for seq in seqs)
        self._later: list[tuple[SeqKV, torch.Tensor, list[int]]] = []
        write_slots: list[list[torch.Tensor]] = [[] for _ in cache.groups]
        start = 0
        for seq, n, lens in zip(seqs, new_tokens, self.sealed):
            old = seq.length
            seq.length += n
            if seq.press is not None:
                for gi in range(len(cache.groups)):
                    seq.press.append(gi, old, n)
            if not cache.quantized:
                for gi in range(len(cache.groups)):
                    write_slots[gi].append(cache.slots(seq, gi, seq.held(gi) - n, n))
            if reads == "stored":
                q_pos = positions[start : start + n] if positions is not None else torch.arange(old, old + n)
                if lazy:
                    self._later.append((seq, q_pos, lens))
                else:
                    self._reads.append([plan_stored(cache, seq, gi, q_pos, lens[gi]) for gi in range(len(cache.groups))])
            else:
                self._reads.append([plan_window(seq.tables[g.index], cache.page_size, g, old, seq.length,
                                               lens[g.index] if cache.quantized else None) for g in cache.groups])
            self.rows.append(slice(start, start + n))
            start += n
        self.write_slots = [torch.cat(s) if len(s) > 1 else (s[0] if s else None) for s in write_slots]
        cache.pages.commit(seqs)

    @property
    def reads(self) -> list[list[ReadPlan]]:
        """``reads[i][g]``: sequence i's ReadPlan in group g (planned on first use where it can wait)."""
        if self._later:
            cache = self.cache
            self._reads = [[plan_stored(cache, seq, gi, q_pos, lens[gi]) for gi in range(len(cache.groups))]
                           for seq, q_pos, lens in self._later]
            self._later = []
        return self._reads

    def page_tables(self, group: int) -> torch.Tensor:
        """The sequences' page tables of one group, zero-padded: [B, max_pages] int64."""
        width = max(len(seq.tables[group]) for seq in self.seqs)
        t = torch.zeros(len(self.seqs), width, dtype=torch.long)
        for b, seq in enumerate(self.seqs):
            t[b, : len(seq.tables[group])] = torch.tensor(seq.tables[group], dtype=torch.long)
        return t

    def lengths(self, group: int = 0) -> torch.Tensor:
        """Each sequence's slots in a group once this forward is through (its length, without a
        press): [B] int64."""
        return torch.tensor([seq.held(group) for seq in self.seqs], dtype=torch.long)
