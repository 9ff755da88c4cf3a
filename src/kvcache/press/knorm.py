"""KNorm: keep the tokens whose keys have the smallest L2 norm.

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(arXiv 2406.11430): keys with a low norm draw high attention, so the score is minus the key's L2
norm, per KV head (RoPE keeps norms, so rotated keys score the same). Question-agnostic: the
score of a token depends on nothing after it.
"""

from __future__ import annotations

import torch

from kvcache.press.base import LayerView, Press


class KNormPress(Press):
    name = "knorm"

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)  # [Hkv, S]
