"""SnapKV: keep the tokens the last window of prompt queries attends to.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469),
as kvpress scores it: the softmax attention of the prompt's last ``window`` queries (64) over every
key they may see (causal), averaged over those queries, smoothed along the slots before the window by
an average pool of ``kernel`` (5, zero-padded at the ends), then averaged over the query heads of each KV
head. The window itself is always kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.press.base import LayerView, Press, group_mean


class SnapKVPress(Press):
    name = "snapkv"
    window = 64
    kernel = 5
    queries = window
    protect_last = window

    def score(self, view: LayerView) -> torch.Tensor:
        q, q_pos = view.obs.queries, view.obs.q_pos  # [Hq, w, D], [w]
        if q is None or q_pos is None:
            raise ValueError("SnapKV needs the prompt's last queries; none were recorded")
        hkv = view.keys.shape[0]
        return group_mean(window_scores(q, q_pos, view.keys, view.pos, view.scale, self.kernel), hkv)


def window_scores(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, scale: float,
                  kernel: int) -> torch.Tensor:
    """Attention of queries q [Hq, w, D] (at q_pos [w]) over keys [Hkv, S, D] at pos [Hkv, S]
    (-1: evicted, never seen), averaged over the queries and pooled: [Hq, S]."""
    hq, hkv = q.shape[0], keys.shape[0]
    g = hq // hkv
    s = torch.matmul(q.float().reshape(hkv, g * q.shape[1], -1), keys.float().transpose(1, 2))  # [Hkv, g w, S]
    s = s.view(hkv, g, q.shape[1], -1) * scale
    seen = (pos[:, None, None, :] >= 0) & (pos[:, None, None, :] <= q_pos[None, None, :, None])  # [Hkv,1,w,S]
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num_(0.0)
    mean = p.mean(2).reshape(hq, -1)  # [Hq, S]
    if kernel > 1:  # pooled over the slots before the window only (zeros beyond, as padding)
        before = (pos >= 0) & (pos < q_pos[0])  # [Hkv, S]
        before = before.repeat_interleave(g, 0)  # [Hq, S]
        mean = mean * before
        mean = F.avg_pool1d(mean[:, None], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0] * before
    return mean
