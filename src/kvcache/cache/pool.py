"""Page pool for float encodings (fp32, fp16, bf16): the K/V of one layer group, in pages of
``page_size`` tokens.

Layout per layer, K and V together:  # kv[layer]: [2, Hkv, P, page_size, D]
so that a run of consecutive pages reads as a view [2, Hkv, n * page_size, D] with no copy, and
one forward writes K and V of a layer with a single index_copy_. fp16/bf16 are storage
encodings: written converted, read back as fp32.
"""

from __future__ import annotations

import torch

from kvcache.cache.placement import Placement


class PagePool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype = torch.float32,
        placement: Placement | None = None,
        sparse_start: bool = False,
    ) -> None:
        """``sparse_start``: the first size is a dynamic pool's room to grow into, mostly unwritten
        (Placement.zeros' ``sparse``); the sizes it grows to are not."""
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.placement = placement or Placement("device", torch.device("cpu"))
        self.num_pages = 0
        self.kv: list[torch.Tensor] = []  # per layer [2, Hkv, P, page_size, D]
        self.flat: list[torch.Tensor] = []  # the same storage as [2, Hkv, P * page_size, D]
        self.resize(num_pages, sparse=sparse_start)

    def resize(self, num_pages: int, sparse: bool = False) -> None:
        """Grow or shrink to ``num_pages`` pages, keeping the contents of the pages that stay
        (``sparse``: see Placement.zeros)."""
        old = min(self.num_pages, num_pages)
        shape = (2, self.num_kv_heads, num_pages, self.page_size, self.head_dim)
        for i in range(self.num_layers):
            new = self.placement.zeros(shape, self.dtype, sparse)
            if old:
                new[:, :, :old] = self.kv[i][:, :, :old]
            flat = new.view(2, self.num_kv_heads, num_pages * self.page_size, self.head_dim)
            if i < len(self.kv):
                self.kv[i], self.flat[i] = new, flat
            else:
                self.kv.append(new)
                self.flat.append(flat)
        self.num_pages = num_pages

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one layer, K and V."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across the group's layers, K and V."""
        return self.token_bytes * self.page_size * self.num_layers

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of n tokens. slots: [n] int64 (page * page_size + offset); k, v: [n, Hkv, D]."""
        kv = torch.stack((k, v)).transpose(1, 2)  # [2, Hkv, n, D]
        if kv.dtype != self.dtype or kv.device != self.flat[layer].device:
            kv = kv.to(self.flat[layer].device, self.dtype)
        self.flat[layer].index_copy_(2, slots.to(kv.device), kv)

    def read(
        self, layer: int, first_slot: int | None, slots: torch.Tensor | None, length: int
    ) -> torch.Tensor:
        """K and V of one sequence: [2, Hkv, length, D] fp32 on the compute device.

        With ``first_slot`` set the tokens are consecutive slots from there and the result is a
        view (a copy when the pool is away from the compute or not fp32); otherwise ``slots``
        ([length] int64) gathers them.
        """
        if first_slot is not None:
            kv = self.placement.fetch(self.flat[layer][:, :, first_slot : first_slot + length])  # [2, Hkv, L, D]
        else:
            assert slots is not None
            kv = self.flat[layer].index_select(2, slots.to(self.flat[layer].device))  # [2, Hkv, L, D]
            kv = kv.to(self.placement.compute, non_blocking=True)
        return kv if kv.dtype == torch.float32 else kv.float()

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        return [self.kv[layer]]

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.kv:
            layer[:, :, dst] = layer[:, :, src]

    def page_state(self, layer: int, pages: list[int]) -> torch.Tensor:
        """The stored K/V of some pages: [2, Hkv, n, page_size, D] in the pool's dtype."""
        return self.kv[layer][:, :, torch.tensor(pages, dtype=torch.long)].cpu()

    def load_pages(self, layer: int, pages: list[int], data: torch.Tensor) -> None:
        self.kv[layer][:, :, torch.tensor(pages, dtype=torch.long)] = data.to(self.kv[layer].device, self.dtype)
