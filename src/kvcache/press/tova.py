"""TOVA: keep the tokens the latest query attends to most.

Oren et al. 2024, "Transformers are Multi-State RNNs" (arXiv 2401.06104): the score of a token is
the attention the current query gives it, averaged over every query head, so all KV heads keep
the same tokens. After the prompt it is the prompt's last token (kvpress's TOVAPress); while
generating, each new token's query scores again and the lowest go when the cache holds more than
its share. The latest token is always kept.
"""

from __future__ import annotations

import torch

from kvcache.press.base import LayerView, Press
from kvcache.press.snapkv import window_scores


class TOVAPress(Press):
    name = "tova"
    decode = True
    queries = 1
    attention = True
    latest = True
    protect_last = 1

    def score(self, view: LayerView) -> torch.Tensor:
        hkv = view.keys.shape[0]
        if view.last is not None:  # while generating: the weights this step's query gave
            return view.last.float().mean(0, keepdim=True).expand(hkv, -1)
        q, q_pos = view.obs.queries, view.obs.q_pos
        if q is None or q_pos is None:
            raise ValueError("TOVA needs the prompt's last query; none was recorded")
        w = window_scores(q[:, -1:], q_pos[-1:], view.keys, view.pos, view.scale, 1)  # [Hq, S]
        return w.mean(0, keepdim=True).expand(hkv, -1)
