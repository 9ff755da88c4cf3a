"""Quantized projection weights in memory: GGUF blocks repacked for the int8 kernels (kernels/qgemm.c).

A ``QWeight`` is an nn.Linear-oriented weight [out, K] in one of the repacked formats of
kernels/qformat.h: integer values, interleaved 16 output rows at a time, with a scale (and for
unsigned formats a minimum) per block of 32 inputs (16 for Q6_K-like types); Q4_K, Q5_K, Q6_K, Q2_K
and Q3_K (as Q6_K: its 3-bit values and six-bit scales fit Q6_K's) keep the file's integer scales
beside its fp16 super-block scales instead. It stands for exactly the numbers the file holds; only
the activations are rounded when it multiplies them (to int8 per block of 32; per super-block of
256 for the K-quant formats). ``in_scale`` is a norm weight folded in: it multiplies the input, because it
cannot be folded into the quantized values the way fp32 weights take it.

A ``QStack`` is a fused projection whose parts could not share a format (Gemma 3's q and k are
Q5_0, its v Q8_0): each part fills its own columns of the output.

GGUF types map to formats (``FORMAT_OF``); parts of different types share the narrowest format
that holds them all (``common_format``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcache import kernels
from kvcache.errors import ModelLoadError

# kernels/qformat.h
(Q4_F16, Q4_F32, S8_F16, S8_F32_16, U8_F16, U8_F32, U8_F32_16, Q5_F16, Q5_F32, Q4O_F16, Q5O_F16, Q4_KS,
 Q5_KS, Q6_KS, Q2_KS, MX4_F16) = range(16)
FORMAT_NAMES = ("q4_f16", "q4_f32", "s8_f16", "s8_f32_16", "u8_f16", "u8_f32", "u8_f32_16", "q5_f16", "q5_f32",
                "q4o_f16", "q5o_f16", "q4_ks", "q5_ks", "q6_ks", "q2_ks", "mx4_f16")
_NIBBLES = (1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1)
_HIGH = (0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 0, 1, 2, 0, 0)  # bits beside the nibbles: a fifth, or bits 4 and 5
_SIGNED = (0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
_F16 = (1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1)
_NS = (1, 1, 1, 2, 1, 1, 2, 1, 1, 1, 1, 1, 1, 2, 2, 1)
# no stored minimum: it is -offset * d (Q4_0, Q5_0; Q6_K's values are offset by 32; MXFP4's codes
# stand for bytes 0 .. 24 offset by 12)
_OFFSET = (0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 16, 0, 0, 32, 0, 12)
# the file's K-quant scales as integers: d is [G, nb / 8, _KS_BYTES] bytes per super-block (qformat.h), no m
_KS = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 0)
_KS_BYTES = {1: 256, 2: 288, 3: 576}
GROUP = 16  # output rows interleaved together (KVQ_NC)

# GGUF (ggml) type ids -> the format that holds them most compactly
GGML = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
        "Q6_K": 14, "MXFP4": 39}
FORMAT_OF = {2: Q4O_F16, 3: Q4_F16, 6: Q5O_F16, 7: Q5_F16, 8: S8_F16, 10: Q2_KS, 11: Q6_KS, 12: Q4_KS,
             13: Q5_KS, 14: Q6_KS, 39: MX4_F16}
# the same values with fp32 scales, beside other types
_KS_FALLBACK = {Q4_KS: Q4_F32, Q5_KS: Q5_F32, Q6_KS: S8_F32_16, Q2_KS: U8_F32_16}


_MX4_E = (104, 143)  # qpack.c's MX4_EMIN, MX4_EMAX: the exponents whose 2^(e - 128) an fp16 holds


def _mxfp4_scale_outside(raw: np.ndarray) -> int | None:
    """The exponent byte of the first MXFP4 block of ``raw`` [rows, n * 17] that the repacker refuses
    (a scale no fp16 holds, on codes that are not all +0 and -0), for its error; None if none is."""
    blk = raw.reshape(raw.shape[0], -1, 17)
    e, codes = blk[:, :, 0], blk[:, :, 1:]
    bad = ((e < _MX4_E[0]) | (e > _MX4_E[1])) & ((codes & 0x77) != 0).any(axis=2)
    return int(e[bad][0]) if bad.any() else None


def common_format(types: Sequence[int]) -> int | None:
    """The narrowest format holding every GGUF type in ``types``; None when signed and unsigned
    types mix, K-quants of different kinds, or MXFP4 beside another type (its codes are held only
    in its own format): they go to separate parts of a QStack."""
    fmts = {FORMAT_OF[t] for t in types}
    if len(fmts) == 1:
        return fmts.pop()
    if MX4_F16 in fmts:
        return None
    if fmts <= {Q4_KS, Q5_KS}:  # Q4_K beside Q5_K: the 5-bit K-quant format holds both
        return Q5_KS
    if all(_KS[f] for f in fmts):  # other K-quants side by side: each part keeps its own compact format
        return None
    fmts = {_KS_FALLBACK.get(f, f) for f in fmts}
    if len(fmts) == 1:
        return fmts.pop()
    signed = {_SIGNED[f] for f in fmts}
    if len(signed) > 1:
        return None
    if signed == {1}:
        return S8_F32_16
    f16 = all(_F16[f] for f in fmts)
    if all(_NIBBLES[f] for f in fmts):  # 4- and 5-bit types
        if any(_HIGH[f] for f in fmts):
            return Q5_F16 if f16 else Q5_F32
        return Q4_F16 if f16 else Q4_F32
    return U8_F32_16 if any(_NS[f] == 2 for f in fmts) else (U8_F16 if f16 else U8_F32)


class QWeight:
    """A repacked quantized weight [out, K] (see the module docstring)."""

    def __init__(self, fmt: int, out: int, k: int, in_scale: torch.Tensor | None = None,
                 arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> None:
        """Zeroed arrays to fill with ``put_gguf``; or ``arrays`` (qs, d, m) already filled, such
        as views of a mapped file (models/repacked.py), checked for the format's shapes."""
        if k % 32:
            raise ModelLoadError(f"a quantized weight needs a multiple of 32 inputs, got {k}")
        self.fmt, self.out, self.k = fmt, out, k
        if _KS[fmt] and k % 256:
            raise ModelLoadError(f"a K-quant weight needs a multiple of 256 inputs, got {k}")
        g, nb, ns = -(-out // GROUP), k // 32, _NS[fmt]
        qb = 256 + 64 * _HIGH[fmt] if _NIBBLES[fmt] else 512  # bytes of values per group-block
        dshape = (g, nb // 8, _KS_BYTES[_KS[fmt]]) if _KS[fmt] else (g, nb, ns, GROUP)
        ndt = np.uint8 if _KS[fmt] else np.float16 if _F16[fmt] else np.float32  # the scales' dtype
        if arrays is not None:
            dt = torch.from_numpy(np.empty(0, ndt)).dtype
            qs, d, m = arrays
            if (qs.shape != (g, nb, qb) or qs.dtype != torch.uint8 or d.shape != dshape or d.dtype != dt
                    or (m is None) != bool(_SIGNED[fmt] or _OFFSET[fmt] or _KS[fmt])
                    or (m is not None and (m.shape != d.shape or m.dtype != dt))):
                raise ModelLoadError(f"stored arrays do not fit a {FORMAT_NAMES[fmt]} weight [{out}, {k}]")
            self.qs, self.d, self.m = qs, d, m
            self.in_scale = in_scale
            self._fn, self._ptrs, self._scale_ptr = None, (), None
            return
        # zeroed by the allocator (calloc), not by a parallel fill: loading stays quick on a busy machine
        self.qs = torch.from_numpy(np.zeros((g, nb, qb), np.uint8))  # [G, nb, QB]
        self.d = torch.from_numpy(np.zeros(dshape, ndt))  # [G, nb, NS, 16] scales ([G, nb / 8, 320 or 576] K-quant)
        self.m = (None if _SIGNED[fmt] or _OFFSET[fmt] or _KS[fmt]  # minimums
                  else torch.from_numpy(np.zeros((g, nb, ns, GROUP), ndt)))
        self.in_scale = in_scale  # [K] fp32 or None
        self._fn, self._ptrs, self._scale_ptr = None, (), None  # set by seal()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out, self.k)

    @property
    def nbytes(self) -> int:
        extra = self.in_scale.numel() * 4 if self.in_scale is not None else 0
        return self.qs.numel() + self.d.numel() * self.d.element_size() + (
            self.m.numel() * self.m.element_size() if self.m is not None else 0) + extra

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.qs, self.d, self.m

    # -- filling ---------------------------------------------------------------------------------
    def put_gguf(self, ggml_type: int, raw: np.ndarray, dst_rows: np.ndarray) -> None:
        """Store GGUF rows ``raw`` [rows, bytes per row] (type ``ggml_type``) as rows ``dst_rows``."""
        lib = _lib()
        raw = np.ascontiguousarray(raw)
        dst = np.ascontiguousarray(dst_rows, dtype=np.int64)
        rc = lib.kv_q_repack(ggml_type, self.fmt, raw.shape[0], self.k, raw.ctypes.data, raw.shape[1],
                             dst.ctypes.data, self.out, self.qs.data_ptr(), self.d.data_ptr(),
                             None if self.m is None else self.m.data_ptr())
        if rc == 3 and ggml_type == GGML["MXFP4"] and (e := _mxfp4_scale_outside(raw)) is not None:
            raise ModelLoadError(f"an MXFP4 block's scale 2^{e - 127} is outside what kvcache holds exactly "
                                 "(2^-23 .. 2^16)")
        if rc:
            why = {1: "bad sizes", 2: "the format cannot hold this type", 3: "a value outside the type's range"}
            raise ModelLoadError(f"cannot repack GGUF type {ggml_type} into {self.format_name}: {why.get(rc, rc)}")

    # -- reading ---------------------------------------------------------------------------------
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [N] of the weight as fp32 [N, K] (a tied embedding's lookup)."""
        ids = ids.to(torch.int64).contiguous()
        y = torch.empty(ids.shape[0], self.k)
        rc = _lib().kv_q_dequant(self.fmt, self.k, self.out, self.qs.data_ptr(), self.d.data_ptr(),
                                 None if self.m is None else self.m.data_ptr(), ids.data_ptr(), ids.shape[0],
                                 y.data_ptr(), self.k)  # checks every id against the rows it has
        if rc:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out):
                raise IndexError(f"row index out of range for a weight of {self.out} rows")
            raise RuntimeError("dequantizing rows of a quantized weight failed")
        return y

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 [out, K] (tests and the fp32 reference)."""
        return self.rows(torch.arange(self.out))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, eps: float | None = None,
                in_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                accumulate: bool = False) -> torch.Tensor:
        """x [N, K] -> (x * in_scale / rms(x)) @ W^T + bias: [N, out], written into ``out`` when
        given (added to it with ``accumulate``: a residual). ``eps`` None: no RMS division.
        ``in_scale`` defaults to the norm weight folded in at load."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"a quantized projection takes fp32 CPU input [N, {self.k}], got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(1) != 1:
            x = x.contiguous()
        n = x.shape[0]
        if out is None:
            y = torch.empty(n, self.out)
        elif (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != n or out.shape[1] < self.out
              or out.stride(1) != 1 or out.device.type != "cpu"):
            raise ValueError(f"the output of a quantized projection must be fp32 CPU [{n}, {self.out}] with unit "
                             "column stride")
        else:
            y = out
        scale = self._scale_ptr if in_scale is None else _vector_ptr(in_scale, self.k, "norm weight")
        b = None if bias is None else _vector_ptr(bias, self.out, "bias")
        rc = self._fn(self.fmt, n, self.k, self.out, x.data_ptr(), x.stride(0), scale, -1.0 if eps is None else eps,
                      *self._ptrs, b, y.data_ptr(), y.stride(0), int(accumulate), torch.get_num_threads())
        if rc == 4:
            raise MemoryError("the quantized projection could not allocate its activation buffer")
        if rc:
            raise RuntimeError(f"the quantized projection kernel refused its inputs ({rc})")
        return y

    def seal(self) -> "QWeight":
        """Check the stored tensors once and bind the kernel for the hot path (after filling)."""
        if self.in_scale is not None:
            self.in_scale = self.in_scale.detach().float().contiguous()
            if self.in_scale.shape != (self.k,):
                raise ModelLoadError(f"a norm weight of {tuple(self.in_scale.shape)} for {self.k} inputs")
        self._fn = _lib().kv_q_linear
        self._ptrs = (self.qs.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr())
        self._scale_ptr = None if self.in_scale is None else self.in_scale.data_ptr()
        return self


class QStack:
    """A fused projection of parts with different formats: [sum of parts' out, K]."""

    def __init__(self, parts: list[QWeight]) -> None:
        self.parts_ = parts
        self.out, self.k = sum(p.out for p in parts), parts[0].k
        self.offsets = np.cumsum([0] + [p.out for p in parts]).tolist()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out, self.k)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts_)

    @property
    def format_name(self) -> str:
        return "+".join(p.format_name for p in self.parts_)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts_])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, eps: float | None = None,
                in_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                accumulate: bool = False) -> torch.Tensor:
        y = out if out is not None else torch.empty(x.shape[0], self.out)
        for p, a, b in zip(self.parts_, self.offsets, self.offsets[1:]):
            p.forward(x, None if bias is None else bias[a:b], eps, in_scale, y[:, a:b], accumulate)
        return y


MAX_PARTS = 3  # qgemm.h's KV_MAXPARTS: weights side by side in one fused projection


def proj_parts(w: object) -> list[QWeight]:
    """The weights a projection is made of, side by side (a QWeight, or a QStack's parts: a fused
    q|k|v or gate|up whose tensors came in different types); [] when it is neither, has more parts
    than the fused kernels take, or its parts do not share one input scale (the norm folded in)."""
    parts = [w] if type(w) is QWeight else list(w.parts_) if type(w) is QStack else []  # type: ignore[attr-defined]
    if not 1 <= len(parts) <= MAX_PARTS or any(type(p) is not QWeight for p in parts):
        return []
    first = parts[0].in_scale
    if any((p.in_scale is None) != (first is None) or (first is not None and not torch.equal(p.in_scale, first))
           for p in parts[1:]):
        return []
    return parts


def proj_fields(parts: list[QWeight], bias: int) -> list[int]:
    """qgemm.h's KVP_ fields of a projection: its parts, each one's format, arrays and columns, then
    its bias's address (0: none)."""
    f = [len(parts)]
    for p in parts:
        f += [p.fmt, *(a or 0 for a in p._ptrs), p.out]
    return f + [0] * (5 * (MAX_PARTS - len(parts))) + [bias]


def _projection(w: object, bias: torch.Tensor | None) -> tuple[list[QWeight], torch.Tensor | None]:
    """``proj_parts(w)`` and its fields with ``bias`` as a tensor for the per-half calls, kept on the
    weight from call to call (a recompute makes those calls for every layer of every step);
    ([], None) for anything but a QWeight or a QStack."""
    if type(w) is not QWeight and type(w) is not QStack:
        return [], None
    key = 0 if bias is None else _vector_ptr(bias, w.out, "bias")  # type: ignore[attr-defined]
    kept = w.__dict__.setdefault("_projections", {})
    hit = kept.get(key)
    if hit is None:
        parts = proj_parts(w)
        hit = kept[key] = (parts, torch.tensor(proj_fields(parts, key), dtype=torch.int64) if parts else None)
    return hit


def _mlp_weights(x: torch.Tensor, gate_up: object, down: object, act: int | None, gate_up_bias: torch.Tensor | None,
                 down_bias: torch.Tensor | None) -> tuple | None:
    """(gate_up's parts, its fields, down's parts, its fields) when a gated MLP of these weights runs
    natively on rows x [N, H] (both quantized, down in one part, the shapes fitting, an activation
    kernel); None otherwise."""
    if act is None:
        return None
    (pg, gu), (pd, dn) = _projection(gate_up, gate_up_bias), _projection(down, down_bias)
    if (gu is None or dn is None or len(pd) != 1 or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu
            or x.stride(1) != 1 or x.shape[1] != gate_up.k  # type: ignore[attr-defined]
            or down.out != gate_up.k or 2 * down.k != gate_up.out):  # type: ignore[attr-defined]
        return None
    return pg, gu, pd, dn


def fused_mlp(x: torch.Tensor, gate_up: object, down: object, act: int | None, eps: float,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              post_norm: torch.Tensor | None = None, post_eps: float = 0.0) -> bool:
    """x [N, H] += post_norm(down(act(gate) * up)) with [gate | up] = gate_up(rms_norm(x)) in one
    native call (kernels/qgemm.c kv_q_mlp), when both weights are quantized (gate_up may be a QStack,
    see ``proj_parts``) and the activation has a kernel (``act``: 0 silu, 1 tanh GELU; None: none).
    False: not done here."""
    fit = _mlp_weights(x, gate_up, down, act, gate_up_bias, down_bias)
    if fit is None:
        return False
    pg, gu, pd, dn = fit
    rc = _lib().kv_q_mlp(
        x.shape[0], pg[0].k, pd[0].k, x.data_ptr(), x.stride(0), pg[0]._scale_ptr, eps, gu.data_ptr(), dn.data_ptr(),
        act, None if post_norm is None else _vector_ptr(post_norm, pd[0].out, "norm weight"), post_eps,
        torch.get_num_threads())
    if rc == 4:
        raise MemoryError("the quantized MLP could not allocate its activation buffers")
    if rc:
        raise RuntimeError(f"the quantized MLP kernel refused its inputs ({rc})")
    return True


ACT_SWIGLU_OAI = 2  # gpt-oss's clamped SwiGLU in kernels/qgemm.c glu_row (limit 7, alpha 1.702)


def expert_mlp(h: torch.Tensor, gate_up: object, down: object, act: int | None,
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """down(act(gate) * up) (+ the biases) of [gate | up] = gate_up(h), h [n, H] taken as it is (no
    norm) -> [n, H], in one native call (kernels/qgemm.c kv_q_expert) when both weights are quantized
    and the activation has a kernel (0 silu, 1 tanh GELU, ACT_SWIGLU_OAI); None: not done here. A
    row's result does not depend on the other rows."""
    fit = _mlp_weights(h, gate_up, down, act, gate_up_bias, down_bias)
    if fit is None:
        return None
    pg, gu, pd, dn = fit
    y = torch.empty(h.shape[0], down.out)  # type: ignore[attr-defined]
    rc = _lib().kv_q_expert(h.shape[0], pg[0].k, pd[0].k, h.data_ptr(), h.stride(0), gu.data_ptr(), dn.data_ptr(),
                            act, y.data_ptr(), torch.get_num_threads())
    if rc == 4:
        raise MemoryError("the quantized expert could not allocate its activation buffers")
    if rc:
        raise RuntimeError(f"the quantized expert kernel refused its inputs ({rc})")
    return y


def attn_block(x: torch.Tensor, weights: tuple, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor,
               qk_norm: torch.Tensor | None, eps: float, scale: float, post_norm: torch.Tensor | None,
               flat: torch.Tensor, page_size: int, slots: torch.Tensor,
               rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], window: int = 0) -> bool:
    """One step's attention half for every new token of every sequence, in one native call:
    x [N, H] += o(attend(rope(norm(qkv(rms_norm(x)))))) with the new K/V written into the pool layer
    ``flat`` [2, Hkv, S, D] at ``slots`` [N]; ``rows``: (page tables [B, P], first row, new tokens,
    lengths [B]) of the sequences; ``window``: a sliding window (0: none). ``weights``: (qkv, qkv
    bias, o, o bias); False when they are not quantized (qkv may be a QStack, see ``proj_parts``)
    or the inputs do not fit the kernel (nothing was done then)."""
    qkv, qkv_b, o, o_b = weights
    hq, hkv, d = heads
    tables, row0, nnew, lens = rows
    n = x.shape[0]
    (pq, wq), (po, wo) = _projection(qkv, qkv_b), _projection(o, o_b)
    if (wq is None or wo is None or len(po) != 1 or x.dtype != torch.float32 or x.dim() != 2
            or not x.is_cpu or x.stride(1) != 1 or x.shape[1] != qkv.k or o.out != qkv.k or o.k != hq * d
            or qkv.out != (hq + 2 * hkv) * d or flat.dtype != torch.float32 or not flat.is_contiguous()
            or flat.shape[1] != hkv or flat.shape[3] != d or cos.shape[0] != n or not cos.is_contiguous()
            or not sin.is_contiguous() or (qk_norm is not None and not qk_norm.is_contiguous())
            or slots.shape[0] != n):
        return False
    rot = cos.numel() // n
    rc = _lib().kv_q_attn_block(
        n, qkv.k, x.data_ptr(), x.stride(0), pq[0]._scale_ptr, eps, wq.data_ptr(), hq, hkv, d, rot, cos.data_ptr(),
        sin.data_ptr(), None if qk_norm is None else qk_norm.data_ptr(), flat.data_ptr(), page_size,
        flat.shape[2], slots.data_ptr(), tables.data_ptr(), tables.shape[1], tables.shape[0], row0.data_ptr(),
        nnew.data_ptr(), lens.data_ptr(), window, scale, wo.data_ptr(),
        None if post_norm is None else _vector_ptr(post_norm, o.out, "norm weight"), eps, torch.get_num_threads())
    if rc == 4 or rc == 2:
        raise MemoryError("the fused attention could not allocate its buffers")
    if rc:
        raise RuntimeError(f"the fused attention kernel refused its inputs ({rc})")
    return True


@dataclass(frozen=True)
class Mixture:
    """A mixture of experts in place of every layer's MLP, as ``LayerStack`` takes it: ``experts``
    of ``size`` each, ``top_k`` a row, their weights renormalised when ``norm``; per layer (the
    router's norm weight [H], its table [H, Ep] (kernels/qmoe.py router_table), every expert's
    gate_up and down fields [E, KVP_N] (qmoe.py expert_table))."""

    experts: int
    top_k: int
    size: int
    norm: bool
    layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


class LayerStack:
    """Every layer of a model whose projections are quantized (``proj_parts``), run in one native
    call a forward (kernels/dattn.c kv_q_layers): the steps of ``attn_block`` then ``fused_mlp``
    (or, for a mixture of experts, kernels/qmoe.py ``moe_row``'s for one row, ``route`` then
    ``moe_rows``' for more) layer by layer,
    so the same bits, without leaving the threads' parallel region or coming back to Python between
    layers. The weights' addresses sit in one int64 table [L, 77] built once; ``of`` gives None when
    a layer does not fit."""

    MAX_GROUPS = 4  # dattn.c's MAXG: layer groups (windows) one call takes

    def __init__(self, table: torch.Tensor, keep: list, heads: tuple[int, int, int], hidden: int,
                 inter: int, act: int, mixture: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
        self.table, self._keep = table, keep  # keep: the tensors whose addresses the table holds
        self.heads, self.hidden, self.inter, self.act = heads, hidden, inter, act
        self.mixture = mixture  # (E, Ep, k, norm); E 0: dense MLPs

    @classmethod
    def of(cls, layers: Sequence[tuple], heads: tuple[int, int, int], act: int | None,
           mixture: Mixture | None = None) -> "LayerStack | None":
        """``layers``: per layer (qkv, qkv bias, q/k norm, o, o bias, post-attention norm, gate_up,
        gate_up bias, down, down bias, post-feedforward norm, rotary table 0 or 1); with a
        ``mixture``, gate_up, down and their biases are None (its layers take their place)."""
        hq, hkv, d = heads
        if act is None or not layers or (mixture is not None and len(mixture.layers) != len(layers)):
            return None
        rows, keep = [], []
        hidden = getattr(layers[0][0], "k", 0)
        inter = mixture.size if mixture is not None else getattr(layers[0][8], "k", 0)
        for i, (qkv, qkv_b, qk_norm, o, o_b, post_attn, gu, gu_b, dn, dn_b, post_ff, rope) in enumerate(layers):
            pq, po = proj_parts(qkv), proj_parts(o)
            if (not pq or len(po) != 1 or qkv.k != hidden or o.out != hidden or qkv.out != (hq + 2 * hkv) * d
                    or o.k != hq * d or rope not in (0, 1)):
                return None
            if qk_norm is not None and (qk_norm.dtype != torch.float32 or not qk_norm.is_contiguous()
                                        or qk_norm.numel() != (hq + hkv) * d):
                return None
            vec = [(qkv_b, qkv.out, "bias"), (o_b, hidden, "bias"), (post_attn, hidden, "norm weight"),
                   (post_ff, hidden, "norm weight")]
            addr = [0 if t is None else _vector_ptr(t, n, what) for t, n, what in vec]
            keep += [t for t in (qkv_b, o_b, post_attn, post_ff, qk_norm) if t is not None]
            if mixture is None:
                mlp, g_mlp, experts = _dense_fields(gu, gu_b, dn, dn_b, hidden, inter, keep), 0, [0, 0, 0]
                if mlp is None:
                    return None
                g_mlp = proj_parts(gu)[0]._scale_ptr or 0
            else:
                tables = _mixture_fields(mixture, mixture.layers[i], hidden, keep)
                if tables is None:
                    return None
                mlp, (g_mlp, *experts) = [0] * (2 * len(proj_fields([], 0))), tables
            # dattn.c's KVL_ order: the four projections, the norms and the rotary table, the mixture's tables
            rows.append([*proj_fields(pq, addr[0]), *proj_fields(po, addr[1]), *mlp, pq[0]._scale_ptr or 0,
                         0 if qk_norm is None else qk_norm.data_ptr(), addr[2], g_mlp, addr[3], rope, *experts])
        if not kernels_available():  # asked last: fp32 weights never load the library for it
            return None
        shape = (0, 0, 0, 0) if mixture is None else (
            mixture.experts, mixture.layers[0][1].shape[1], mixture.top_k, int(mixture.norm))
        return cls(torch.tensor(rows, dtype=torch.int64), keep, heads, hidden, inter, act, shape)

    def run(self, ctx: object, x: torch.Tensor, ropes: Sequence[tuple[torch.Tensor, torch.Tensor]], eps: float,
            scale: float) -> bool:
        """x [N, H] through every layer in place, over the pages ``ctx`` names for them
        (``ctx.layer_pages()``); ``ropes``: the (cos, sin) tables [N, ...] of rotary table 0 (and
        1). False when the context has no such pages or the inputs do not fit (nothing done)."""
        pages = getattr(ctx, "layer_pages", None)
        pages = pages() if pages is not None else None
        if (pages is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1
                or x.shape[1] != self.hidden or len(pages.kvs) != self.table.shape[0]
                or not 1 <= pages.groups.shape[0] <= self.MAX_GROUPS):
            return False
        hq, hkv, d = self.heads
        for flat in pages.flats:
            if (flat.dtype != torch.float32 or not flat.is_contiguous() or flat.dim() != 4 or flat.shape[1] != hkv
                    or flat.shape[3] != d):
                return False
        n = x.shape[0]
        cs = [(c.reshape(n, -1), s_.reshape(n, -1)) for c, s_ in ropes]
        if any(not c.is_contiguous() or not s_.is_contiguous() or c.shape != s_.shape or c.shape != cs[0][0].shape
               for c, s_ in cs):
            return False
        cos1, sin1 = cs[1] if len(cs) > 1 else (None, None)
        rc = _lib().kv_q_layers(
            n, self.hidden, x.data_ptr(), x.stride(0), self.table.shape[0], self.table.data_ptr(),
            pages.kvs.data_ptr(), hq, hkv, d, cs[0][0].shape[1], self.inter, self.act, *self.mixture,
            cs[0][0].data_ptr(), cs[0][1].data_ptr(), None if cos1 is None else cos1.data_ptr(),
            None if sin1 is None else sin1.data_ptr(), eps, scale, pages.groups.shape[0], pages.groups.data_ptr(),
            pages.batch, pages.row0.data_ptr(), pages.nnew.data_ptr(), torch.get_num_threads())
        if rc == 4 or rc == 2:
            raise MemoryError("the fused layers could not allocate their buffers")
        if rc:
            raise RuntimeError(f"the fused layers kernel refused its inputs ({rc})")
        return True


def _dense_fields(gu: object, gu_b: torch.Tensor | None, dn: object, dn_b: torch.Tensor | None, hidden: int,
                  inter: int, keep: list) -> list[int] | None:
    """A dense MLP's gate_up and down fields (KVL_GU, KVL_DN), or None when they do not fit."""
    pg, pd = proj_parts(gu), proj_parts(dn)
    if (not pg or len(pd) != 1 or gu.k != hidden or gu.out != 2 * inter  # type: ignore[attr-defined]
            or dn.k != inter or dn.out != hidden):  # type: ignore[attr-defined]
        return None
    ab = [0 if t is None else _vector_ptr(t, n, "bias") for t, n in ((gu_b, 2 * inter), (dn_b, hidden))]
    keep += [t for t in (gu_b, dn_b) if t is not None]
    return [*proj_fields(pg, ab[0]), *proj_fields(pd, ab[1])]


def _mixture_fields(mixture: Mixture, layer: tuple, hidden: int, keep: list) -> list[int] | None:
    """A mixture layer's router norm, router table and experts' tables (KVL_G_MLP, KVL_ROUTER,
    KVL_EXPERTS_GU, KVL_EXPERTS_DN), or None when they do not fit."""
    norm, router, gu, dn = layer
    fields = len(proj_fields([], 0))
    if (router.dtype != torch.float32 or not router.is_contiguous() or router.dim() != 2
            or router.shape[0] != hidden or router.shape[1] % 16 or router.shape[1] < mixture.experts
            or any(t.dtype != torch.int64 or not t.is_contiguous() or tuple(t.shape) != (mixture.experts, fields)
                   for t in (gu, dn))
            or not 1 <= mixture.top_k <= min(32, mixture.experts)):
        return None
    keep += [norm, router, gu, dn]
    return [_vector_ptr(norm, hidden, "norm weight"), router.data_ptr(), gu.data_ptr(), dn.data_ptr()]


def _vector_ptr(t: torch.Tensor, n: int, what: str) -> int:
    """The address of a contiguous fp32 CPU vector of n values (a norm weight or a bias)."""
    if t.dtype != torch.float32 or t.dim() != 1 or t.shape[0] != n or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"a quantized projection's {what} must be a contiguous fp32 CPU vector of {n}")
    return t.data_ptr()


def _lib():
    lib = kernels.qgemm()
    if lib is None:
        raise ModelLoadError("quantized weights need the native kernels (a C compiler); load with weights='fp32'")
    return lib


def kernels_available() -> bool:
    return kernels.qgemm() is not None
