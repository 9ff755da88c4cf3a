"""AttentionContext: the one call a model's attention layer makes, ``ctx.attend(layer, q, k, v, scale)``.

A forward processes a flat batch of N tokens that belong to one or more sequences (the context
knows which). The context writes the new K/V where its cache strategy keeps them, reads what each
sequence may see (its visibility policy, the model's per-layer windows) and returns the attention
output. Models hold no cache state: all of it lives behind this interface.

Owns the protocol only. Implementations: ``RecomputeContext`` (attention/dense.py, no cache),
``PagedContext`` (attention/backends.py, the paged cache), the bridge's and inspect's wrappers.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class LayerPages(NamedTuple):
    """Where every layer of one forward attends when all of them take the fused path over fp32 pages
    (kernels/qweight.py LayerStack): ``flats`` [L] each layer's pool layer [2, Hkv, S, D];
    ``kvs`` [L, 2] int64: its address and group; ``groups`` [G, 7] int64 per layer group: the new
    tokens' slots, the page tables, the lengths (addresses), max pages a table, window, slots in
    the pool, page size; ``batch`` sequences whose first rows ``row0`` and new tokens ``nnew`` [B]
    int64 the groups share. The tensors behind the addresses live as long as the context."""
    flats: list[torch.Tensor]
    kvs: torch.Tensor
    groups: torch.Tensor
    batch: int
    row0: torch.Tensor
    nnew: torch.Tensor


class AttentionContext(Protocol):
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] (RoPE already applied) -> [N, Hq, D]. ``sink_logits``
        [Hq]: the layer's learned logit per query head that joins every softmax with no value
        (gpt-oss; attention/dense.py sink_softmax); it takes the dense path."""
        ...

    def attend_packed(
        self, layer: int, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor,
        qk_norm: torch.Tensor | None, eps: float, scale: float, sink_logits: torch.Tensor | None = None,
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

    def layer_pages(self) -> LayerPages | None:
        """Every layer's pages for one native call through all layers, when every layer's attention
        takes the fused path; None otherwise (the model then goes layer by layer)."""
        ...
