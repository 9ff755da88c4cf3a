"""The native attention kernels equal the torch path; they refuse what they cannot read."""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvcache import kernels
from kvcache.attention.backends import PagedContext
from kvcache.cache import PagedKVCache
from kvcache.cache.config import parse_kv_spec
from kvcache.models.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=16, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=32, max_position=4096, layer_windows=(None, None))


def batched_decode_outputs(spec: str, use_kernel: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(kernels, "_LIBS", {} if use_kernel else {"qattn": False, "pattn": False, "xattn": False})
    torch.manual_seed(1)
    cache = PagedKVCache(CFG, parse_kv_spec(spec))
    seqs = [cache.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, (40, 9, 23)):  # page tables interleave
        PagedContext(cache, [s], [n], torch.arange(n)).attend(0, torch.randn(n, 6, 32), torch.randn(n, 2, 32),
                                                             torch.randn(n, 2, 32), 0.2)
    outs = []
    for _ in range(5):
        pos = torch.tensor([s.length for s in seqs])
        ctx = PagedContext(cache, seqs, [1, 1, 1], pos)
        outs.append(ctx.attend(0, torch.randn(3, 6, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32), 0.2))
    cache.check_integrity()
    return outs


@pytest.mark.parametrize("spec", ["dynamic,page_size=4", "static,max_tokens=64,max_seqs=3,page_size=16"])
def test_batched_float_decode_kernel_equals_torch_path(spec, monkeypatch):
    if kernels.xattn() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    calls = []
    real = kernels.paged_extend  # decodes and extends alike: the canonical attention (cattn.c)

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "paged_extend", counted)
    fast = batched_decode_outputs(spec, True, monkeypatch)
    assert calls and all(calls)
    slow = batched_decode_outputs(spec, False, monkeypatch)
    for x, y in zip(fast, slow):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


# -- packed multi-row projections (pgemm.c) --------------------------------------------------------

@pytest.mark.parametrize("out_f,in_f,k", [(960, 576, 2), (1001, 77, 2), (64, 32, 1), (5, 3, 3), (300, 130, 4)])
@pytest.mark.parametrize("n", [2, 5, 7, 13, 200])
def test_packed_matmul_equals_reference(out_f, in_f, k, n):
    """Every column (whole tiles, single vectors, the last odd ones) and row count (a partial tile,
    more than one row chunk) against float64, with a bias and with rows further apart than ``in``."""
    from kvcache.models.layers import pack, pack_bias

    if kernels.pgemm() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    torch.manual_seed(n + out_f)
    w, b = torch.randn(out_f, in_f), torch.randn(out_f)
    pw = pack(w, k)
    x = torch.randn(n, in_f + 9)[:, :in_f]  # a view: rows in_f + 9 apart
    ref = (x.double() @ w.double().T + b.double()).float()
    got = kernels.packed_matmul(x, pw, pack_bias(b, pw))
    assert got is not None
    torch.testing.assert_close(got[:, :out_f], ref, atol=1e-4, rtol=1e-4)
    got = kernels.packed_matmul(x.contiguous(), pw, None)
    torch.testing.assert_close(got[:, :out_f], (x.double() @ w.double().T).float(), atol=1e-4, rtol=1e-4)


def test_linear_uses_the_kernel_for_every_row_count_and_matches_the_batched_product(monkeypatch):
    from kvcache.models import layers

    if kernels.pgemm() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    torch.manual_seed(3)
    pw = layers.pack(torch.randn(200, 48), 2)
    calls = []
    real = kernels.packed_matmul
    monkeypatch.setattr(kernels, "packed_matmul", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(9, 48)
    fast = layers.linear(x, pw)
    assert len(calls) == 1
    one = layers.linear(x[:1], pw)
    assert len(calls) == 2  # one row too: the same bits as that row in a batch
    assert torch.equal(one[0], fast[0]) and torch.equal(layers.linear(x[4:7], pw), fast[4:7])
    monkeypatch.setattr(layers, "_MULTI_ROW", False)
    torch.testing.assert_close(fast, layers.linear(x, pw), atol=1e-5, rtol=1e-5)


# -- extend attention over float pages (cattn.c) ---------------------------------------------------

def extend_outputs(cfg: ModelConfig, spec: str, steps: list[list[int]], use_kernel: bool, monkeypatch):
    """Run forwards of ``steps[i][b]`` new tokens for sequence b over shared pool pages."""
    monkeypatch.setattr(kernels, "_LIBS", {} if use_kernel else {"qattn": False, "pattn": False, "xattn": False})
    torch.manual_seed(5)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cache = PagedKVCache(cfg, parse_kv_spec(spec))
    seqs = [cache.new_sequence() for _ in steps[0]]
    outs = []
    for news in steps:
        live = [(s, n) for s, n in zip(seqs, news) if n]
        pos = torch.cat([torch.arange(s.length, s.length + n) for s, n in live])
        ctx = PagedContext(cache, [s for s, _ in live], [n for _, n in live], pos)
        m = pos.shape[0]
        outs.append(ctx.attend(0, torch.randn(m, hq, d), torch.randn(m, hkv, d) * 2, torch.randn(m, hkv, d), 0.3))
    cache.check_integrity()
    return outs


EXTEND_CASES = {
    # two sequences written alternately: neither's pages are one run; then extends of a few tokens
    "interleaved, then extends": [[37, 0], [0, 50], [13, 0], [1, 0], [0, 7], [1, 1]],
    "a batch of different lengths": [[5, 300], [1, 13], [20, 2], [150, 1]],
    # 150 new tokens over 50 old ones: chunks of keys that early rows cannot see at all
    "long extend over a short prefix": [[50], [150], [3]],
    "a fresh prefill": [[77]],
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
@pytest.mark.parametrize("spec", ["dynamic,page_size=4", "static,max_tokens=512,max_seqs=2,page_size=16",
                                  # a sliding window (no sinks) goes through the same kernel: every row
                                  # sees only its window, and pages gone out of every window (holes in
                                  # the table) are never read
                                  "dynamic,page_size=4,window=24", "dynamic,page_size=16,window=200",
                                  "static,max_tokens=512,max_seqs=2,page_size=16,window=129"])
def test_extend_kernel_equals_torch_path(case, spec, monkeypatch):
    if kernels.xattn() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    calls = []
    real = kernels.paged_extend
    monkeypatch.setattr(kernels, "paged_extend", lambda *a: calls.append(real(*a) is not None) or real(*a))
    fast = extend_outputs(CFG, spec, EXTEND_CASES[case], True, monkeypatch)
    assert calls and all(calls)
    slow = extend_outputs(CFG, spec, EXTEND_CASES[case], False, monkeypatch)
    for x, y in zip(fast, slow):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def _fed_in(spec: str, chunks: list[int], n: int) -> tuple[torch.Tensor, int]:
    """One sequence's n tokens (fixed q, k, v) fed in ``chunks``: its output rows [n, Hq, D] and
    the page-table holes it ended with."""
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(n, 6, 32, generator=g), torch.randn(n, 2, 32, generator=g), torch.randn(n, 2, 32, generator=g)
    cache = PagedKVCache(CFG, parse_kv_spec(spec))
    seq, at, outs = cache.new_sequence(), 0, []
    for c in chunks:
        ctx = PagedContext(cache, [seq], [c], torch.arange(at, at + c))
        outs.append(ctx.attend(0, q[at : at + c], k[at : at + c], v[at : at + c], 0.3))
        at += c
    cache.check_integrity()
    return torch.cat(outs), sum(p == -1 for p in seq.tables[0])


@pytest.mark.parametrize("spec", ["dynamic,page_size=4,window=40", "dynamic,page_size=16,window=300"])
def test_windowed_rows_have_the_same_bits_however_they_are_fed(spec):
    """Batch invariance with a window: one token at a time, one prefill, uneven chunks and short
    verifying-sized steps give every row the same bits, holes in the table or not."""
    if kernels.xattn() is None:
        pytest.skip("no C compiler here")
    n = 420
    ref, _ = _fed_in(spec, [n], n)
    for chunks in ([1] * n, [5, 9, 1, 2] * 23 + [n - 17 * 23], [130, 3, 200, 87]):
        got, holes = _fed_in(spec, chunks, n)
        assert torch.equal(got, ref), f"chunks {chunks[:5]}...: max difference {float((got - ref).abs().max()):.3g}"
    assert holes > 0  # pages left every window and went back: the kernel skipped them


@pytest.mark.parametrize("g,d", [(1, 64), (3, 64), (4, 64), (4, 128), (8, 32), (16, 64)])
def test_a_decode_row_has_the_bits_of_the_same_row_in_a_prefill(g, d):
    """A decode's few query rows (g of a KV head) may take narrower vectors than a prefill's many;
    each row's chain is the same, so the last token decoded alone and as the last row of a 40-token
    extend over the same 300 keys give the same bits, for every group size, and the math's answer."""
    if kernels.xattn() is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(g * 1000 + d)
    hkv, ps, L, T = 2, 16, 300, 40
    pages = (L + ps - 1) // ps
    flat = torch.randn(2, hkv, pages * ps, d)
    tables = torch.randperm(pages)[None, :].contiguous()  # pages out of order
    q = torch.randn(T, hkv * g, d) * 0.2
    one, zero = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    alone = kernels.paged_extend(q[-1:].contiguous(), flat, tables, zero, one, torch.tensor([L]), ps)
    block = kernels.paged_extend(q, flat, tables, zero, torch.tensor([T]), torch.tensor([L]), ps)
    assert alone is not None and block is not None
    assert torch.equal(alone[0], block[-1])
    slots = (tables[0, torch.arange(L) // ps] * ps + torch.arange(L) % ps)
    k, v = flat[0][:, slots], flat[1][:, slots]  # [hkv, L, d]
    kq = k.repeat_interleave(g, 0)  # [hkv g, L, d]
    ref = torch.softmax(torch.einsum("hd,hld->hl", q[-1], kq), -1)
    want = torch.einsum("hl,hld->hd", ref, v.repeat_interleave(g, 0))
    assert torch.allclose(alone[0], want, atol=1e-5, rtol=1e-4)


def test_extend_kernel_declines_a_head_size_it_does_not_tile(monkeypatch):
    """head_dim 20 is no multiple of a vector: the kernel says no and the torch path answers."""
    if kernels.xattn() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=60, intermediate_size=16, num_layers=1,
                      num_heads=3, num_kv_heads=1, head_dim=20, max_position=512, layer_windows=(None,))
    steps = EXTEND_CASES["interleaved, then extends"]
    results = []
    real = kernels.paged_extend
    monkeypatch.setattr(kernels, "paged_extend", lambda *a: results.append(real(*a)) or real(*a))
    fast = extend_outputs(cfg, "dynamic,page_size=4", steps, True, monkeypatch)
    assert results and all(r is None for r in results)
    slow = extend_outputs(cfg, "dynamic,page_size=4", steps, False, monkeypatch)
    for x, y in zip(fast, slow):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_kernels_refuse_page_tables_that_point_outside_the_pool():
    """A bad page-table entry is refused (None: the caller's torch path then fails cleanly), never
    read out of bounds; a sequence with nothing to attend to gets zeros, not NaN."""
    if kernels.pattn() is None or kernels.xattn() is None or kernels.qattn() is None:
        pytest.skip("no C compiler here")
    flat = torch.randn(2, 2, 8 * 4, 32)  # a pool layer of 8 pages of 4 tokens
    q = torch.randn(1, 2, 3, 32)
    lens = torch.tensor([6], dtype=torch.long)
    good = torch.tensor([[3, 5]], dtype=torch.long)
    assert kernels.paged_decode(q, flat, good, lens, 4) is not None
    for bad in ([[3, 8]], [[-1, 5]], [[3, 2**40]]):
        assert kernels.paged_decode(q, flat, torch.tensor(bad, dtype=torch.long), lens, 4) is None
        assert kernels.paged_extend(torch.randn(2, 6, 32), flat, torch.tensor(bad, dtype=torch.long),
                                    torch.tensor([0]), torch.tensor([2]), lens, 4) is None
    assert kernels.paged_decode(q, flat, good, torch.tensor([9]), 4) is None  # more tokens than the table holds
    assert kernels.paged_decode(q.double(), flat, good, lens, 4) is None  # the wrong dtype never reaches C
    pool = PagedKVCache(CFG, parse_kv_spec("int8,page_size=16,group_size=16,residual=0")).pools[0]
    parts, rest, qd = pool.parts[0], torch.randn(2, 2, 1, 32), torch.randn(1, 6, 32)
    assert kernels.quant_attend(qd, torch.tensor([pool.num_pages], dtype=torch.long), parts, 16, 16, 8, rest) is None
    assert kernels.quant_attend(qd, torch.tensor([-1], dtype=torch.long), parts, 16, 16, 8, rest) is None
    assert kernels.quant_attend(qd, torch.zeros(1, dtype=torch.long), parts, 16, 16, 8, rest[:, :, :0]) is None


def test_the_machine_probes_read_and_count():
    """The benchmarks' read-bandwidth and int8-peak probes (kernels/membw.c) compute what they say:
    the streaming read sums its vector (a wrong stride or a skipped block changes the sum), and
    the peak reports a positive rate; inputs it cannot take are refused."""
    if kernels.qgemm() is None:
        pytest.skip("no C compiler here")
    x = torch.arange(4096 * 6, dtype=torch.float32) % 7
    assert kernels.stream_sum(x) == pytest.approx(float(x.sum()), rel=1e-6)
    assert kernels.stream_sum(x[:1000]) is None and kernels.stream_sum(x.double()) is None
    assert kernels.int8_peak(0.01) > 1e8


# kv_fmaf's inline path (vmath.h, KV_FMAF_INLINE: taken whatever the CPU) against libm's fmaf, compiled
# as the generic build compiles it: random operands
# over the whole float range, products that nearly cancel the addend (where rounding twice would
# show), halfway sums, subnormals, zeros, infinities and NaNs. Prints the mismatches and the count.
FMAF_CHECK = r"""
#define KV_FMAF_INLINE
#include "vmath.h"
#include <stdio.h>
static uint64_t st = 88172645463325252ULL;
static uint32_t rnd(void) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return (uint32_t)(st >> 16); }
static float bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t ubits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
int main(void) {
    long bad = 0, n = 0;
    const float edge[] = {0.f, -0.f, 1.f, -1.f, 1e-45f, -1e-45f, 1.17549435e-38f, 3.4028235e38f, -3.4028235e38f,
                          __builtin_inff(), -__builtin_inff(), __builtin_nanf(""), 0.5f, 3.f, 1.0000001f};
    const int ne = sizeof(edge) / sizeof(edge[0]);
    for (long i = 0; i < 3000000 + ne * ne * ne; i++) {
        float a, b, c;
        if (i < ne * ne * ne) {
            a = edge[i % ne], b = edge[i / ne % ne], c = edge[i / ne / ne];
        } else {
            const int kind = (int)(i % 5);
            a = bits(rnd() ^ (rnd() << 16)), b = bits(rnd() ^ (rnd() << 16)), c = bits(rnd() ^ (rnd() << 16));
            if (kind >= 1) { /* moderate exponents */
                a = bits((ubits(a) & 0x807fffffu) | (uint32_t)(110 + rnd() % 36) << 23);
                b = bits((ubits(b) & 0x807fffffu) | (uint32_t)(110 + rnd() % 36) << 23);
            }
            if (kind == 2) /* an addend that nearly cancels the product */
                c = bits(ubits(-(float)((double)a * b)) + (uint32_t)(rnd() % 5) - 2u);
            if (kind == 3) /* a product whose low half lands at a float's halfway point */
                c = bits((ubits(a) & 0x80000000u) | ((ubits(a) >> 23 & 255u) + (ubits(b) >> 23 & 255u) - 127u + 24u) << 23);
            if (kind == 4) { /* (1 + k u) (1 - k u) h = h - k^2 u^2 h, h half an ulp of c: the sum lies a hair
                              * from c's halfway point, where rounding to double and then to float errs */
                const int k = 1 + (int)(rnd() % 300), e = (int)(rnd() % 40) - 20;
                const float s = rnd() & 1 ? 1.f : -1.f, cm = 1.f + (float)(rnd() % 8388608) * 0x1p-23f;
                a = (1.f + (float)k * 0x1p-23f) * ldexpf(1.f, e);
                b = s * (1.f - (float)k * 0x1p-23f) * 0x1p-24f;
                c = (rnd() & 1 ? cm : -cm) * ldexpf(1.f, e);
            }
        }
        const float r = kv_fmaf(a, b, c), want = fmaf(a, b, c);
        n++;
        if (ubits(r) != ubits(want) && !(r != r && want != want)) {
            if (bad < 10) printf("fmaf(%a, %a, %a): %a, libm %a\n", a, b, c, r, want);
            bad++;
        }
    }
    printf("%ld of %ld\n", bad, n);
    return 0;
}
"""


def test_the_generic_builds_fused_multiply_add_is_libms_fmaf(tmp_path):
    """Where neither the build nor the CPU has an FMA instruction (the generic build on an x86
    without FMA), kv_fmaf is computed inline in double arithmetic; it must round exactly as libm's
    correctly rounded fmaf does."""
    from kvcache.kernels import build

    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    src = tmp_path / "fmaf.c"
    src.write_text(FMAF_CHECK)
    exe = tmp_path / "fmaf"
    p = subprocess.run([*cc, build.optimization(build.GENERIC), *build.MATH, f"-I{build.SOURCES}", str(src), "-o",
                        str(exe), "-lm"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300).stdout
    assert out.strip().endswith(f"0 of {3000000 + 15 ** 3}"), out
