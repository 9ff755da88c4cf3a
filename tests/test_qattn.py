"""Attention over quantized pages (kernels/qattn.c): the torch path's result (dequantize, then
attend), and one result per row, bit for bit, however the rows come (one at a time or many, the
work spread over chunks or over rows, one thread or two), with and without rotated pages."""

from __future__ import annotations

import pytest
import torch

from kvcache import kernels
from kvcache.attention.backends import PagedContext
from kvcache.cache import PagedKVCache
from kvcache.cache.config import parse_kv_spec
from kvcache.cache.qpool import QuantPool
from kvcache.models.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=16, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=32, max_position=4096, layer_windows=(None, None))

pytestmark = pytest.mark.skipif(kernels.qattn() is None, reason="no C compiler here: the torch path is the only one")


def run_cache(spec: str, use_kernel: bool, monkeypatch, steps=((150, 77), (1, 1), (5, 3), (1, 1), (40, 1))):
    """Two sequences fed in steps (prefill chunks, decodes, short extends); every step's outputs."""
    monkeypatch.setattr(kernels, "_LIBS", {} if use_kernel else {"qattn": False, "pattn": False, "xattn": False})
    torch.manual_seed(0)
    cache = PagedKVCache(CFG, parse_kv_spec(spec))
    seqs = [cache.new_sequence(), cache.new_sequence()]
    outs = []
    for step in steps:
        for s, n in zip(seqs, step):
            k = torch.randn(n, 2, 32) * torch.linspace(0.5, 4, 32)  # channels of different ranges
            ctx = PagedContext(cache, [s], [n], torch.arange(s.length, s.length + n))
            outs.append(ctx.attend(0, torch.randn(n, 6, 32), k, torch.randn(n, 2, 32), 0.2))
    cache.check_integrity()
    return outs


SPECS = ["int8,page_size=32,group_size=16,residual=16", "int4,group_size=32,residual=0",
         "int2,page_size=32,group_size=16,residual=40", "int2,group_size=32,residual=0"]


def close_to_float(x: torch.Tensor, y: torch.Tensor, rms: float, worst: float) -> None:
    """x is y up to a relative error: its root mean square within ``rms`` of y's, no element off by
    more than ``worst`` of y's largest."""
    err = x - y
    assert err.pow(2).mean().sqrt() <= rms * y.pow(2).mean().sqrt(), f"rms error {err.pow(2).mean().sqrt():.3g}"
    assert err.abs().max() <= worst * y.abs().max(), f"largest error {err.abs().max():.3g}"


def kernel_against_torch(spec: str, kernel: str, monkeypatch) -> None:
    """Every step of run_cache through ``kernels.<kernel>`` (counted) gives the torch path's result:
    16-bit pages up to float rounding; quantized ones up to the integer products' rounding (the query
    times the key scales and the weights times the value scales rounded to 16-bit integers: about
    1e-4 of the outputs here, where a wrong code, scale or lane is off by its whole size)."""
    calls = []
    real = getattr(kernels, kernel)

    def counted(*args, **kw):
        out = real(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, kernel, counted)
    fast = run_cache(spec, True, monkeypatch)
    assert calls and all(calls)  # prefill chunks, extends and decodes all went through the kernel
    slow = run_cache(spec, False, monkeypatch)
    for x, y in zip(fast, slow):
        if kernel == "quant_attend":
            close_to_float(x, y, rms=2e-3, worst=4e-3)
        else:
            torch.testing.assert_close(x, y, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", SPECS)
def test_kernel_equals_torch_path(spec, monkeypatch):
    kernel_against_torch(spec, "quant_attend", monkeypatch)


@pytest.mark.parametrize("spec", ["fp16,page_size=16", "bf16", "static,fp16,max_tokens=512,max_seqs=2"])
def test_16_bit_pages_are_read_in_place_like_the_torch_path(spec, monkeypatch):
    kernel_against_torch(spec, "half_attend", monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_row_has_the_same_bits_however_it_is_computed(dtype):
    torch.manual_seed(2)
    flat = torch.randn(2, 2, 1024, 32).to(dtype)
    slots = torch.randperm(1024)[:700].contiguous()
    t, n = 9, 700
    q = torch.randn(t, 6, 32)
    whole = kernels.half_attend(q, flat, slots, 0, n)
    assert whole is not None and torch.isfinite(whole).all()
    assert torch.equal(whole, kernels.half_attend(q, flat, slots, 0, n, way=2))
    for row in (0, 5, t - 1):
        for way in (1, 2):
            alone = kernels.half_attend(q[row:row + 1].contiguous(), flat, slots, 0, n - t + row + 1, way=way)
            assert alone is not None and torch.equal(alone[0], whole[row])
    run = kernels.half_attend(q, flat, None, 100, n)  # consecutive slots from 100
    assert torch.equal(run, kernels.half_attend(q, flat, torch.arange(100, 100 + n), 0, n))
    assert kernels.half_attend(q, flat, None, 400, n) is None  # past the pool's end: refused
    assert kernels.half_attend(q, flat, torch.full((n,), 1024), 0, n) is None


def random_pool(bits: int, group: int, pages: int = 20, page_size: int = 32, d: int = 32, hkv: int = 2,
                seed: int = 0) -> QuantPool:
    torch.manual_seed(seed)
    pool = QuantPool(1, hkv, d, page_size, pages, bits, group)
    pool.write_pages(0, torch.arange(pages), torch.randn(2, hkv, pages * page_size, d) * torch.linspace(0.3, 3, d))
    return pool


@pytest.mark.parametrize("bits,group,d", [(8, 16, 32), (4, 32, 32), (2, 32, 32), (2, 16, 32), (8, 32, 64),
                                          (4, 32, 64), (8, 16, 48)])
@pytest.mark.parametrize("rotate", [False, True])
def test_a_row_has_the_same_bits_however_it_is_computed(bits, group, d, rotate):
    """Row t of a T-row call equals the same row alone (the rest cut after it), and the kernel's two
    ways of spreading work and its thread count change no bit. 27 rows a KV head take tiles of
    many rows (the last one short); a row alone takes a decode's (head_dim 64 with groups of 32:
    codes read in place)."""
    pool = random_pool(bits, group, d=d)
    pages = torch.tensor([7, 3, 11, 0, 19, 5, 8, 1, 2, 4, 6, 9, 10], dtype=torch.long)  # 13 pages: 2 chunks
    t, rest_n = 9, 300  # the rest spans two chunks
    q = torch.randn(t, 6, d)
    rest = torch.randn(2, 2, rest_n, d)
    parts = pool.parts[0]
    whole = kernels.quant_attend(q, pages, parts, 32, group, bits, rest, rotate)
    assert whole is not None and torch.isfinite(whole).all()
    assert torch.equal(whole, kernels.quant_attend(q, pages, parts, 32, group, bits, rest, rotate, way=2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(whole, kernels.quant_attend(q, pages, parts, 32, group, bits, rest, rotate))
    finally:
        torch.set_num_threads(threads)
    for row in (0, 4, t - 1):
        cut = rest[:, :, : rest_n - t + row + 1].contiguous()
        for way in (1, 2):
            alone = kernels.quant_attend(q[row:row + 1].contiguous(), pages, parts, 32, group, bits, cut, rotate,
                                         way=way)
            assert alone is not None and torch.equal(alone[0], whole[row])


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_rotated_pages_attend_like_the_rotation_undone(bits):
    """Pages that hold K and V turned by the normalized Hadamard transform give, with rotate, the
    attention over the unturned K and V (q . k and the weighted sum of V are invariant)."""
    from kvcache.cache.rotation import hadamard

    torch.manual_seed(5)
    d, hkv, ps, n = 32, 2, 32, 6
    k, v = torch.randn(hkv, n * ps, d), torch.randn(hkv, n * ps, d)
    plain, turned = QuantPool(1, hkv, d, ps, n, bits, 32), QuantPool(1, hkv, d, ps, n, bits, 32)
    plain.write_pages(0, torch.arange(n), torch.stack((k, v)))
    turned.write_pages(0, torch.arange(n), torch.stack((hadamard(k), hadamard(v))))
    q, rest = torch.randn(1, 6, d) * 0.3, torch.randn(2, hkv, 3, d)
    pages = torch.arange(n)
    got = kernels.quant_attend(q, pages, turned.parts[0], ps, 32, bits, rest, True)
    dense = torch.empty(2, hkv, n * ps, d)
    turned.read_into(0, None, 0, n, dense)  # dequantized as fed: turned K and V (the pool is not told)
    dense = hadamard(dense)  # turned back
    keys, vals = torch.cat((dense[0], rest[0]), 1), torch.cat((dense[1], rest[1]), 1)
    w = torch.softmax(q.view(hkv, 3, d).double() @ keys.double().transpose(1, 2), -1)
    want = (w @ vals.double()).float().view(1, 6, d)
    close_to_float(got, want, rms=1e-3, worst=2e-3)


def test_float16_scales_are_widened_exactly():
    """The kernel widens float16 scales and minimums itself: value codes 0 and one minimum per
    (head, channel group) over every token give that minimum (subnormals, signed zero, the largest
    half) wherever the rest agrees."""
    pool = random_pool(4, 16, pages=3)
    parts = pool.parts[0]
    parts["vc"].zero_()
    parts["vs"].zero_()  # codes * scale is 0 whatever the weights' rounding: the minimums alone
    mins = torch.tensor([6e-8, -3e-5, 2.0**-24 * 1023, 65504.0], dtype=torch.float16)
    parts["vm"].copy_(mins.view(2, 1, 1, 2).expand_as(parts["vm"]))
    rest = torch.randn(2, 2, 1, 32)
    rest[1] = mins.float().view(2, 2, 1).repeat_interleave(16, -1).view(2, 1, 32)
    got = kernels.quant_attend(torch.randn(1, 6, 32) * 0.1, torch.tensor([2, 0, 1]), parts, 32, 16, 4, rest)
    want = mins.float().view(2, 1, 2, 1).expand(2, 3, 2, 16).reshape(1, 6, 32)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_shapes_it_cannot_tile_are_declined():
    pool = QuantPool(1, 2, 32, 16, 2, 8, 8)  # groups of 8: not a whole vector of codes
    assert kernels.quant_attend(torch.randn(1, 6, 32), torch.arange(2), pool.parts[0], 16, 8, 8,
                                torch.randn(2, 2, 1, 32)) is None


@pytest.mark.parametrize("cc_flag", ["", "-DKV_INT_MIN_BITS=2"], ids=["int8-integer", "every-width-integer"])
def test_every_kernel_variant_gives_the_same_bits(cc_flag, monkeypatch):
    """qattn takes one written order at every vector width (sixteen lanes, one multiply-add per
    step, fmaf in the generic build; integer sums exact however an instruction set forms them): each
    variant this CPU runs gives the bits of every other, for a decode and for nine rows, every code
    width, rotated or not; int8 chunks take integer products, int4 and int2 ones float products
    unless the build gives every width the integer ones (the flag EVAL.md measures them with).
    Variants this CPU cannot run are compiled. The flagged build, a measurement build that no
    user loads, is compiled and compared on the two ends only (the widest vectors this CPU runs,
    and plain C): every variant of it would be 20-25 s more of the compiler."""
    import ctypes

    from kvcache.kernels import build, signatures

    if cc_flag:
        cc = build.compiler()
        if cc is None:
            pytest.skip("no C compiler")
        monkeypatch.setenv("CC", " ".join([*cc, cc_flag]))

    libs = {}
    ends = [next(v for v in build.variants() if build.runnable(v)), build.variants()[-1]]
    for v in (ends if cc_flag else build.variants()):
        path = build.build("qattn", v)  # every variant compiles here (the flagged build: both ends)
        if build.runnable(v):
            libs[v.name] = signatures.bind(ctypes.CDLL(str(path)), "qattn")
    assert "generic" in libs
    # groups of 32 with head_dim 64 or 128 take the AVX-512 build's in-place integer products (one
    # and two slabs of 64 elements), groups of 16 its copied ones; 6 and 2 query heads a KV head
    # fill a tile of four rows and a half
    for bits, group, d, g in ((8, 32, 64, 4), (4, 32, 64, 4), (2, 32, 64, 4), (4, 16, 64, 4), (8, 32, 128, 6),
                              (4, 32, 128, 2), (2, 32, 128, 6), (8, 16, 128, 4), (2, 16, 64, 2)):
        pool = random_pool(bits, group, d=d, seed=bits + group + d)
        parts, pages = pool.parts[0], torch.tensor([3, 0, 7, 1, 19, 4, 8, 2, 11, 5], dtype=torch.long)
        for t, rotate in ((1, 0), (9, 1)):
            q, rest = torch.randn(t, 2 * g, d), torch.randn(2, 2, 300, d)
            outs = {}
            for name, lib in libs.items():
                out = torch.empty(t, 2 * g, d)
                rc = lib.kv_quant_attend(2, g, d, 32, group, bits, t, q.data_ptr(), pages.data_ptr(), 10,
                                         parts["kc"].data_ptr(), parts["ks"].data_ptr(), parts["km"].data_ptr(),
                                         parts["vc"].data_ptr(), parts["vs"].data_ptr(), parts["vm"].data_ptr(),
                                         pool.num_pages, rest[0].data_ptr(), rest[1].data_ptr(), 300, rotate, 0,
                                         out.data_ptr(), 2)
                assert rc == 0
                outs[name] = out
            first = next(iter(outs.values()))
            for name, out in outs.items():
                assert torch.equal(out, first), f"int{bits} group {group} d {d}, {t} rows: {name} differs"
    for bf16, dtype in ((0, torch.float16), (1, torch.bfloat16)):
        flat, slots = torch.randn(2, 2, 600, 64).to(dtype), torch.randperm(600)[:500].contiguous()
        for t in (1, 9):
            q = torch.randn(t, 8, 64)
            outs = []
            for lib in libs.values():
                out = torch.empty(t, 8, 64)
                assert lib.kv_half_attend(2, 4, 64, bf16, t, q.data_ptr(), flat.data_ptr(), 600, slots.data_ptr(),
                                          0, 500, 0, out.data_ptr(), 2) == 0
                outs.append(out)
            assert all(torch.equal(o, outs[0]) for o in outs), f"{dtype}, {t} rows: the variants differ"
