"""The one call a model's attention layer makes: ``ctx.attend(layer, q, k, v, scale)``.

A forward processes a flat batch of N tokens that belong to one or more sequences (the context
knows which). The context writes the new K/V where its cache strategy keeps them, reads what each
sequence may see (its visibility policy, the model's per-layer windows) and returns the attention
output. Models hold no cache state: all of it lives behind this interface.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kvcache.attention.dense import attend_dense


class AttentionContext(Protocol):
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] (RoPE already applied) -> [N, Hq, D]."""
        ...

    def attend_packed(
        self, layer: int, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor,
        qk_norm: torch.Tensor | None, eps: float, scale: float,
    ) -> torch.Tensor | None:
        """The same from the fused projection's rows qkv [N, (Hq + 2 Hkv) D], before the per-head
        norm and RoPE (cos, sin: [N, R]) -> [N, Hq D]; None when this context has no faster way
        than ``attend`` (the model then takes the general path)."""
        ...

    def attend_block(
        self, layer: int, x: torch.Tensor, weights: tuple, heads: tuple[int, int, int], cos: torch.Tensor,
        sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float, post_norm: torch.Tensor | None,
    ) -> bool:
        """The attention half of a layer in place, x [N, H] += o(attention(qkv(rms_norm(x)))), with
        weights (qkv, qkv_bias, o, o_bias) and the output through ``post_norm`` when given; False
        when this context has no fused way for it (the model then calls the steps one by one)."""
        ...


class RecomputeContext:
    """No cache: each sequence's tokens attend only to tokens of the same forward (the `none`
    strategy, and the oracle that every exact cache strategy is compared against)."""

    def __init__(
        self,
        seq_lens: Sequence[int],
        positions: torch.Tensor,
        layer_windows: Sequence[int | None],
    ) -> None:
        self.seq_lens = list(seq_lens)
        self.positions = positions  # [N] int64
        self.layer_windows = list(layer_windows)

    def attend_packed(self, *args: object) -> None:
        return None

    def attend_block(self, *args: object) -> bool:
        return False

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        outs = []
        start = 0
        window = self.layer_windows[layer]
        for n in self.seq_lens:
            sl = slice(start, start + n)
            pos = self.positions[sl]
            o = attend_dense(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), pos, pos, window, scale
            )  # [Hq, n, D]
            outs.append(o.transpose(0, 1))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
