"""Page pool for quantized encodings (int8, int4, int2), KIVI's layout.

Per layer of the group:
  kc: [Hkv, P, page_size/G, D, G*bits/8] uint8  key codes, per channel over groups of G tokens,
                                            stored channel-major (a channel's G codes together)
  ks, km: [Hkv, P, page_size/G, D] fp16      their scale and minimum
  vc: [Hkv, P, page_size, D*bits/8] uint8   value codes; values per token over groups of G channels
  vs, vm: [Hkv, P, page_size, D/G] fp16      their scale and minimum
Only full pages are stored here; a sequence's latest tokens stay in fp32 (its tail) until they
are older than the residual window, then whole pages are quantized at once.

``rotate`` (``--kv int4,rotate``): K and V are rotated per head over head_dim by the normalized
Hadamard transform (cache/rotation.py) before they are quantized, and rotated back after they are
dequantized, so the codes hold rotated values and every reader of ``read_into`` sees K/V as the
model made them. The fp32 tail is never rotated. Readers of the codes themselves (``parts``: a
native decode kernel, the prefix tiers, saved files) must know the pool's ``rotate``.
"""

from __future__ import annotations

import torch

from kvcache.cache import quant
from kvcache.cache.placement import Placement
from kvcache.cache.rotation import hadamard
from kvcache.errors import InvalidParams

_PARTS = ("kc", "ks", "km", "vc", "vs", "vm")


class QuantPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        bits: int,
        group: int,
        placement: Placement | None = None,
        rotate: bool = False,
        sparse_start: bool = False,
    ) -> None:
        """``sparse_start``: the first size is mostly unwritten room to grow into (PagePool's)."""
        if head_dim % group or page_size % group:
            raise InvalidParams(
                f"group_size={group} must divide the head dimension ({head_dim}) and the page size "
                f"({page_size}); try group_size=32 or 16"
            )
        if head_dim % 8:
            raise InvalidParams(f"head dimension {head_dim} is not a multiple of 8: codes cannot be packed")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.bits, self.group = page_size, bits, group
        self.rotate = rotate  # codes hold Hadamard-rotated K/V (cache/rotation.py)
        self.placement = placement or Placement("device", torch.device("cpu"))
        self.num_pages = 0
        self.parts: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.resize(num_pages, sparse=sparse_start)

    def _shapes(self, pages: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        h, ps, d, g = self.num_kv_heads, self.page_size, self.head_dim, self.group
        packed = d * self.bits // 8
        f16, u8 = quant.SCALE_DTYPE, torch.uint8
        return {"kc": ((h, pages, ps // g, d, g * self.bits // 8), u8), "ks": ((h, pages, ps // g, d), f16),
                "km": ((h, pages, ps // g, d), f16), "vc": ((h, pages, ps, packed), u8),
                "vs": ((h, pages, ps, d // g), f16), "vm": ((h, pages, ps, d // g), f16)}

    def resize(self, num_pages: int, sparse: bool = False) -> None:
        """Grow or shrink to ``num_pages`` pages, keeping the contents of the pages that stay
        (``sparse``: see Placement.zeros)."""
        old = min(self.num_pages, num_pages)
        for layer in self.parts:
            for name, (shape, dtype) in self._shapes(num_pages).items():
                new = self.placement.zeros(shape, dtype, sparse)
                if old:
                    new[:, :old] = layer[name][:, :old]
                layer[name] = new
        self.num_pages = num_pages

    @property
    def token_bytes(self) -> float:
        """Bytes of one token in one layer, K and V, scales included."""
        return quant.bytes_per_token(self.num_kv_heads, self.head_dim, self.bits, self.group)

    @property
    def page_bytes(self) -> int:
        return int(round(self.token_bytes * self.page_size)) * self.num_layers

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages

    def write_pages(self, layer: int, pages: torch.Tensor, kv: torch.Tensor) -> None:
        """Quantize whole pages. pages: [m] int64; kv: [2, Hkv, m * page_size, D] fp32."""
        h, d, ps, g = self.num_kv_heads, self.head_dim, self.page_size, self.group
        m = pages.shape[0]
        if self.rotate:
            kv = hadamard(kv)  # [2, Hkv, m * page_size, D], each head's rows rotated over D
        kc, ks, km = quant.quantize_keys_channel_major(kv[0].reshape(h, m * ps // g, g, d), self.bits)
        vc, vs, vm = quant.quantize_values(kv[1].reshape(h, m * ps, d), self.bits, g)
        new = {"kc": kc.view(h, m, ps // g, d, -1), "ks": ks.view(h, m, ps // g, d), "km": km.view(h, m, ps // g, d),
               "vc": vc.view(h, m, ps, -1), "vs": vs.view(h, m, ps, d // g), "vm": vm.view(h, m, ps, d // g)}
        dst = self.parts[layer]
        idx = pages.to(dst["kc"].device)
        for name in _PARTS:
            dst[name].index_copy_(1, idx, new[name].to(dst[name].device))

    def seal(self, layer: int, pages: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Quantize the first ``len(pages)`` pages' worth of ``kv`` ([2, Hkv, n, D] fp32: the fp32
        tail followed by new tokens) into ``pages`` ([m] int64); returns the rest, the new tail."""
        m = pages.shape[0] * self.page_size
        if m:
            self.write_pages(layer, pages, kv[:, :, :m])
        return kv[:, :, m:].clone()

    def read_into(self, layer: int, pages: torch.Tensor | None, first: int, m: int, out: torch.Tensor) -> None:
        """Dequantize m pages into out: [2, Hkv, m * page_size, D] fp32 (a view of a larger buffer
        is fine). ``pages`` ([m] int64) gathers them, or None for the run ``first .. first + m``."""
        h, d, ps, g = self.num_kv_heads, self.head_dim, self.page_size, self.group
        src = self.parts[layer]
        if pages is None:
            p = {n: src[n][:, first : first + m] for n in _PARTS}
        else:
            idx = pages.to(src["kc"].device)
            p = {n: src[n].index_select(1, idx) for n in _PARTS}
        p = {n: self.placement.fetch(t) for n, t in p.items()}  # to the compute device if elsewhere
        kc, vc = p["kc"], p["vc"]
        if self.bits != 8:
            kc, vc = quant.unpack_codes(kc, self.bits), quant.unpack_codes(vc, self.bits)
        k_out = out[0].view(h, m, ps // g, g, d)
        torch.mul(kc.view(h, m, ps // g, d, g).transpose(3, 4), p["ks"].float().unsqueeze(3), out=k_out)
        k_out.add_(p["km"].float().unsqueeze(3))
        v_out = out[1].view(h, m, ps, d // g, g)
        torch.mul(vc.view(h, m, ps, d // g, g), p["vs"].float().unsqueeze(4), out=v_out)
        v_out.add_(p["vm"].float().unsqueeze(4))
        if self.rotate:
            out.copy_(hadamard(out))  # back from the rotated basis (H is its own inverse)

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        return list(self.parts[layer].values())

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.parts:
            for t in layer.values():
                t[:, dst] = t[:, src]

    def page_state(self, layer: int, pages: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(pages, dtype=torch.long)
        return {n: t.index_select(1, idx.to(t.device)).cpu() for n, t in self.parts[layer].items()}

    def load_pages(self, layer: int, pages: list[int], data: dict[str, torch.Tensor]) -> None:
        idx = torch.tensor(pages, dtype=torch.long)
        for n, t in self.parts[layer].items():
            t.index_copy_(1, idx.to(t.device), data[n].to(t.device, t.dtype))
