"""Attention where every KV head may hold other tokens in the same slot (a press evicted per
head): masks per KV head, built from the positions each slot holds, and the attention weights
handed back for the presses that score with them (H2O sums them, TOVA reads the latest).
"""

from __future__ import annotations

import torch


def press_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sinks: int) -> torch.Tensor:
    """bool [Hkv, T, L]: key slot j of head h is visible to query i when it holds a token
    (k_pos >= 0) at or before q_pos[i] and, with a window, within it or a sink.

    q_pos: [T] int64; k_pos: [Hkv, L] int64 (-1: evicted)."""
    kp = k_pos[:, None, :]  # [Hkv, 1, L]
    diff = q_pos[None, :, None] - kp  # [Hkv, T, L]
    mask = (kp >= 0) & (diff >= 0)
    if window is not None:
        near = diff < window - sinks
        if sinks:
            near |= kp < sinks
        mask &= near
    return mask


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 q_sink: torch.Tensor | None = None, n_sink: int = 0, weights: bool = False,
                 rows_per_block: int = 256, per_query: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q, q_sink: [Hq, T, D]; k, v: [Hkv, L, D]; mask: bool [Hkv, T, L]. The first ``n_sink`` keys
    are scored against ``q_sink`` (sinks turned to their cache positions) when it is given.

    Returns (out [Hq, T, D], summed [Hkv, L], last [Hq, L]): with ``weights``, the attention every
    query gave each slot summed over the queries (the query heads of each KV head averaged), and
    the latest query's weights per query head; else None, None. With ``per_query`` (a verifying
    forward, whose later queries may be refused) both are kept per query instead: summed
    [Hkv, T, L] and last [Hq, T, L]."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    outs, summed, last = [], None, None
    for a in range(0, t, rows_per_block):
        b = min(t, a + rows_per_block)
        s = torch.matmul(q[:, a:b].reshape(hkv, g * (b - a), d), k.transpose(1, 2))  # [Hkv, g T', L]
        if q_sink is not None and n_sink:
            s[:, :, :n_sink] = torch.matmul(q_sink[:, a:b].reshape(hkv, g * (b - a), d), k[:, :n_sink].transpose(1, 2))
        s = s.view(hkv, g, b - a, -1).mul_(scale).masked_fill_(~mask[:, None, a:b], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num_(0.0)  # [Hkv, g, T', L] (nothing visible: zeros)
        outs.append(torch.matmul(p.view(hkv, g * (b - a), -1), v).view(hq, b - a, d))
        if weights and per_query:  # one block: a verifying forward has a few queries
            summed, last = p.mean(1), p.reshape(hq, b - a, -1)
        elif weights:
            part = p.mean(1).sum(1)  # [Hkv, L]
            summed = part if summed is None else summed + part
            if b == t:
                last = p[:, :, -1].reshape(hq, -1)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), summed, last
