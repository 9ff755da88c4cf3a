"""Expected attention: keep the tokens that future queries are expected to attend to.

NVIDIA kvpress's ExpectedAttentionPress (2025): the prompt's queries before RoPE (the first
``sinks`` positions left out) are modelled as a Gaussian with mean mu and covariance Sigma; RoPE
for the next ``future`` positions after the prompt, averaged into one matrix R, turns them into
R mu and R Sigma R^T. Under that distribution the expected attention logit of a key k is
scale * k.(R mu) + scale^2 / 2 * k^T (R Sigma R^T) k. The score is its softmax over the keys
(sinks excluded), averaged over the query heads of each KV head and multiplied by the L2 norm of
the token's value. The first ``sinks`` tokens are always kept. Question-agnostic: nothing after
the prompt enters it.
"""

from __future__ import annotations

import torch

from kvcache.press.base import LayerView, Press, group_mean


class ExpectedAttentionPress(Press):
    name = "expected"
    moments = True
    future = 512  # positions after the prompt whose RoPE is averaged
    sinks = 4  # leading positions left out of the statistics and always kept
    protect_first = sinks

    def score(self, view: LayerView) -> torch.Tensor:
        mu, cov = view.obs.mean_cov()  # [Hq, D], [Hq, D, D]
        r = mean_rotation(view.rotary, view.length, self.future, mu.shape[1])  # [D, D]
        mu = mu @ r.T
        cov = r @ cov @ r.T
        hkv, hq = view.keys.shape[0], mu.shape[0]
        g = hq // hkv
        k = view.keys.float().repeat_interleave(g, 0)  # [Hq, S, D]
        logits = (k @ mu[:, :, None])[..., 0] * view.scale  # [Hq, S]
        logits += torch.einsum("hsi,hij,hsj->hs", k, cov, k) * (view.scale ** 2 / 2)
        counted = ((view.pos >= self.sinks)).repeat_interleave(g, 0)  # [Hq, S]
        p = torch.softmax(logits.masked_fill(~counted, float("-inf")), -1).nan_to_num_(0.0)
        return group_mean(p, hkv) * view.values.float().norm(dim=-1)  # [Hkv, S]


def mean_rotation(rotary: object | None, start: int, n: int, dim: int) -> torch.Tensor:
    """The RoPE matrices of positions start .. start + n - 1 averaged: [D, D] (identity without
    RoPE). Column j is the mean of the rotated j-th basis vector."""
    if rotary is None:
        return torch.eye(dim)
    from kvcache.kernels.rotary import apply_rotary

    cos, sin = rotary.tables(torch.arange(start, start + n))  # type: ignore[attr-defined]  # [n, 1, R]
    basis = torch.eye(dim).expand(n, dim, dim)  # [n, j, D]: row j is e_j
    rotated = apply_rotary(basis, cos, sin)  # [n, j, D]: R_p e_j
    return rotated.mean(0).T  # [D, D]: column j = mean_p R_p e_j
