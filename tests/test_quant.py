"""The KIVI-style codec: packing, error bounds, per-channel keys, validation, byte accounting."""

from __future__ import annotations

import pytest
import torch

from kvcache.cache import quant

H, N, G, D, T, GROUP = 2, 4, 32, 64, 128, 32
OUTLIERS = [3, 17, 40]
# relative error ||x - x_hat|| / ||x|| on N(0, 1) data with groups of 32 (measured over seeds 0..4:
# int8 ~0.0046, int4 ~0.078, int2 0.386..0.405; the int2 floor is the 4-level uniform error)
REL_BOUND = {8: 0.01, 4: 0.1, 2: 0.45}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _keys(seed: int = 0, outliers: bool = True) -> torch.Tensor:
    k = torch.randn(H, N, G, D, generator=_gen(seed))  # [H, n, G, D]
    if outliers:
        k[..., OUTLIERS] *= 20
    return k


def _values(seed: int = 1) -> torch.Tensor:
    return torch.randn(H, T, D, generator=_gen(seed))  # [H, T, D]


def _roundtrip_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale, minv = quant.quantize_keys(k, bits)
    assert codes.shape == (H, N, G, D * bits // 8) and codes.dtype == torch.uint8
    assert scale.shape == minv.shape == (H, N, 1, D) and scale.dtype == minv.dtype == torch.float16
    return quant.dequantize_keys(codes, scale, minv, bits), scale.float()


def _roundtrip_values(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale, minv = quant.quantize_values(v, bits, GROUP)
    assert codes.shape == (H, T, D * bits // 8) and codes.dtype == torch.uint8
    assert scale.shape == minv.shape == (H, T, D // GROUP) and scale.dtype == minv.dtype == torch.float16
    return quant.dequantize_values(codes, scale, minv, bits, GROUP), scale.float()


def _rel(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return ((x - x_hat).norm() / x.norm()).item()


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, D), generator=_gen(bits), dtype=torch.uint8)  # [3, 5, D]
    packed = quant.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, D * bits // 8)
    assert packed.numel() == codes.numel() * bits // 8
    assert torch.equal(quant.unpack_codes(packed, bits), codes)


def test_pack_layout_low_bits_first():
    codes = torch.tensor([1, 2, 3, 0, 3, 3, 0, 1], dtype=torch.uint8)
    assert quant.pack_codes(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4, 3 | 3 << 2 | 1 << 6]
    assert quant.pack_codes(codes, 4).tolist() == [1 | 2 << 4, 3, 3 | 3 << 4, 1 << 4]


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_rejects_dim_not_multiple_of_8(bits):
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.pack_codes(torch.zeros(2, 12, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.quantize_keys(torch.randn(1, 1, 4, 12), bits)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.quantize_values(torch.randn(1, 4, 12), bits, 4)


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("outliers", [False, True])
def test_key_error_within_half_scale(bits, outliers):
    k = _keys(outliers=outliers)
    k_hat, scale = _roundtrip_keys(k, bits)
    bound = scale / 2 + 1e-6 * k.abs().amax(dim=2, keepdim=True)  # [H, n, 1, D]
    assert ((k - k_hat).abs() <= bound).all()
    assert _rel(k, k_hat) < REL_BOUND[bits]


@pytest.mark.parametrize("bits", quant.BITS)
def test_value_error_within_half_scale(bits):
    v = _values()
    v_hat, scale = _roundtrip_values(v, bits)
    per_elem = scale.repeat_interleave(GROUP, dim=-1)  # [H, T, D]
    assert ((v - v_hat).abs() <= per_elem / 2 + 1e-6 * v.abs().amax()).all()
    assert _rel(v, v_hat) < REL_BOUND[bits]


def test_error_decreases_with_bits():
    k, v = _keys(), _values()
    k_err = [(k - _roundtrip_keys(k, b)[0]).abs().mean().item() for b in (2, 4, 8)]
    v_err = [(v - _roundtrip_values(v, b)[0]).abs().mean().item() for b in (2, 4, 8)]
    assert k_err[0] > k_err[1] > k_err[2] > 0
    assert v_err[0] > v_err[1] > v_err[2] > 0


@pytest.mark.parametrize("bits", quant.BITS)
def test_per_channel_keys_beat_per_token_on_outlier_channels(bits):
    k = _keys()
    k_chan, _ = _roundtrip_keys(k, bits)
    # the same min/scale scheme, but one range per token across all channels
    levels = 2**bits - 1
    mn, mx = k.amin(-1, keepdim=True), k.amax(-1, keepdim=True)  # [H, n, G, 1]
    scale = (mx - mn) / levels
    k_tok = ((k - mn) / scale).round().clamp(0, levels) * scale + mn
    assert _rel(k, k_chan) < 0.7 * _rel(k, k_tok)  # measured ratio ~0.46
    # the ordinary channels are where per-token ranges hurt: the outliers set every token's range
    normal = [c for c in range(D) if c not in OUTLIERS]
    err_chan = (k - k_chan)[..., normal].abs().mean()
    err_tok = (k - k_tok)[..., normal].abs().mean()
    assert err_chan < 0.25 * err_tok


@pytest.mark.parametrize("bits", quant.BITS)
def test_constant_group_reconstructs_to_its_float16(bits):
    # a constant group that is a float16 (-2.5, 1.25) keeps scale 1 and comes back exactly; one
    # that is not (0.37) gets the float16 below it and a tiny scale, within float16's rounding
    k = torch.full((H, N, G, D), 0.37)
    k[:, 1] = -2.5
    k_hat, scale = _roundtrip_keys(k, bits)
    assert (scale[:, 1] == 1).all() and torch.equal(k_hat[:, 1], k[:, 1])
    assert ((k_hat - k).abs() <= 0.37 * 2.0**-11).all()
    v = _values()
    v[:, 5, :GROUP] = 1.25
    v_hat, _ = _roundtrip_values(v, bits)
    assert torch.equal(v_hat[:, 5, :GROUP], v[:, 5, :GROUP])


@pytest.mark.parametrize("bits", quant.BITS)
def test_float16_scales_keep_half_a_step_where_rounding_to_nearest_would_not(bits):
    # minimums just above a float16: rounding them to the nearest float16 would lift the range off
    # the group's smallest value; quantize rounds the minimum down and the scale up instead
    base = torch.tensor(1000.0 + 0.49).expand(H, N, G, D).clone()  # float16 steps are 0.5 near 1000
    k = base + torch.rand(H, N, G, D) * 2.0**-6
    k_hat, scale = _roundtrip_keys(k, bits)
    assert ((k - k_hat).abs() <= scale / 2 + 1e-6 * k.abs().amax()).all()  # plus float32 arithmetic
    v = torch.tensor(-3000.3) + torch.rand(H, T, D) * 0.01
    v_hat, vscale = _roundtrip_values(v, bits)
    assert ((v - v_hat).abs() <= vscale.repeat_interleave(GROUP, dim=-1) / 2 + 1e-6 * v.abs().amax()).all()


def test_values_beyond_float16_are_clipped_not_infinite():
    k = _keys() * 1e6
    for bits in quant.BITS:
        codes, scale, minv = quant.quantize_keys(k, bits)
        out = quant.dequantize_keys(codes, scale, minv, bits)
        assert out.isfinite().all() and out.abs().max() <= 65504 * 1.01


def test_values_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="group"):
        quant.quantize_values(torch.randn(1, 4, 64), 4, 24)
    with pytest.raises(ValueError, match="group"):
        quant.bytes_per_token(1, 64, 4, 24)


def test_bits_outside_allowed_raise():
    for call in (lambda: quant.quantize_keys(_keys(), 3),
                 lambda: quant.quantize_values(_values(), 3, GROUP),
                 lambda: quant.pack_codes(torch.zeros(8, dtype=torch.uint8), 3),
                 lambda: quant.unpack_codes(torch.zeros(8, dtype=torch.uint8), 3),
                 lambda: quant.bytes_per_token(1, 64, 3, 32)):
        with pytest.raises(ValueError, match=r"\(8, 4, 2\)"):
            call()


def test_bytes_per_token_by_hand():
    # H=3, D=64, int4, key groups of 32 tokens, value groups of 32 channels, float16 scales
    keys = 3 * (64 * 4 / 8 + 2 * 2 * 64 / 32)  # codes 32 B + scale/min 8 B per head
    values = 3 * (64 * 4 / 8 + 2 * 2 * (64 / 32))  # codes 32 B + 2 groups x 4 B per head
    assert keys == values == 120
    assert quant.bytes_per_token(3, 64, 4, 32) == pytest.approx(240.0)
    # against fp32 K+V (3 * 64 * 4 * 2 = 1536 B): a 6.4x saving
    assert quant.bytes_per_token(3, 64, 8, 32) == pytest.approx(3 * (64 + 8) * 2)
