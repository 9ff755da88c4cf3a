"""KIVI-style quantization of KV-cache entries to int8, int4 and int2.

Asymmetric min/scale quantization with float16 scales and minimums (KIVI keeps them in the
model's half precision; they are a third of int4's bytes in float32):
  levels = 2**bits - 1, min16 = the float16 at or below min, scale16 = the float16 at or above
  (max - min16) / levels (1 where max == min), code = clamp(round((x - min16) / scale16), 0, levels),
  x_hat = code * scale16 + min16 (in float32).
The codes are taken against the rounded scale and minimum, so storing them in float16 costs no more
than a scale 2**-11 wider: the error stays within half a (rounded) step.
Codes are packed into uint8 along the last dimension (head_dim D, a multiple of 8): int8 one code
per byte, int4 two, int2 four; code j of a byte sits at bits [j * bits, (j + 1) * bits).

Layout (H heads, D head_dim):
  keys    k: [H, n, G, D]  n groups of G tokens; codes [H, n, G, D*bits/8],
               scale and min [H, n, 1, D] float16: one per (head, token group, channel)
  values  v: [H, T, D]     codes [H, T, D*bits/8],
               scale and min [H, T, D/group] float16: one per (head, token, group of channels)

Why keys per channel and values per token: keys carry a few outlier channels
whose magnitude is an order of magnitude above the rest, and they stay the same channels across
tokens. A per-token range would be set by those outliers and crush every other channel of the token
to a handful of levels; a per-channel range over a group of tokens isolates them. Values show no
fixed outlier channels, and attention's output is a per-token weighted sum of value rows, so the
error that matters is each token's own row: quantizing each token (in groups of channels) on its own
range keeps that error bounded per token.
"""

from __future__ import annotations

import torch

BITS = (8, 4, 2)
SCALE_DTYPE = torch.float16  # how scales and minimums are stored
SCALE_BYTES = torch.finfo(SCALE_DTYPE).bits // 8
_HALF_MAX = 65504.0

__all__ = ["BITS", "SCALE_DTYPE", "bytes_per_token", "dequantize_keys", "dequantize_values", "pack_codes",
           "quantize_keys", "quantize_keys_channel_major", "quantize_values", "unpack_codes"]


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return bits


def _check_dim(d: int) -> None:
    if d % 8:
        raise ValueError(f"the last dimension (head_dim) must be a multiple of 8 to pack codes, got {d}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., D] uint8, each < 2**bits -> [..., D*bits//8] uint8."""
    _check_bits(bits)
    _check_dim(codes.shape[-1])
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)  # [..., D*bits//8, per]
    # one whole-tensor op per bit position (2 or 4); strided slices beat a broadcast shift + sum
    packed = grouped[..., 0].clone()  # [..., D*bits//8]
    for j in range(1, per):
        packed |= grouped[..., j] << (j * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed: [..., D*bits//8] uint8 -> codes [..., D] uint8 (inverse of pack_codes)."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    per = 8 // bits
    codes = torch.stack([(packed >> (j * bits)) & mask for j in range(per)], -1)  # [..., D*bits//8, per]
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per)  # [..., D]


def _half_below(x: torch.Tensor) -> torch.Tensor:
    """The float16 at or below each float32 of x (clipped to float16's range)."""
    h = x.clamp(-_HALF_MAX, _HALF_MAX).to(SCALE_DTYPE)  # the nearest
    up = h.float() > x
    return torch.where(up, torch.nextafter(h, torch.full_like(h, -_HALF_MAX)), h)


def _half_above(x: torch.Tensor) -> torch.Tensor:
    """The float16 at or above each float32 of x (clipped to float16's range)."""
    h = x.clamp(-_HALF_MAX, _HALF_MAX).to(SCALE_DTYPE)
    down = h.float() < x.clamp(max=_HALF_MAX)
    return torch.where(down, torch.nextafter(h, torch.full_like(h, _HALF_MAX)), h)


def _quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: float32, reduced over ``dim`` (kept) -> (codes uint8 like x, scale, min float16)."""
    levels = (1 << bits) - 1
    mn, mx = torch.aminmax(x, dim=dim, keepdim=True)
    mx = mx.clamp(-_HALF_MAX, _HALF_MAX)  # beyond float16's range, values are clipped
    mn16 = _half_below(mn)
    mn = mn16.float()
    scale16 = _half_above((mx - mn).clamp_(min=0) / levels)
    scale16 = torch.where(mx <= mn, torch.ones_like(scale16), scale16)
    scale = scale16.float()
    codes = ((x - mn) / scale).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale16, mn16


def quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k: [H, n, G, D] float32 (n groups of G tokens), per channel over each group.
    -> codes [H, n, G, D*bits//8] uint8, scale [H, n, 1, D] float16, min [H, n, 1, D] float16."""
    _check_bits(bits)
    if k.dim() != 4:
        raise ValueError(f"keys must be [H, n, G, D], got shape {tuple(k.shape)}")
    _check_dim(k.shape[-1])
    codes, scale, mn = _quantize(k.float(), 2, bits)
    return pack_codes(codes, bits), scale, mn


def quantize_keys_channel_major(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like quantize_keys, with each channel's G codes stored together (the layout the decode
    kernel scores G tokens at a time from): codes [H, n, D, G*bits//8] uint8 (G a multiple of 8)."""
    _check_bits(bits)
    if k.dim() != 4:
        raise ValueError(f"keys must be [H, n, G, D], got shape {tuple(k.shape)}")
    _check_dim(k.shape[2])
    codes, scale, mn = _quantize(k.float(), 2, bits)
    return pack_codes(codes.transpose(2, 3).contiguous(), bits), scale, mn


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [H, n, G, D*bits//8] uint8; scale, minv: [H, n, 1, D] (float16) -> [H, n, G, D] float32."""
    out = unpack_codes(codes, bits).to(torch.float32)
    return out.mul_(scale.float()).add_(minv.float())


def quantize_values(
    v: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v: [H, T, D] float32, per token over groups of ``group`` channels.
    -> codes [H, T, D*bits//8] uint8, scale [H, T, D//group] float16, min [H, T, D//group] float16."""
    _check_bits(bits)
    if v.dim() != 3:
        raise ValueError(f"values must be [H, T, D], got shape {tuple(v.shape)}")
    h, t, d = v.shape
    _check_dim(d)
    if group <= 0 or d % group:
        raise ValueError(f"group={group} must divide the head dimension ({d})")
    codes, scale, mn = _quantize(v.float().reshape(h, t, d // group, group), 3, bits)
    return pack_codes(codes.view(h, t, d), bits), scale.view(h, t, d // group), mn.view(h, t, d // group)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bits: int,
                      group: int) -> torch.Tensor:
    """codes: [H, T, D*bits//8] uint8; scale, minv: [H, T, D//group] (float16) -> [H, T, D] float32."""
    out = unpack_codes(codes, bits).to(torch.float32)
    h, t, d = out.shape
    if group <= 0 or d % group:
        raise ValueError(f"group={group} must divide the head dimension ({d})")
    grouped = out.view(h, t, d // group, group)
    grouped.mul_(scale.float().unsqueeze(-1)).add_(minv.float().unsqueeze(-1))
    return out


def bytes_per_token(num_kv_heads: int, head_dim: int, bits: int, group: int) -> float:
    """Bytes one token costs in one layer, K and V, scales and minimums included.
    Keys: codes plus a float16 scale and min per channel per ``group`` tokens, amortised per token.
    Values: codes plus a float16 scale and min per ``group`` channels."""
    _check_bits(bits)
    _check_dim(head_dim)
    if group <= 0 or head_dim % group:
        raise ValueError(f"group={group} must divide the head dimension ({head_dim})")
    codes = head_dim * bits / 8
    keys = codes + 2 * SCALE_BYTES * head_dim / group
    values = codes + 2 * SCALE_BYTES * (head_dim // group)
    return float(num_kv_heads * (keys + values))
