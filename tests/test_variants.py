"""One result on every CPU: each kernel variant (generic C, AVX2, AVX-VNNI, AVX-512 VNNI) gives the
same bits as every other for every native kernel, and whole greedy generations give the same logits.

The kernels are built without reassociation or contraction and write their multiply-adds and sums
out in one order (kernels/vmath.h), so the variants differ only in speed. Every variant this CPU
can run is loaded side by side in one process and fed the same inputs; the others are compiled.
On any x86 host at least generic and AVX2 run, so every run checks two variants against each other.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvcache import kernels
from kvcache.kernels import build, signatures
from kvcache.kernels.qweight import Q4_F32, Q5_F32, S8_F32_16, U8_F32, U8_F32_16
from test_qweights import ALL, repacked

RUNNABLE = [v for v in build.variants() if build.runnable(v)]


def libs(name: str) -> dict[str, ctypes.CDLL]:
    """Library ``name`` of every variant: each one compiles here, the runnable ones are loaded."""
    out = {}
    for v in build.variants():
        path = build.build(name, v)
        if build.runnable(v):
            out[v.name] = signatures.bind(ctypes.CDLL(str(path)), name)
    return out


def same(results: dict[str, np.ndarray | torch.Tensor], what: str) -> None:
    names = list(results)
    first = results[names[0]]
    for n in names[1:]:
        a, b = np.asarray(first), np.asarray(results[n])
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), (
            f"{what}: {n} differs from {names[0]} (max |diff| {np.abs(a - b).max():.3g})")


def test_more_than_one_variant_runs_here():
    assert "generic" in {v.name for v in RUNNABLE}
    if build.is_x86() and "avx2" in build.cpu_info()[1]:
        assert len(RUNNABLE) >= 2


# every GGUF type in its own format, and the fp32-scale formats the K-quants fall back to
WEIGHTS = [(t, None) for t in ALL] + [(T.Q5_K, U8_F32), (T.Q4_K, Q4_F32), (T.Q5_K, Q5_F32), (T.Q6_K, S8_F32_16),
                                      (T.Q2_K, U8_F32_16)]


@pytest.mark.parametrize("t,fmt", WEIGHTS, ids=lambda p: getattr(p, "name", str(p)))
def test_quantized_products_give_the_same_bits_on_every_variant(t, fmt):
    """kv_q_linear (norm folded in, bias, accumulate) at every row count a tile can have."""
    lib = libs("qgemm")
    out, k = 53, 512  # a last group of 5 columns
    w, _ = repacked(t, out, k, fmt=fmt, seed=11)
    qs, d, m = w.parts()
    rng = np.random.default_rng(12)
    g = rng.uniform(0.5, 1.5, k).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    for n in (1, 2, 3, 5, 17, 70):
        x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 4, (n, 1))).astype(np.float32)
        for eps, acc in ((-1.0, 0), (1e-6, 1)):
            ys = {}
            for name, lib_ in lib.items():
                y = np.full((n, out), 0.25, np.float32)
                assert lib_.kv_q_linear(w.fmt, n, k, out, x.ctypes.data, k, g.ctypes.data if eps > 0 else None, eps,
                                        qs.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(),
                                        bias.ctypes.data, y.ctypes.data, out, acc, 2) == 0
                ys[name] = y
            same(ys, f"{t.name} (format {w.format_name}), {n} rows, eps {eps}")
        rows = np.array([0, 52, 17, 3], np.int64)
        deq = {}
        for name, lib_ in lib.items():
            y = np.empty((4, k), np.float32)
            assert lib_.kv_q_dequant(w.fmt, k, out, qs.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(),
                                     rows.ctypes.data, 4, y.ctypes.data, k) == 0
            deq[name] = y
        same(deq, f"{t.name} dequantized rows")


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_mixture_experts_give_the_same_bits_on_every_variant(t):
    """kv_q_expert (an expert over 1, 3 and 17 rows; SiLU, and gpt-oss's clamped SwiGLU with its
    biases) and kv_q_experts_row (a row's three experts weighted and summed) on every variant."""
    from kvcache.kernels.qweight import ACT_SWIGLU_OAI, proj_fields

    lib = libs("qgemm")
    H, I = 256, 256
    experts = [(repacked(t, 2 * I, H, seed=20 + e)[0], repacked(t, H, I, seed=30 + e)[0]) for e in range(3)]
    fields = [(torch.tensor(proj_fields([g], 0)), torch.tensor(proj_fields([d], 0))) for g, d in experts]
    gen = torch.Generator().manual_seed(14)
    gu_b, dn_b = torch.randn(2 * I, generator=gen) * 4, torch.randn(H, generator=gen)  # gates past the clamp too
    biased = (torch.tensor(proj_fields([experts[1][0]], gu_b.data_ptr())),
              torch.tensor(proj_fields([experts[1][1]], dn_b.data_ptr())))
    rng = np.random.default_rng(13)
    for n in (1, 3, 17):
        x = rng.standard_normal((n, H)).astype(np.float32)
        for act, (gu_f, dn_f) in ((0, fields[1]), (ACT_SWIGLU_OAI, biased)):
            ys = {}
            for name, lib_ in lib.items():
                y = np.empty((n, H), np.float32)
                assert lib_.kv_q_expert(n, H, I, x.ctypes.data, H, gu_f.data_ptr(), dn_f.data_ptr(), act,
                                        y.ctypes.data, 2) == 0
                ys[name] = y
            same(ys, f"{t.name} expert, activation {act}, {n} rows")
    x = rng.standard_normal(H).astype(np.float32)
    w = np.array([0.5, 0.3, 0.2], np.float32)
    gu, dn = torch.cat([f[0] for f in fields]), torch.cat([f[1] for f in fields])
    outs = {}
    for name, lib_ in lib.items():
        out = np.empty(H, np.float32)
        assert lib_.kv_q_experts_row(H, I, x.ctypes.data, 3, gu.data_ptr(), dn.data_ptr(), w.ctypes.data, 0,
                                     out.ctypes.data, 2) == 0
        outs[name] = out
    same(outs, f"{t.name} a row's three experts")


def test_the_router_and_a_decode_rows_mixture_give_the_same_bits_on_every_variant():
    """kv_moe_route (the norm, logits, top-k and weights of 1 and 7 rows; 21 experts padded to 32
    columns, so vectors and their tail both count), kv_q_moe_row (a row's whole block over five
    Q4_K experts, three a row) and kv_q_moe_rows (seven rows grouped by expert) on every variant."""
    from kvcache.kernels.qweight import proj_fields

    lib = libs("qgemm")
    H, I, E, Ep, k = 256, 256, 21, 32, 3
    rng = np.random.default_rng(17)
    wt = np.zeros((H, Ep), np.float32)
    wt[:, :E] = rng.standard_normal((H, E)).astype(np.float32)
    post = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    for n, norm in ((1, 1), (7, 0)):
        x = rng.standard_normal((n, H)).astype(np.float32)
        got = {}
        for name, lib_ in lib.items():
            h, w, e = np.empty((n, H), np.float32), np.empty((n, k), np.float32), np.empty((n, k), np.int64)
            assert lib_.kv_moe_route(n, H, x.ctypes.data, H, post.ctypes.data, 1e-6, wt.ctypes.data, E, Ep, k, norm,
                                     h.ctypes.data, w.ctypes.data, e.ctypes.data, 2) == 0
            got[name] = np.concatenate([h.ravel(), w.ravel(), e.ravel().view(np.float32)])
        same(got, f"the router over {n} rows")
    experts = [(repacked(T.Q4_K, 2 * I, H, seed=40 + e)[0], repacked(T.Q4_K, H, I, seed=50 + e)[0]) for e in range(5)]
    gu = torch.stack([torch.tensor(proj_fields([g], 0)) for g, _ in experts])
    dn = torch.stack([torch.tensor(proj_fields([d], 0)) for _, d in experts])
    wt5 = np.ascontiguousarray(wt[:, :16] * (np.arange(16) < 5))
    x = rng.standard_normal(H).astype(np.float32)
    outs = {}
    for name, lib_ in lib.items():
        y, w, e = x.copy(), np.empty(k, np.float32), np.empty(k, np.int64)
        assert lib_.kv_q_moe_row(H, I, y.ctypes.data, post.ctypes.data, 1e-6, wt5.ctypes.data, 5, 16, k, 1,
                                 gu.data_ptr(), dn.data_ptr(), 0, w.ctypes.data, e.ctypes.data, 2) == 0
        assert len(set(e.tolist())) == k and 0 <= e.min() and e.max() < 5
        outs[name] = np.concatenate([y, w, e.view(np.float32)])
    same(outs, "a decode row's mixture")
    n = 7  # rows grouped by expert (kv_q_moe_rows), from one variant's routing
    x = rng.standard_normal((n, H)).astype(np.float32)
    h, w, e = np.empty((n, H), np.float32), np.empty((n, k), np.float32), np.empty((n, k), np.int64)
    assert lib["generic"].kv_moe_route(n, H, x.ctypes.data, H, post.ctypes.data, 1e-6, wt5.ctypes.data, 5, 16, k, 1,
                                       h.ctypes.data, w.ctypes.data, e.ctypes.data, 2) == 0
    outs = {}
    for name, lib_ in lib.items():
        y = x.copy()
        assert lib_.kv_q_moe_rows(n, H, I, y.ctypes.data, H, h.ctypes.data, w.ctypes.data, e.ctypes.data, k, 5,
                                  gu.data_ptr(), dn.data_ptr(), 0, 2) == 0
        outs[name] = y
    same(outs, f"{n} rows' mixtures")


def test_fp32_products_give_the_same_bits_on_every_variant():
    """kv_packed_matmul: whole register tiles, single vectors and single columns (which of them a
    column falls in depends on the vector width)."""
    lib = libs("pgemm")
    rng = np.random.default_rng(3)
    for n, inn, k, part in ((1, 64, 2, 200), (7, 96, 3, 77), (13, 128, 1, 136)):
        x = rng.standard_normal((n, inn)).astype(np.float32)
        w = rng.standard_normal((k, inn, part)).astype(np.float32)
        b = rng.standard_normal((k, 1, part)).astype(np.float32)
        ys = {}
        for name, lib_ in lib.items():
            y = np.empty((n, k * part), np.float32)
            assert lib_.kv_packed_matmul(n, inn, k, part, x.ctypes.data, inn, w.ctypes.data, b.ctypes.data,
                                         y.ctypes.data, 2) == 0
            ys[name] = y
        same(ys, f"packed fp32 product {n}x{inn} by {k}x{part}")


def _pages(rng, hkv, d, pages, ps):
    kv = rng.standard_normal((2, hkv, pages * ps, d)).astype(np.float32)
    table = rng.permutation(pages).astype(np.int64)
    return kv, table


@pytest.mark.parametrize("window", [0, 37])
def test_float_attention_gives_the_same_bits_on_every_variant(window):
    """kv_paged_attend (decodes split over chunks, prefills in row blocks, a sliding window) and
    kv_decode_attend (per-head norm, RoPE, the cache write, then attention)."""
    lib = libs("qgemm")
    rng = np.random.default_rng(window + 1)
    hkv, g, d, ps, pages = 2, 3, 64, 16, 40
    kv, table = _pages(rng, hkv, d, pages, ps)
    tables = np.stack([table, np.roll(table, 7)])
    lens, nnew = np.array([600, 300], np.int64), np.array([1, 45], np.int64)
    row0 = np.array([0, 1], np.int64)
    n = int(nnew.sum())
    q = rng.standard_normal((n, hkv * g, d)).astype(np.float32) / 8
    outs = {}
    for name, lib_ in lib.items():
        out = np.empty((n, hkv * g * d), np.float32)
        assert lib_.kv_paged_attend(2, hkv, g, d, ps, pages * ps, q.ctypes.data, kv.ctypes.data, tables.ctypes.data,
                                    pages, row0.ctypes.data, nnew.ctypes.data, lens.ctypes.data, window,
                                    out.ctypes.data, n, 2) == 0
        outs[name] = out
    same(outs, f"paged attention, window {window}")

    hq, rot = hkv * g, d
    qkv0 = rng.standard_normal((n, (hq + 2 * hkv) * d)).astype(np.float32)
    ang = rng.uniform(0, 6.3, (n, rot // 2)).astype(np.float32)
    cos = np.concatenate([np.cos(ang), np.cos(ang)], 1).astype(np.float32)
    sin = np.concatenate([-np.sin(ang), np.sin(ang)], 1).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, (hq + hkv, d)).astype(np.float32)
    slots = np.concatenate([[table[599 // ps] * ps + 599 % ps],
                            [tables[1][j // ps] * ps + j % ps for j in range(255, 300)]]).astype(np.int64)
    sinks = np.array([-3.0, 0.5, 2.0, 9.0, -40.0, 1.0], np.float32)  # gpt-oss's: below and above the scores
    for with_sinks in (False, True):
        outs, pools = {}, {}
        for name, lib_ in lib.items():
            qkv, pool = qkv0.copy(), kv.copy()
            out = np.empty((n, hq * d), np.float32)
            assert lib_.kv_decode_attend(n, hq, hkv, d, rot, qkv.ctypes.data, qkv.shape[1], cos.ctypes.data,
                                         sin.ctypes.data, norm.ctypes.data, 1e-6, pool.ctypes.data, ps, pages * ps,
                                         slots.ctypes.data, tables.ctypes.data, pages, 2, row0.ctypes.data,
                                         nnew.ctypes.data, lens.ctypes.data, window, 0.125,
                                         sinks.ctypes.data if with_sinks else None, out.ctypes.data, 2) == 0
            outs[name], pools[name] = out, pool
        what = f"window {window}{', learned sinks' if with_sinks else ''}"
        same(outs, f"fused decode attention, {what}")
        same(pools, f"the K/V the fused decode attention wrote, {what}")


PROMPTS = ["Water boils at", "def fibonacci(n):", "Photosynthesis converts light into", "The three laws of motion are",
           "Über die Brücke ging"]
GENERATE = textwrap.dedent("""
    import sys
    from kvcache import LLM
    from kvcache.envinfo import logits_digest
    llm = LLM(None if sys.argv[1] == "-" else sys.argv[1], kv=sys.argv[2], prefix=False, threads=2)
    prompts = sys.argv[4].split("\\n")
    for steps in map(int, sys.argv[3].split(",")):
        for i in map(int, sys.argv[5].split(",")):
            digest, tokens = logits_digest(llm, prompts[i], steps)
            print(steps, i, digest, *tokens)
""")


def _generate(variant: str, model: str, kv: str, steps: list[int], torch_isa: str | None = None,
              prompts: tuple[int, ...] = tuple(range(len(PROMPTS)))) -> dict[tuple[int, int], str]:
    """{(greedy steps, prompt): the line (digest, tokens)} of each of ``prompts`` (indices into
    PROMPTS) from one process on ``variant``."""
    env = {**os.environ, "KVCACHE_KERNEL_VARIANT": variant}
    if torch_isa:
        env["ATEN_CPU_CAPABILITY"] = torch_isa  # torch's own vector code, as on another host
    argv = [GENERATE, model, kv, ",".join(map(str, steps)), "\n".join(PROMPTS), ",".join(map(str, prompts))]
    p = subprocess.run(_python(torch_isa, "-c", *argv), capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    out = {}
    for line in p.stdout.splitlines():
        n, i, rest = line.split(" ", 2)
        out[int(n), int(i)] = rest
    assert sorted(out) == sorted((n, i) for n in steps for i in prompts), p.stdout
    return out


def _python(torch_isa: str | None, *args: str) -> list[str]:
    """The argv of ``python *args``: forked from the tests' helper (tests/forkserve.py; the kernels
    are loaded afresh there, so the variant the environment names is the one that runs), or a new
    interpreter where torch's own vector code is chosen (torch reads it once, at its import)."""
    import forkserve

    return [sys.executable, *args] if torch_isa else forkserve.python_command(*args)


def _runs() -> list[tuple[str, str | None]]:
    """(kernel variant, torch's CPU capability): every runnable variant once, the second one with
    torch's AVX2 code (an AVX2-only host's torch)."""
    names = [v.name for v in RUNNABLE]
    return [(n, "avx2" if i == 1 and "avx2" in build.cpu_info()[1] else None) for i, n in enumerate(names)]


@pytest.mark.parametrize("model,kv", [("-", "dynamic,page_size=4"), ("-", "int4,residual=0"),
                                      pytest.param("gemma3-270m", "dynamic", marks=pytest.mark.gemma)],
                         ids=["bundled", "bundled-int4", "gemma3"])
def test_greedy_generations_give_the_same_logits_on_every_variant(model, kv):
    """The five prompts, the file's quantized weights: the logits after each prompt and after each
    of a few greedy tokens are the same bits from every variant (and with torch's AVX2 code); the
    vector variants, a few milliseconds a forward, go on to 12 greedy tokens (quantized pages: 6)
    and agree there too. The scalar generic variant, up to a second a forward, stops at the short
    run of three of the prompts (3, 5 and 8 tokens on the bundled model): prefills and decodes that
    read the K/V a decode wrote (the bundled model's cross a page of 4) run every kernel the longer
    run does (and every row count of a kernel, test_quantized_products_... above). Every cache
    strategy gives these bits on one variant (test_batch_invariance.py), so one of them stands for
    all."""
    if model != "-":
        from conftest import gemma_installed

        if not gemma_installed():
            pytest.skip("the Gemma 3 270M package is not installed (make gemma)")
    # quantized pages run torch element-wise code whose vectors follow the host: one host's torch there
    quantized = kv.startswith("int")
    # the bundled run's 4 tokens cross a page of 4; Gemma's (pages of 16) write and read back their own K/V in 2
    short, long = (3, 6) if quantized else (4, 12) if model == "-" else (2, 12)
    runs = [(v, None) for v, _ in _runs()] if quantized else _runs()
    outs = {f"{v}{'+torch ' + t if t else ''}": _generate(v, model, kv, [short], t, (0, 2, 4)) if v == "generic"
            else _generate(v, model, kv, [short, long], t) for v, t in runs}
    for key in sorted({k for out in outs.values() for k in out}):
        ran = {name: out[key] for name, out in outs.items() if key in out}
        first = next(iter(ran))
        for name, line in ran.items():
            assert line == ran[first], f"{model} {kv}, {key[0]} steps, {PROMPTS[key[1]]!r}: {name} gives other " \
                                       f"logits than {first}"
    assert len(outs) >= 2 and all((short, i) in out for out in outs.values() for i in (0, 2, 4))


def _env_digest(variant: str | None = None, torch_isa: str | None = None) -> str:
    """The forward digest ``kvcache env`` prints (one line, checked), on ``variant`` (default: this
    CPU's own)."""
    env = {**os.environ, **({"KVCACHE_KERNEL_VARIANT": variant} if variant else {}),
           **({"ATEN_CPU_CAPABILITY": torch_isa} if torch_isa else {})}
    p = subprocess.run(_python(torch_isa, "-m", "kvcache", "env"), capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("forward digest")]
    assert len(line) == 1 and "unavailable" not in line[0], p.stdout
    shown = [ln.split(None, 2)[2] for ln in p.stdout.splitlines() if ln.startswith("kernel variant")]
    assert shown == [variant or kernels.variant()], p.stdout
    digest = line[0].split()[2]
    assert len(digest) == 16 and int(digest, 16) >= 0
    return digest


def test_env_prints_one_digest():
    """``kvcache env``'s forward digest: one line two machines compare, and none with --no-digest.
    That every variant gives the same bits is the greedy test's above (the bundled model, five
    prompts); that they give the same digest, the slow test below."""
    _env_digest()
    p = subprocess.run(_python(None, "-m", "kvcache", "env", "--no-digest"), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "forward digest" not in p.stdout


def test_env_prints_the_same_digest_on_every_variant():
    """The same forward digest from every variant (the second with torch's AVX2 code)."""
    digests = {_env_digest(v, t) for v, t in _runs()}
    assert len(digests) == 1
