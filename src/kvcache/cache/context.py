"""PagedContext: one forward's view of the paged cache (writes new K/V, reads each sequence's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.attention.dense import Mask, attend, build_mask
from kvcache.cache.paged import PagedKVCache
from kvcache.cache.sequence import SeqKV


class _SeqPlan:
    """What one sequence needs in every layer of this forward (computed once per forward)."""

    __slots__ = ("rows", "length", "first_page", "slots", "q_pos", "k_pos", "masks")

    def __init__(self, rows: slice, seq: SeqKV, q_pos: torch.Tensor, page_size: int) -> None:
        self.rows = rows
        self.length = seq.length
        self.first_page = seq.first_page_if_contiguous()
        self.slots: torch.Tensor | None = None
        if self.first_page is None:
            idx = torch.arange(seq.length)
            pages = torch.tensor(seq.pages, dtype=torch.long)
            self.slots = pages[idx // page_size] * page_size + idx % page_size  # [L]
        self.q_pos = q_pos  # [T]
        self.k_pos = torch.arange(seq.length)  # [L]: slot i holds position i
        self.masks: dict[int | None, Mask] = {}

    def mask(self, window: int | None) -> Mask:
        if window not in self.masks:
            self.masks[window] = build_mask(self.q_pos, self.k_pos, window)
        return self.masks[window]


class PagedContext:
    """Attention context over a PagedKVCache for a flat batch of sequences.

    Building it reserves pages for the new tokens and advances each sequence's length; the
    forward that uses it then writes those tokens' K/V in every layer.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        seqs: Sequence[SeqKV],
        new_tokens: Sequence[int],
        positions: torch.Tensor,  # [N] int64
    ) -> None:
        self.cache = cache
        self.windows = cache.model.layer_windows
        ps = cache.config.page_size
        start = 0
        for seq, n in zip(seqs, new_tokens):  # check everything before touching the cache
            q_pos = positions[start : start + n]
            if n and (int(q_pos[0]) != seq.length or int(q_pos[-1]) != seq.length + n - 1):
                raise ValueError(
                    f"positions {int(q_pos[0])}..{int(q_pos[-1])} do not continue a sequence of "
                    f"{seq.length} cached tokens"
                )
            start += n
        try:
            for seq, n in zip(seqs, new_tokens):
                cache.reserve(seq, n)  # all reservations before any length moves
        except Exception:
            for seq in seqs:  # give back what was reserved: nothing leaks on overflow
                cache.truncate(seq, seq.length)
            raise
        slots: list[torch.Tensor] = []
        self.plans: list[_SeqPlan] = []
        start = 0
        for seq, n in zip(seqs, new_tokens):
            q_pos = positions[start : start + n]
            idx = torch.arange(seq.length, seq.length + n)
            pages = torch.tensor(seq.pages, dtype=torch.long)
            slots.append(pages[idx // ps] * ps + idx % ps)
            seq.length += n
            self.plans.append(_SeqPlan(slice(start, start + n), seq, q_pos, ps))
            start += n
        self.write_slots = torch.cat(slots) if len(slots) > 1 else slots[0]  # [N]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]."""
        pool = self.cache.pool
        pool.write(layer, self.write_slots, k, v)
        window = self.windows[layer]
        outs = []
        for plan in self.plans:
            kk, vv = pool.read(layer, plan.first_page, plan.slots, plan.length)  # [Hkv, L, D]
            qq = q if len(self.plans) == 1 else q[plan.rows]
            o = attend(qq.transpose(0, 1), kk, vv, plan.mask(window), scale)  # [Hq, T, D]
            outs.append(o.transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
