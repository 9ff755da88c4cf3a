"""Visibility: which cached keys a query may see (causal order, sliding windows, attention sinks),
as the masks the attention code takes.

The cache's visibility axis (``window``, ``sinks``; per layer group) decides what a sequence keeps;
these masks say, per query, which of the kept keys it reads. cache/plan.py builds them for every
forward; attention/ only applies them.
"""

from __future__ import annotations

from typing import Literal, Union

import torch

# None: every key visible; "causal": square causal mask with equal positions; else a bool [T, L]
Mask = Union[None, Literal["causal"], torch.Tensor]


def visibility_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sinks: int = 0
) -> torch.Tensor:
    """Boolean mask [T, L]: key j is visible to query i when k_pos[j] <= q_pos[i] and, with a
    window, q_pos[i] - k_pos[j] < window - sinks (HF's sliding-window convention when sinks is
    0) or k_pos[j] < sinks (attention sinks: the window counts them).

    q_pos: [T] int64, k_pos: [L] int64.
    """
    diff = q_pos[:, None] - k_pos[None, :]  # [T, L]
    mask = diff >= 0
    if window is not None:
        near = diff < window - sinks
        if sinks:
            near |= (k_pos < sinks)[None, :]
        mask &= near
    return mask


def build_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sinks: int = 0) -> Mask:
    """The cheapest mask that is equivalent to visibility_mask (q_pos: [T], k_pos: [L])."""
    t, L = q_pos.shape[0], k_pos.shape[0]
    if L == 0:
        raise ValueError("attention over no keys")
    if t == 1 and window is None and int(k_pos[-1]) <= int(q_pos[0]):
        return None  # decode with every key in view (keys are in position order)
    if window is None and t == L and torch.equal(q_pos, k_pos):
        return "causal"
    mask = visibility_mask(q_pos, k_pos, window, sinks)
    return None if bool(mask.all()) else mask
