"""``RecomputeContext``: the context of the ``none`` strategy (no cache: each sequence's tokens
attend only to tokens of the same forward), the oracle every exact cache strategy is compared
against.

A layer with full visibility goes through the very kernels a paged cache uses (kernels/dattn.c and
cattn.c) over a scratch pool that lives for one forward: each sequence's tokens in a page-aligned
run of slots, rewritten by every layer. Attention then reduces in the same canonical order as
every cached path, so recomputing gives the cache's logits bit for bit, quantized weights
included; sliding-window layers pass their window to the same kernels. Inputs the kernels do not
take, and machines without them, use attention/dense.py.

Owns the scratch pool of one forward; knows nothing of the cache's pages, allocator or planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache import kernels
from kvcache.attention.dense import attend_dense
from kvcache.kernels.qweight import attn_block

PAGE = 16  # slots per scratch page


class RecomputeContext:
    def __init__(
        self,
        seq_lens: Sequence[int],
        positions: torch.Tensor,  # [N] int64
        layer_windows: Sequence[int | None],
        softcap: float | None = None,  # the model's attention logit soft cap (Gemma 2)
    ) -> None:
        self.seq_lens = list(seq_lens)
        self.softcap = softcap
        self.positions = positions
        self.layer_windows = list(layer_windows)
        n = torch.tensor(self.seq_lens, dtype=torch.long)  # [B]
        pages = (n + PAGE - 1) // PAGE
        first_page = torch.cumsum(pages, 0) - pages
        width = int(pages.max()) if len(self.seq_lens) else 1
        # sequence b owns pages first_page[b] .. first_page[b] + pages[b] - 1, its tokens in order
        self.tables = (first_page[:, None] + torch.arange(width)[None, :]).clamp(max=int(pages.sum()) - 1)  # [B, W]
        self.slots = torch.cat([int(f) * PAGE + torch.arange(int(m)) for f, m in zip(first_page, n)])  # [N]
        self.rows = (self.tables.contiguous(), (torch.cumsum(n, 0) - n).contiguous(), n.contiguous(), n.contiguous())
        self.n_slots = int(pages.sum()) * PAGE
        self._pool: torch.Tensor | None = None  # [2, Hkv, S, D], made by the first layer that needs it

    def _scratch(self, hkv: int, d: int) -> torch.Tensor:
        if self._pool is None or self._pool.shape[1] != hkv or self._pool.shape[3] != d:
            self._pool = torch.empty(2, hkv, self.n_slots, d)
        return self._pool

    def attend_packed(self, layer: int, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor,
                      sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                      sink_logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """qkv [N, (Hq + 2 Hkv) D] -> [N, Hq D] through the fused kernel (learned sink logits
        [Hq] too); None: use ``attend`` (also for soft-capped scores, which the kernels do not take)."""
        if self.softcap is not None:
            return None
        _, hkv, d = heads
        return kernels.decode_attend(qkv, heads, cos, sin, qk_norm, eps, self._scratch(hkv, d), PAGE, self.slots,
                                     self.rows, scale, self.layer_windows[layer] or 0, sink_logits)

    def attend_block(self, layer: int, x: torch.Tensor, weights: tuple, heads: tuple[int, int, int],
                     cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                     post_norm: torch.Tensor | None) -> bool:
        """The attention half of a layer with quantized weights in one native call; False otherwise."""
        if kernels.dattn() is None or self.softcap is not None:
            return False
        _, hkv, d = heads
        return attn_block(x, weights, heads, cos, sin, qk_norm, eps, scale, post_norm, self._scratch(hkv, d), PAGE,
                          self.slots, self.rows, self.layer_windows[layer] or 0)

    def layer_pages(self) -> None:
        """None: a recompute goes layer by layer (attend_block), every layer over the same scratch
        pages."""
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D], dense, per sequence."""
        outs = []
        start = 0
        window = self.layer_windows[layer]
        for n in self.seq_lens:
            sl = slice(start, start + n)
            pos = self.positions[sl]
            o = attend_dense(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), pos, pos, window, scale,
                self.softcap, sink_logits,
            )  # [Hq, n, D]
            outs.append(o.transpose(0, 1))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
