"""Page pool: the K/V storage of every layer, in pages of ``page_size`` tokens.

Layout per layer, K and V together:  # kv[layer]: [2, Hkv, P, page_size, D]
so that a run of consecutive pages reads as a view [2, Hkv, n * page_size, D] with no copy, and
one forward writes K and V of a layer with a single index_copy_.
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
        self.kv: list[torch.Tensor] = []  # per layer [2, Hkv, P, page_size, D]
        self.flat: list[torch.Tensor] = []  # the same storage as [2, Hkv, P * page_size, D]
        self.resize(num_pages)

    def resize(self, num_pages: int) -> None:
        """Grow to ``num_pages`` pages, keeping the contents of the existing ones."""
        if num_pages < self.num_pages:
            raise ValueError("the page pool does not shrink")
        old = self.num_pages
        shape = (2, self.num_kv_heads, num_pages, self.page_size, self.head_dim)
        for i in range(self.num_layers):
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old:
                new[:, :, :old] = self.kv[i]
            flat = new.view(2, self.num_kv_heads, num_pages * self.page_size, self.head_dim)
            if i < len(self.kv):
                self.kv[i], self.flat[i] = new, flat
            else:
                self.kv.append(new)
                self.flat.append(flat)
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
        kv = torch.stack((k, v)).transpose(1, 2)  # [2, Hkv, n, D]
        if kv.dtype != self.dtype:
            kv = kv.to(self.dtype)
        self.flat[layer].index_copy_(2, slots, kv)

    def read(
        self, layer: int, first_page: int | None, slots: torch.Tensor | None, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one sequence: [Hkv, length, D] each.

        With ``first_page`` set the sequence's pages are consecutive and the result is a view;
        otherwise ``slots`` ([length] int64) gathers them.
        """
        if first_page is not None:
            start = first_page * self.page_size
            kv = self.flat[layer][:, :, start : start + length]  # [2, Hkv, L, D] view
        else:
            assert slots is not None
            kv = self.flat[layer].index_select(2, slots)  # [2, Hkv, L, D]
        if kv.dtype != torch.float32:
            kv = kv.float()
        return kv[0], kv[1]

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.kv:
            layer[:, :, dst] = layer[:, :, src]
