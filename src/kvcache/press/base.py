"""What every press shares: the view of one layer it scores, and the choice of what to evict.

A press scores the tokens one layer of one sequence holds; higher scores are kept. Scores are per
KV head ([Hkv, S]), as kvpress's ScorerPress has them: each KV head keeps its own tokens (the same
number in every head), the query heads of a GQA group being averaged into their KV head. TOVA's
score is the same in every head (its paper averages every query head), so it keeps the same tokens
everywhere.

Slots: the cache hands a press every slot a layer holds, in slot order ([Hkv, S]); ``pos`` says
which token (its position) sits in each slot, -1 where one was already evicted. Positions are what
RoPE turned the keys by; evicting never renumbers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcache.press.observe import LayerObservation


@dataclass(frozen=True)
class LayerView:
    """One layer of one sequence as a press sees it."""

    keys: torch.Tensor  # [Hkv, S, D] every slot, RoPE applied at the token's position
    values: torch.Tensor  # [Hkv, S, D]
    pos: torch.Tensor  # [Hkv, S] int64: the slot's token position, -1 where evicted
    length: int  # tokens the sequence holds (the next position)
    scale: float  # the model's attention scale
    obs: LayerObservation  # what the forwards recorded for this layer
    acc: torch.Tensor | None = None  # [Hkv, S] attention each slot received, summed (H2O)
    last: torch.Tensor | None = None  # [Hkv, S] attention the latest query gave each slot (TOVA)
    rotary: object | None = None  # the layer's Rotary (expected attention), None without RoPE

    @property
    def live(self) -> torch.Tensor:
        return self.pos >= 0  # [Hkv, S]


class Press:
    """A scoring rule. Subclasses set ``name``, ``decode`` and implement ``score``."""

    name: ClassVar[str] = ""
    decode: ClassVar[bool] = False  # rescores while generating (else: once, after the prompt)
    queries: ClassVar[int] = 0  # latest prompt queries it needs (post-RoPE)
    moments: ClassVar[bool] = False  # needs the prompt queries' mean and covariance (pre-RoPE)
    attention: ClassVar[bool] = False  # needs the attention weights of every query it sees
    replay: ClassVar[bool] = False  # the model replays the prompt to score it (KVzip)
    latest: ClassVar[bool] = False  # while generating, scores with the latest query's weights (TOVA)
    protect_first: ClassVar[int] = 0  # leading positions this press never evicts
    protect_last: ClassVar[int] = 0  # latest positions this press never evicts

    def score(self, view: LayerView) -> torch.Tensor:
        """[Hkv, S] float: higher is kept. Evicted slots' scores are ignored."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def group_mean(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[Hq, ...] -> [Hkv, ...]: the query heads of each GQA group averaged."""
    return x.view(hkv, x.shape[0] // hkv, *x.shape[1:]).mean(1)


def choose(scores: torch.Tensor, candidates: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` lowest-scored candidate slots of each head: bool [Hkv, S] (True: evict).

    scores: [Hkv, S]; candidates: bool [Hkv, S] with at least ``n`` per head. Ties go to the
    earlier slot (a stable sort), so equal scores evict the older token first."""
    out = torch.zeros_like(candidates)
    if n <= 0:
        return out
    s = scores.float().masked_fill(~candidates, float("inf"))
    idx = torch.sort(s, dim=-1, stable=True).indices[:, :n]  # [Hkv, n]
    out.scatter_(1, idx, True)
    return out & candidates
