"""Dense reference attention with grouped-query heads, explicit positions and sliding windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask [T, L]: key j is visible to query i when k_pos[j] <= q_pos[i] and, with a
    window, q_pos[i] - k_pos[j] < window (HF's sliding-window convention).

    q_pos: [T] int64, k_pos: [L] int64.
    """
    diff = q_pos[:, None] - k_pos[None, :]  # [T, L]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def attend_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of T queries over L keys of one sequence.

    q: [Hq, T, D]; k, v: [Hkv, L, D] (Hq a multiple of Hkv); q_pos: [T]; k_pos: [L].
    Returns [Hq, T, D].
    """
    hq, t, d = q.shape
    hkv, L, _ = k.shape
    g = hq // hkv
    # Decode fast path: one query that sees every key needs no mask.
    needs_mask = t > 1 or window is not None
    if needs_mask:
        mask = visibility_mask(q_pos, k_pos, window)
        if bool(mask.all()):
            needs_mask = False
    if g > 1 and t == 1:
        # Fold the query heads of one KV head into the query axis: no K/V repeat.
        qg = q.reshape(hkv, g, d)  # [Hkv, g, D]
        out = F.scaled_dot_product_attention(qg, k, v, scale=scale)  # [Hkv, g, D]
        return out.reshape(hq, 1, d)
    if not needs_mask:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=g > 1)
    if t == L and window is None and bool((q_pos == k_pos).all()):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=g > 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)
