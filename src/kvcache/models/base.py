"""The contract every native model family implements.

A model is a pure function of (weights, input_ids, positions, attention context). It keeps no
cache state; positions are explicit integers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.attention.context import AttentionContext
from kvcache.models.config import ModelConfig
from kvcache.models.layers import Rotary


class CausalLM(nn.Module):
    config: ModelConfig

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N] int64, tokens of one or more sequences, flat
        positions: torch.Tensor,  # [N] int64
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R] int64 rows of N to project; None: all
    ) -> torch.Tensor:  # [R or N, vocab] float32
        raise NotImplementedError

    def rotary_for_layer(self, layer: int) -> "Rotary | None":
        """The rotary embedding layer ``layer`` applies to its q and k (None: learned absolute
        positions). The cache uses it to move attention-sink keys to their cache positions."""
        return None

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> "CausalLM":
        """Build from HF-named weights (as in an HF checkpoint of this family), in eval mode.
        Subclasses take ``(config, state_dict)`` in their constructor."""
        return cls(config, state_dict).eval()  # type: ignore[call-arg]
