"""Page pool: the K/V storage of every layer, in pages of ``page_size`` tokens.

Layout per layer (one tensor for K, one for V):  # k[layer]: [Hkv, P, page_size, D]
so that a run of consecutive pages reads as a view [Hkv, n * page_size, D], with no copy.
"""

from __future__ import annotations

import torch


class PagePool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_pages = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.resize(num_pages)

    def _empty(self, pages: int) -> torch.Tensor:
        shape = (self.num_kv_heads, pages, self.page_size, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def resize(self, num_pages: int) -> None:
        """Grow to ``num_pages`` pages, keeping the contents of the existing ones."""
        if num_pages < self.num_pages:
            raise ValueError("the page pool does not shrink")
        old = self.num_pages
        for store in (self.k, self.v):
            for i in range(self.num_layers):
                new = self._empty(num_pages)
                if old:
                    new[:, :old] = store[i]
                if i < len(store):
                    store[i] = new
                else:
                    store.append(new)
        self.num_pages = num_pages

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of n tokens. slots: [n] int64 (page * page_size + offset); k, v: [n, Hkv, D]."""
        h, p, s, d = self.k[layer].shape
        self.k[layer].view(h, p * s, d).index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v[layer].view(h, p * s, d).index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def read(
        self, layer: int, first_page: int | None, slots: torch.Tensor | None, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one sequence: [Hkv, length, D] each.

        With ``first_page`` set the sequence's pages are consecutive and the result is a view;
        otherwise ``slots`` ([length] int64) gathers them.
        """
        h, p, s, d = self.k[layer].shape
        if first_page is not None:
            n = -(-length // s)
            k = self.k[layer][:, first_page : first_page + n].reshape(h, n * s, d)[:, :length]
            v = self.v[layer][:, first_page : first_page + n].reshape(h, n * s, d)[:, :length]
        else:
            assert slots is not None
            k = self.k[layer].view(h, p * s, d).index_select(1, slots)
            v = self.v[layer].view(h, p * s, d).index_select(1, slots)
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        return k, v

    def copy_page(self, src: int, dst: int) -> None:
        for i in range(self.num_layers):
            self.k[i][:, dst] = self.k[i][:, src]
            self.v[i][:, dst] = self.v[i][:, src]
