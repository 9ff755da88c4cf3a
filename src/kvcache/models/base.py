"""The contract every native model family implements.

A model is a pure function of (weights, input_ids, positions, attention context). It keeps no
cache state; positions are explicit integers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.attention.interface import AttentionContext
from kvcache.models.config import ModelConfig
from kvcache.kernels.rotary import Rotary
from kvcache.models.layers import norm_linear


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

    def head(self, x: torch.Tensor, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """The final norm (``self.norm``) and the output head (``self.lm_head``) over rows
        ``logits_rows`` of x [N, H] (None: all) -> [R, V]."""
        if logits_rows is not None:
            x = x[logits_rows]
        logits = norm_linear(x, self.lm_head, None, self.config.norm_eps, self.norm)  # [R, k * V / k]
        vocab = self.config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()

    def rotary_for_layer(self, layer: int) -> "Rotary | None":
        """The rotary embedding layer ``layer`` applies to its q and k (None: learned absolute
        positions). The cache uses it to move attention-sink keys to their cache positions."""
        return None

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict, weights: str = "fp32") -> "CausalLM":
        """Build from HF-named weights (as in an HF checkpoint of this family), in eval mode,
        holding them as ``weights`` says (models/weights.py). Subclasses take ``(config,
        state_dict, weights)`` in their constructor."""
        return cls(config, state_dict, weights).eval()  # type: ignore[call-arg]

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold in memory (fp32 parameters and quantized weights)."""
        return sum(self.weight_kinds().values())

    def lookup_tables(self) -> list:
        """The input embedding tables a step reads a few rows of, never multiplies by (an untied
        token table, GPT-2's position table)."""
        return [t for t in (getattr(self, name, None) for name in ("embed", "wpe")) if t is not None]

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: all of them but the rows of its lookup tables
        it does not look up."""
        total = self.weight_bytes()
        for table in self.lookup_tables():
            total -= table.nbytes if not isinstance(table, torch.Tensor) else table.numel() * table.element_size()
        return total

    def quantized_weights(self) -> list:
        """The quantized weights (``QWeight``, ``QStack``) the model holds, each once."""
        from kvcache.kernels.qweight import QStack, QWeight

        out: list = []
        seen: set[int] = set()
        for v in self.modules():
            for w in vars(v).values():
                if isinstance(w, (QWeight, QStack)) and id(w) not in seen:
                    seen.add(id(w))
                    out.append(w)
        return out

    def weight_kinds(self) -> dict[str, int]:
        """Bytes per kind of weight: ``fp32`` and each quantized format name."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out["fp32"] = out.get("fp32", 0) + p.numel() * p.element_size()
        for w in self.quantized_weights():
            out[w.format_name] = out.get(w.format_name, 0) + w.nbytes
        return out
