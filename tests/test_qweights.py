"""Quantized weights: GGUF blocks repacked exactly, int8 products within the bound their activation
rounding allows (every kernel variant this CPU runs; the others compile), the build's hygiene."""

from __future__ import annotations

import ctypes
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import forkserve
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvcache.kernels import build, signatures
from kvcache.kernels.qweight import FORMAT_OF, QWeight, common_format

KERNELS = ("qgemm", "pgemm", "qattn")
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
KQUANTS = {T.Q2_K: (84, 80, 82), T.Q3_K: (110, 108, None), T.Q4_K: (144, 0, 2), T.Q5_K: (176, 0, 2),
           T.Q6_K: (210, 208, None)}  # block bytes, offsets of d and dmin


def gguf_rows(t: T, out: int, k: int, seed: int = 0) -> np.ndarray:
    """[out, bytes per row] blocks of type t: legacy types quantize Gaussian weights with gguf's own
    rule; K-quants are random blocks with sane fp16 scales (gguf-py cannot quantize them)."""
    rng = np.random.default_rng(seed)
    if t in LEGACY or t == T.MXFP4:
        return quantize(rng.standard_normal((out, k)).astype(np.float32), t)
    size, d_at, dmin_at = KQUANTS[t]
    raw = rng.integers(0, 256, size=(out, k // 256, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(out, k // 256)).astype(np.float16)
    raw[:, :, d_at:d_at + 2] = d.view(np.uint8).reshape(out, k // 256, 2)
    if dmin_at is not None:
        raw[:, :, dmin_at:dmin_at + 2] = (d * 0.5).astype(np.float16).view(np.uint8).reshape(out, k // 256, 2)
    return raw.reshape(out, -1)


def repacked(t: T, out: int, k: int, fmt: int | None = None, seed: int = 0) -> tuple[QWeight, np.ndarray]:
    raw = gguf_rows(t, out, k, seed)
    w = QWeight(FORMAT_OF[int(t)] if fmt is None else fmt, out, k)
    w.put_gguf(int(t), raw, np.arange(out))
    return w.seal(), dequantize(raw, t).reshape(out, k)


ALL = [*LEGACY, T.MXFP4, *KQUANTS]
# memory per weight in its repacked format: values (nibbles or bytes) plus scales (and minimums)
# (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K at the file's own density: the K-quants keep the
# file's integer scales in as many bytes; Q3_K as Q6_K; Q2_K its values as nibbles: 0.64 where the file takes 0.33;
# MXFP4 its codes with an fp16 scale per 32 where the file has a byte: 0.5625 against 0.53125)
BYTES_PER_WEIGHT = {T.Q4_0: 0.5625, T.Q4_1: 0.625, T.Q5_0: 0.6875, T.Q5_1: 0.75, T.Q8_0: 1.0625, T.Q2_K: 0.640625,
                    T.Q3_K: 0.8203125, T.Q4_K: 0.5625, T.Q5_K: 0.6875, T.Q6_K: 0.8203125, T.MXFP4: 0.5625}


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_repacked_weights_hold_exactly_the_files_values(t):
    w, ref = repacked(t, 37, 512)  # a last group of 5 rows
    torch.testing.assert_close(w.dequantize(), torch.from_numpy(ref), rtol=1e-6, atol=0)
    assert w.nbytes == BYTES_PER_WEIGHT[t] * 48 * 512  # rows padded to whole groups of 16
    rows = torch.tensor([36, 0, 8, 7])
    torch.testing.assert_close(w.rows(rows), torch.from_numpy(ref[[36, 0, 8, 7]]), rtol=1e-6, atol=0)
    for bad in ([0, 37], [-1], [5, 1 << 40]):  # the native lookup refuses every id past the rows it holds
        with pytest.raises(IndexError, match="out of range for a weight of 37 rows"):
            w.rows(torch.tensor(bad))


def test_mxfp4_scales_outside_fp16_are_refused_unless_the_block_is_zeros(tmp_path):
    """An MXFP4 block's scale is held as the fp16 2^(e - 128): a block whose e has no such fp16 is
    refused by the repacker in one line naming the scale (and the tensor, on a model's load), unless
    all its codes are zeros (+0 and -0), whose weights any scale gives. fp32 holds every scale: the
    same rows read as fp32 are gguf-py's."""
    from kvcache.errors import ModelLoadError
    from kvcache.models.gguf_tensor import GGUFTensor
    from kvcache.models.weights import projection

    raw = gguf_rows(T.MXFP4, 16, 64, seed=3).reshape(16, 2, 17).copy()
    raw[4, 1, 0] = 200  # 2^73
    w = QWeight(FORMAT_OF[int(T.MXFP4)], 16, 64)
    with pytest.raises(ModelLoadError, match=r"MXFP4 block's scale 2\^73 is outside"):
        w.put_gguf(int(T.MXFP4), raw.reshape(16, -1), np.arange(16))
    (tmp_path / "t.bin").write_bytes(raw.tobytes())
    t = GGUFTensor(str(tmp_path / "t.bin"), int(T.MXFP4), 16, 64, 0)
    with pytest.raises(ModelLoadError, match=r"t\.bin: the tensor at byte 0: an MXFP4 block's scale 2\^73"):
        projection([t], None, "file")
    ref = dequantize(raw.reshape(16, -1), T.MXFP4).reshape(16, 64)
    assert np.array_equal(t.dequantize().numpy(), ref)  # fp32 takes the scale the repacker refuses
    raw[4, 1, 1:] = np.array([0x88, 0x08, 0x80, 0x00] * 4, np.uint8)  # +0 and -0 only
    w = QWeight(FORMAT_OF[int(T.MXFP4)], 16, 64)
    w.put_gguf(int(T.MXFP4), raw.reshape(16, -1), np.arange(16))
    ref = dequantize(raw.reshape(16, -1), T.MXFP4).reshape(16, 64)
    assert np.array_equal(w.seal().dequantize().numpy(), ref)


@pytest.mark.parametrize("types", [(T.Q4_0, T.Q4_K), (T.Q4_1, T.Q5_0), (T.Q4_K, T.Q5_K), (T.Q5_1, T.Q2_K),
                                   (T.Q8_0, T.Q6_K)], ids=lambda ts: "+".join(t.name for t in ts))
def test_parts_of_different_types_share_a_format(types):
    fmt = common_format([int(t) for t in types])
    assert fmt is not None
    for t in types:  # each type keeps its exact values in the shared format
        a, ra = repacked(t, 16, 256, fmt=fmt)
        torch.testing.assert_close(a.dequantize(), torch.from_numpy(ra), rtol=1e-6, atol=0)


def super_block_acts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-quant order's activations as the kernels make them: per 256 inputs one step amax / 127,
    each value x * (127 / amax) rounded to the nearest integer, halves away from zero (float32
    steps). Returns (int values [n, K], steps [n, K / 256])."""
    n, k = x.shape
    xs = x.reshape(n, k // 256, 256)
    amax = np.abs(xs).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    t = (xs * inv).astype(np.float32)
    q = np.trunc(t + np.copysign(np.float32(0.5), t).astype(np.float32)).clip(-127, 127)
    return q.reshape(n, k), (amax[..., 0] / np.float32(127)).astype(np.float32)


@pytest.mark.parametrize("v", [v for v in build.variants() if build.runnable(v)], ids=lambda v: v.name)
@pytest.mark.parametrize("t", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quants_take_one_activation_step_a_super_block(v, t):
    """Q4_K, Q5_K and Q6_K keep the file's integer scales as bytes (0.58, 0.70 and 0.83 bytes a
    weight; Q3_K as Q6_K, 0.83 where fp32 scales took 1.25; Q2_K 0.64, where they took 1.5) and
    take llama.cpp's order for them: activations rounded with one step per 256 inputs,
    each super-block's sums exact in integers, two float steps a super-block. So every output is
    the exact sum over super-blocks of step x (file weights . rounded activations) up to a few
    float roundings (1e-6 relative here; the per-32 order misses this by about 1e-3), on every
    variant and row count, including rows that drive every integer sum to its extreme."""
    lib = variant_lib(v)
    packed, ref = repacked(t, 40, 512, seed=5)
    assert packed.format_name in ("q2_ks", "q4_ks", "q5_ks", "q6_ks") and packed.nbytes == BYTES_PER_WEIGHT[t] * 48 * 512
    rng = np.random.default_rng(6)
    for n in (1, 2, 5, 67):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        x[0] = 3.0  # every activation 127: the largest sums
        x[-1, 256:] = -1.0
        y = np.zeros((n, 40), np.float32)
        qs, d, m = packed.parts()
        assert lib.kv_q_linear(packed.fmt, n, 512, 40, x.ctypes.data, 512, None, -1.0, qs.data_ptr(), d.data_ptr(),
                               None if m is None else m.data_ptr(), None, y.ctypes.data, 40, 0, 2) == 0
        q, step = super_block_acts(x)
        terms = (q.reshape(n, 1, 2, 256) * ref.astype(np.float64).reshape(1, 40, 2, 256)).sum(-1) * step[:, None, :]
        want = terms.sum(-1)
        tol = 1e-6 * np.abs(terms).sum(-1) + 1e-9
        err = np.abs(y - want)
        assert (err <= tol).all(), f"{v.name} {t.name} n={n}: worst err/tol {(err / tol).max():.2f}"


def test_signed_beside_unsigned_types_stack():
    assert common_format([int(T.Q5_0), int(T.Q6_K)]) is None  # a QStack of two parts
    assert common_format([int(T.Q2_K), int(T.Q4_K)]) is None  # K-quants of two kinds: each keeps its own
    assert common_format([int(T.Q3_K), int(T.Q6_K)]) == FORMAT_OF[int(T.Q6_K)]  # Q3_K in Q6_K's format
    with pytest.raises(Exception, match="cannot hold"):
        QWeight(FORMAT_OF[int(T.Q4_0)], 8, 256).put_gguf(int(T.Q8_0), gguf_rows(T.Q8_0, 8, 256), np.arange(8))


def error_bound(x: np.ndarray, w: np.ndarray, block: int = 32) -> np.ndarray:
    """Per output, the most the int8 rounding of the activations can move it: each block of inputs
    (32; 256 for the K-quants' super-blocks) is scaled by amax / 127 and rounded, so each input
    moves at most half a step, and the output at most sum over blocks of (step / 2) * sum |w| over
    the block. [n, out]"""
    n, k = x.shape
    step = np.abs(x).reshape(n, k // block, block).max(-1) / 127  # [n, blocks]
    wsum = np.abs(w).reshape(w.shape[0], k // block, block).sum(-1)  # [out, blocks]
    return step @ wsum.T / 2


def variant_lib(v: build.Variant) -> ctypes.CDLL:
    return signatures.bind(ctypes.CDLL(str(build.build("qgemm", v))), "qgemm")


RUNNABLE = [v for v in build.variants() if build.runnable(v)]


@pytest.mark.parametrize("v", RUNNABLE, ids=lambda v: v.name)
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_products_stay_within_the_activation_rounding_bound(v, t):
    lib = variant_lib(v)
    assert lib.kv_q_isa().decode() == v.name
    w, ref = repacked(t, 45, 512, seed=1)
    rng = np.random.default_rng(2)
    for n in (1, 3, 9, 70):  # one row, a partial row tile, whole tiles, a second row chunk
        x = rng.standard_normal((n, 512)).astype(np.float32)
        x[:, 5] *= 40  # an outlier: its block's other inputs lose precision, the bound follows
        y = np.full((n, 45), 7.0, np.float32)
        qs, d, m = w.parts()
        rc = lib.kv_q_linear(w.fmt, n, 512, 45, x.ctypes.data, 512, None, -1.0, qs.data_ptr(), d.data_ptr(),
                             None if m is None else m.data_ptr(), None, y.ctypes.data, 45, 0, 2)
        assert rc == 0
        exact = x.astype(np.float64) @ ref.T.astype(np.float64)
        err = np.abs(y - exact)
        bound = error_bound(x, ref, 256 if t in KQUANTS else 32) + 1e-5 * np.abs(exact) + 1e-6
        assert (err <= bound).all(), f"{v.name} {t.name} n={n}: worst err/bound {(err / bound).max():.3f}"
        assert (err > 0).any()  # the activations really were rounded (the test can tell)


@pytest.mark.parametrize("v", RUNNABLE, ids=lambda v: v.name)
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_a_row_has_the_same_bits_in_any_row_count(v, t):
    """Batch invariance of the products: each row of a call of 2 (the decode path row by row), 3,
    5, 9 or 70 rows (partial and whole tiles, a second row chunk) is bitwise the row alone."""
    lib = variant_lib(v)
    w, _ = repacked(t, 45, 512, seed=5)
    qs, d, m = w.parts()
    x = np.random.default_rng(6).standard_normal((70, 512)).astype(np.float32)

    def run(rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        y = np.zeros((rows.shape[0], 45), np.float32)
        assert lib.kv_q_linear(w.fmt, rows.shape[0], 512, 45, rows.ctypes.data, 512, None, -1.0, qs.data_ptr(),
                               d.data_ptr(), None if m is None else m.data_ptr(), None, y.ctypes.data, 45, 0, 2) == 0
        return y

    alone = np.concatenate([run(x[i : i + 1]) for i in range(70)])
    for n in (2, 3, 5, 9, 70):
        assert np.array_equal(run(x[:n]), alone[:n]), f"{v.name} {t.name}: {n} rows"


@pytest.mark.parametrize("v", RUNNABLE, ids=lambda v: v.name)
def test_norm_scale_bias_and_accumulation_are_folded_in(v):
    lib = variant_lib(v)
    w, ref = repacked(T.Q4_1, 24, 256, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    y0 = rng.standard_normal((5, 24)).astype(np.float32)
    y = y0.copy()
    qs, d, m = w.parts()
    rc = lib.kv_q_linear(w.fmt, 5, 256, 24, x.ctypes.data, 256, g.ctypes.data, 1e-5, qs.data_ptr(), d.data_ptr(),
                         m.data_ptr(), bias.ctypes.data, y.ctypes.data, 24, 1, 2)
    assert rc == 0
    inv = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    want = y0 + (x * g * inv) @ ref.T + bias
    bound = error_bound(x * g, ref) * inv + 1e-4
    assert (np.abs(y - want) <= bound).all()


@pytest.mark.parametrize("name", KERNELS)
def test_every_variant_of_every_kernel_compiles(name):
    if build.compiler() is None:
        pytest.skip("no C compiler")
    for v in build.variants():  # those this CPU cannot run too: a variant must never rot unbuilt
        path = build.build(name, v)
        assert path.is_file() and v.name in path.name
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0  # nobody else may replace it


def test_setup_builds_every_library_for_the_variants_this_cpu_runs(capsys):
    """`python -m kvcache.kernels` (make setup-test runs it beside pip): every library the
    package loads, for every variant this CPU runs, and nothing for the others."""
    if build.compiler() is None:
        pytest.skip("no C compiler")
    assert set(build.LIBRARIES) == set(KERNELS)
    loaded = re.findall(r'_load\("(\w+)"\)', (build.SOURCES / "__init__.py").read_text())
    assert loaded and set(loaded) == set(build.LIBRARIES)  # what the package loads is what set-up builds
    assert build.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    runnable = [v.name for v in build.variants() if build.runnable(v)]
    assert sorted(ln.split()[1:3] for ln in lines) == sorted([n, f"({v})"] for v in runnable for n in KERNELS)
    for ln in lines:
        assert Path(ln.split()[3]).is_file()


def test_setup_for_make_run_builds_only_the_variant_kvcache_loads(capsys, monkeypatch):
    """`build.py --selected` (make setup runs it beside pip): every library, for the one variant
    kernels/__init__.py will load, KVCACHE_KERNEL_VARIANT honoured; an unknown one exits 2."""
    if build.compiler() is None:
        pytest.skip("no C compiler")
    for want in [None] + [v.name for v in build.variants() if build.runnable(v)][-1:]:  # the best, the last
        if want:
            monkeypatch.setenv("KVCACHE_KERNEL_VARIANT", want)
        assert build.main(["--selected"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert sorted(ln.split()[1:3] for ln in lines) == sorted([n, f"({build.select().name})"] for n in KERNELS)
    monkeypatch.setenv("KVCACHE_KERNEL_VARIANT", "nosuch")
    with pytest.raises(SystemExit) as e:
        build.main(["--selected"])
    assert e.value.code == 2 and "KVCACHE_KERNEL_VARIANT=nosuch" in capsys.readouterr().err


def test_kernels_leave_denormals_alone():
    """No kernel may switch on flush-to-zero for the whole process (-ffast-math's startup code)."""
    code = ("import ctypes, numpy as np, torch\n"
            "from kvcache.kernels import build\n"
            "for name in %r:\n"
            "    for v in build.variants():\n"
            "        if build.runnable(v): ctypes.CDLL(str(build.build(name, v)))\n"
            "tiny = np.float32(1e-40)\n"
            "print(float(tiny * np.float32(1.0)) > 0, float(torch.tensor(1e-40) * 1.0) > 0)\n") % (KERNELS,)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]


def test_kernel_folder_is_private_and_cc_may_carry_arguments(tmp_path):
    env = {**os.environ, "KVCACHE_HOME": str(tmp_path), "CC": "gcc -Wno-unused-function"}
    code = ("from kvcache.kernels import build\n"
            "print(build.build('pgemm', build.GENERIC))\n")  # the smallest library: a compile of a second
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    folder = tmp_path / "kernels"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o777)  # opened up by someone: tightened again before anything is loaded from it
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_kernel_that_does_not_compile_says_why(tmp_path, monkeypatch):
    if build.compiler() is None:
        pytest.skip("no C compiler")
    (tmp_path / "pgemm.c").write_text("int kv_packed_matmul(void) { return undeclared_name; }\n")
    monkeypatch.setattr(build, "SOURCES", tmp_path)
    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path / "home"))
    with pytest.raises(RuntimeError, match="did not compile: .*undeclared_name"):
        build.build("pgemm", build.GENERIC)


def test_a_variant_the_cpu_lacks_is_refused_by_name(monkeypatch):
    missing = [v for v in build.variants() if not build.runnable(v)]
    if not missing:
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv("KVCACHE_KERNEL_VARIANT", missing[0].name)
    with pytest.raises(RuntimeError, match="this CPU lacks"):
        build.select()
    monkeypatch.setenv("KVCACHE_KERNEL_VARIANT", "sse9")
    with pytest.raises(RuntimeError, match="unknown"):
        build.select()


FUSED_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from kvcache import LLM, kernels
from kvcache.models import layers
from kvcache.kernels import qweight
from kvcache.attention import backends
assert kernels.variant() == {variant!r}
ids = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12]

def check(path):
    llm = LLM(path, weights="q8", prefix=False)

    def run():
        r = llm.runner
        seq = r.new_sequence()
        out = [r.step([seq], [ids])[0]] + [r.step([seq], [[t]])[0] for t in (7, 21, 33, 2)]
        r.free(seq)
        return torch.stack(out)

    fused = run()  # every layer in one call a step (the layer stack)
    stack = llm.model.stack
    assert stack is not None
    runs = {{"stack": 0}}
    real_run = type(stack).run
    real_block, real_mlp, was_block = qweight.attn_block, qweight.fused_mlp, backends.attn_block
    def count_run(self, *a):
        runs["stack"] += 1
        return real_run(self, *a)
    type(stack).run = count_run
    try:
        assert torch.equal(fused, run()) and runs["stack"] >= 5, runs
        llm.model.stack = None  # a call per layer half
        calls = {{"block": 0, "mlp": 0}}
        def count_block(*a):
            calls["block"] += 1
            return real_block(*a)
        def count_mlp(*a):
            calls["mlp"] += 1
            return real_mlp(*a)
        backends.attn_block, qweight.fused_mlp = count_block, count_mlp
        again = run()
        assert calls["block"] > 0 and calls["mlp"] > 0, calls  # the decode steps took the fused kernels
        assert torch.equal(fused, again)
        backends.attn_block = lambda *a: False  # the same steps one kernel at a time
        qweight.fused_mlp = lambda *a, **k: False
        steps = run()
    finally:
        type(stack).run, backends.attn_block, qweight.fused_mlp = real_run, was_block, real_mlp
    return float((fused - steps).abs().max())

for path in {paths!r}:
    print(check(path))
"""


@pytest.mark.parametrize("v", RUNNABLE, ids=lambda v: v.name)
def test_fused_decode_layers_equal_their_steps(v, tiny_dir):
    """Every layer of a step in one call (kernels/dattn.c kv_q_layers) gives the very logits of a
    call per layer half (kv_q_attn_block, kv_q_mlp), and both those of the same steps taken one
    kernel at a time, on every variant; Llama, then Gemma 3 (its windows and norms) in the same
    process (the variant is chosen once a process)."""
    paths = [str(tiny_dir(family)[0]) for family in ("llama", "gemma3")]
    code = FUSED_CHECK.format(tests=str(os.path.dirname(__file__)), variant=v.name, paths=paths)
    p = subprocess.run(forkserve.python_command("-c", code), capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVCACHE_KERNEL_VARIANT": v.name})
    assert p.returncode == 0, p.stderr[-2000:]
    gaps = [float(x) for x in p.stdout.split()[-2:]]
    assert len(gaps) == 2 and max(gaps) < 2e-2, gaps  # int8 activations: the q8 matrix's bound for path noise


def test_layer_stack_refuses_bad_tables_before_touching_anything(tiny_dir):
    """kv_q_layers checks every layer's weights, pool and group before it computes: a bad format, a
    projection in too many parts, a group index outside the groups, too many groups or no pool
    layer is refused (1) with the
    hidden state, the pool and the caller's arrays as they were; the wrapper says so in one line."""
    from kvcache import LLM
    from kvcache.kernels.qweight import LayerStack, _lib

    llm = LLM(str(tiny_dir("llama")[0]), weights="q8", prefix=False)
    stack = llm.model.stack
    assert isinstance(stack, LayerStack)
    hq, hkv, d = stack.heads
    n_layers = stack.table.shape[0]
    pool = torch.randn(2, hkv, 16, d)
    x = torch.randn(1, stack.hidden)
    cos, sin = torch.ones(1, d), torch.zeros(1, d)
    slots, tables, lens = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    row0, nnew = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    groups = torch.tensor([[slots.data_ptr(), tables.data_ptr(), 1, lens.data_ptr(), 0, 16, 16]])

    def call(table, kvs, groups):
        return _lib().kv_q_layers(1, stack.hidden, x.data_ptr(), x.stride(0), n_layers, table.data_ptr(),
                                  kvs.data_ptr(), hq, hkv, d, d, stack.inter, stack.act, *stack.mixture, cos.data_ptr(),
                                  sin.data_ptr(), None, None, 1e-6, 1.0, groups.shape[0], groups.data_ptr(), 1,
                                  row0.data_ptr(), nnew.data_ptr(), 1)

    kvs = torch.tensor([[pool.data_ptr(), 0]] * n_layers)
    x0, pool0 = x.clone(), pool.clone()
    bad_fmt, bad_parts = stack.table.clone(), stack.table.clone()
    bad_fmt[-1, 1] = 99  # the last layer's q|k|v: its first part's format
    bad_parts[0, 0] = 4  # the first layer's q|k|v in more parts than a projection holds
    bad_group, no_pool = kvs.clone(), kvs.clone()
    bad_group[-1, 1] = 1
    no_pool[0, 0] = 0
    for table, k, g in ((bad_fmt, kvs, groups), (bad_parts, kvs, groups), (stack.table, bad_group, groups),
                        (stack.table, no_pool, groups),
                        (stack.table, kvs, groups.repeat(5, 1))):
        assert call(table, k, g) == 1
        assert torch.equal(x, x0) and torch.equal(pool, pool0)
    assert call(stack.table, kvs, groups) == 0 and not torch.equal(x, x0)  # the same call, well formed, runs
    assert torch.equal(pool[:, :, 1:], pool0[:, :, 1:])  # and writes the new K/V at its slot only


SCRATCH_CHECK = """
import os, threading, time
from pathlib import Path
import torch
from gguf import GGMLQuantizationType as T
from kvcache.kernels import release_scratch
from kvcache.kernels.qweight import FORMAT_OF, QWeight

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

w = QWeight(FORMAT_OF[int(T.Q4_0)], 16, 4096).seal()
x = torch.randn(8192, 4096)
w.forward(x[:8])  # loads the library; its scratch is small
release_scratch()
base = rss()
w.forward(x)
kept = rss()
w.forward(x)
again = rss()
release_scratch()
released = rss()
t = threading.Thread(target=w.forward, args=(x,))
t.start()
t.join()
deadline = time.monotonic() + 5  # join returns before the OS thread has run its destructors
while rss() - base >= 16 and time.monotonic() < deadline:
    time.sleep(0.05)
print(kept - base, again - kept, kept - released, rss() - base)
"""


def test_kernel_scratch_is_kept_between_calls_and_given_back():
    """The products keep their scratch (here 56 MiB of int8 activations) for the calling thread's
    next call instead of mapping it afresh; release_scratch and the thread's end give it back.
    Measured in a process of its own: a test worker's other threads and caches move its RSS."""
    p = subprocess.run([sys.executable, "-c", SCRATCH_CHECK], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    kept, again, released, after_thread = map(float, p.stdout.split())
    assert kept > 40  # the scratch stays resident after the call
    assert again < 16  # the second call reuses it
    assert released > 40  # release_scratch gives it back
    assert after_thread < 16  # the thread's own scratch went with the thread


def test_mxfp4_shares_no_format_with_another_type():
    """MXFP4's codes are held only in its own format: beside any other type the parts stay apart
    (a QStack), where a shared nibble format with minimums could not hold them."""
    assert common_format([int(T.MXFP4), int(T.MXFP4)]) == FORMAT_OF[int(T.MXFP4)]
    for other in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K):
        assert common_format([int(T.MXFP4), int(other)]) is None, other.name
