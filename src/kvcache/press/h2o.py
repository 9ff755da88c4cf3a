"""H2O: keep the heavy hitters, the tokens that have drawn the most attention so far.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (arXiv 2306.14048): the score of a token is the attention weight every query has given it,
summed over the queries that saw it (the prompt's, then each generated token's), per KV head (the
query heads of a group averaged, as kvpress does). Rescored as generation goes: when the cache
holds more than its share, the tokens with the least accumulated attention go.
"""

from __future__ import annotations

import torch

from kvcache.press.base import LayerView, Press


class H2OPress(Press):
    name = "h2o"
    decode = True
    attention = True

    def score(self, view: LayerView) -> torch.Tensor:
        if view.acc is None:
            raise ValueError("H2O needs the attention each slot received; none was recorded")
        return view.acc.float()
