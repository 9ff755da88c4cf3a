"""The exported kernel functions' C signatures, declared once: the ctypes bindings are generated
from this table (``bind``), and tests/test_kernel_signatures.py checks it against the prototypes
in the C sources (names, types, order, return type; every exported ``kv_`` function listed).

An entry names the library that exports the symbol (build.py's ``sources(lib)`` hold its
definition), its C return type and its parameters as (name, C type), in the prototype's order.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple


class Signature(NamedTuple):
    lib: str  # the library exporting it: qgemm, qattn or pgemm
    symbol: str
    ret: str  # the C return type
    params: tuple[tuple[str, str], ...]  # (name, C type), in the prototype's order


_TABLE = (
    # qgemm.c: quantized projections
    Signature("qgemm", "kv_q_isa", "const char *", ()),
    Signature("qgemm", "kv_scratch_release", "void", ()),
    Signature("qgemm", "kv_q_linear", "int", (
        ("fmt", "int"), ("n", "int"), ("K", "int"), ("out", "int"), ("x", "const float *"), ("ldx", "int64_t"),
        ("g", "const float *"), ("eps", "float"), ("qs", "const uint8_t *"), ("d", "const void *"),
        ("m", "const void *"), ("bias", "const float *"), ("y", "float *"), ("ldy", "int64_t"),
        ("accumulate", "int"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_mlp", "int", (
        ("n", "int"), ("H", "int"), ("I", "int"), ("x", "float *"), ("ldx", "int64_t"), ("g_in", "const float *"),
        ("eps", "float"), ("gu", "const int64_t *"), ("dn", "const int64_t *"), ("act", "int"),
        ("post_w", "const float *"), ("post_eps", "float"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_expert", "int", (
        ("n", "int"), ("H", "int"), ("I", "int"), ("x", "const float *"), ("ldx", "int64_t"),
        ("gu", "const int64_t *"), ("dn", "const int64_t *"), ("act", "int"), ("y", "float *"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_experts_row", "int", (
        ("H", "int"), ("I", "int"), ("x", "const float *"), ("k", "int"), ("gu", "const int64_t *"),
        ("dn", "const int64_t *"), ("w", "const float *"), ("act", "int"), ("out", "float *"), ("n_threads", "int"))),
    # dmoe.c: the router (norm, logits, top-k and weights) and a decode row's whole mixture
    Signature("qgemm", "kv_moe_route", "int", (
        ("n", "int"), ("H", "int"), ("x", "const float *"), ("ldx", "int64_t"), ("post_w", "const float *"),
        ("eps", "float"), ("wt", "const float *"), ("E", "int"), ("Ep", "int"), ("k", "int"), ("norm", "int"),
        ("h", "float *"), ("w", "float *"), ("e", "int64_t *"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_moe_row", "int", (
        ("H", "int"), ("I", "int"), ("x", "float *"), ("post_w", "const float *"), ("eps", "float"),
        ("wt", "const float *"), ("E", "int"), ("Ep", "int"), ("k", "int"), ("norm", "int"), ("gu", "const int64_t *"),
        ("dn", "const int64_t *"), ("act", "int"), ("w", "float *"), ("e", "int64_t *"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_moe_rows", "int", (
        ("n", "int"), ("H", "int"), ("I", "int"), ("x", "float *"), ("ldx", "int64_t"), ("h", "const float *"),
        ("w", "const float *"), ("e", "const int64_t *"), ("k", "int"), ("E", "int"), ("gu", "const int64_t *"),
        ("dn", "const int64_t *"), ("act", "int"), ("n_threads", "int"))),
    # qamx.c: whether the products of many rows use AMX tiles here, and why
    Signature("qgemm", "kv_amx_status", "const char *", ()),
    # qpack.c: repacking GGUF blocks, dequantizing rows
    Signature("qgemm", "kv_q_repack", "int", (
        ("gtype", "int"), ("fmt", "int"), ("rows", "int"), ("K", "int"), ("src", "const uint8_t *"),
        ("src_stride", "int64_t"), ("dst_rows", "const int64_t *"), ("out", "int"), ("qs", "uint8_t *"),
        ("d", "void *"), ("m", "void *"))),
    Signature("qgemm", "kv_q_dequant", "int", (
        ("fmt", "int"), ("K", "int"), ("out", "int"), ("qs", "const uint8_t *"), ("d", "const void *"),
        ("m", "const void *"), ("rows", "const int64_t *"), ("n", "int"), ("y", "float *"), ("ldy", "int64_t"))),
    # dattn.c: attention fused with the steps around it
    Signature("qgemm", "kv_decode_attend", "int", (
        ("N", "int"), ("hq", "int"), ("hkv", "int"), ("D", "int"), ("rot", "int"), ("qkv", "float *"),
        ("ldq", "int64_t"), ("cos", "const float *"), ("sin", "const float *"), ("qk_norm", "const float *"),
        ("eps", "float"), ("kv", "float *"), ("ps", "int"), ("S", "int64_t"), ("slots", "const int64_t *"),
        ("tables", "const int64_t *"), ("max_pages", "int"), ("B", "int"), ("row0", "const int64_t *"),
        ("nnew", "const int64_t *"), ("lens", "const int64_t *"), ("window", "int64_t"), ("scale", "float"),
        ("sinks", "const float *"), ("out", "float *"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_attn_block", "int", (
        ("N", "int"), ("H", "int"), ("x", "float *"), ("ldx", "int64_t"), ("g_in", "const float *"),
        ("eps", "float"), ("qkv_w", "const int64_t *"), ("hq", "int"), ("hkv", "int"), ("D", "int"),
        ("rot", "int"), ("cos", "const float *"), ("sin", "const float *"), ("qk_norm", "const float *"),
        ("kv", "float *"), ("ps", "int"), ("S", "int64_t"), ("slots", "const int64_t *"),
        ("tables", "const int64_t *"), ("max_pages", "int"), ("B", "int"), ("row0", "const int64_t *"),
        ("nnew", "const int64_t *"), ("lens", "const int64_t *"), ("window", "int64_t"), ("scale", "float"),
        ("o_w", "const int64_t *"), ("post_w", "const float *"), ("post_eps", "float"), ("n_threads", "int"))),
    Signature("qgemm", "kv_q_layers", "int", (
        ("N", "int"), ("H", "int"), ("x", "float *"), ("ldx", "int64_t"), ("L", "int"), ("layers", "const int64_t *"),
        ("kvs", "const int64_t *"), ("hq", "int"), ("hkv", "int"), ("D", "int"), ("rot", "int"), ("I", "int"),
        ("act", "int"), ("E", "int"), ("Ep", "int"), ("topk", "int"), ("norm", "int"), ("cos0", "const float *"), ("sin0", "const float *"), ("cos1", "const float *"),
        ("sin1", "const float *"), ("eps", "float"), ("scale", "float"), ("G", "int"),
        ("groups", "const int64_t *"), ("B", "int"), ("row0", "const int64_t *"), ("nnew", "const int64_t *"),
        ("n_threads", "int"))),
    # cattn.c: the canonical float32 paged attention
    Signature("qgemm", "kv_paged_attend", "int", (
        ("B", "int"), ("hkv", "int"), ("g", "int"), ("D", "int"), ("ps", "int"), ("S", "int64_t"),
        ("q", "const float *"), ("kv", "const float *"), ("tables", "const int64_t *"), ("max_pages", "int"),
        ("row0", "const int64_t *"), ("nnew", "const int64_t *"), ("lens", "const int64_t *"),
        ("window", "int64_t"), ("out", "float *"), ("n_rows", "int64_t"), ("n_threads", "int"))),
    # membw.c: the benchmarks' probes
    Signature("qgemm", "kv_stream_sum", "float", (
        ("x", "const float *"), ("n", "int64_t"), ("n_threads", "int"))),
    Signature("qgemm", "kv_int8_peak", "int64_t", (
        ("iters", "int64_t"), ("n_threads", "int"), ("sink", "int64_t *"))),
    # vmask.c: grammar masks on logits (the sampler)
    Signature("qgemm", "kv_mask_logits", "int", (
        ("rows", "int"), ("vocab", "int"), ("x", "float *"), ("ldx", "int64_t"), ("mask", "const int32_t *"),
        ("ldm", "int64_t"))),
    # qattn.c: attention over quantized pages and the fp32 tokens after them
    Signature("qattn", "kv_quant_fits", "int", (("D", "int"), ("G", "int"), ("bits", "int"), ("ps", "int"))),
    Signature("qattn", "kv_quant_attend", "int", (
        ("hkv", "int"), ("g", "int"), ("D", "int"), ("ps", "int"), ("G", "int"), ("bits", "int"), ("T", "int"),
        ("q", "const float *"), ("pages", "const int64_t *"), ("n_pages", "int"), ("kc", "const uint8_t *"),
        ("ks", "const uint16_t *"), ("km", "const uint16_t *"), ("vc", "const uint8_t *"),
        ("vs", "const uint16_t *"), ("vm", "const uint16_t *"), ("P", "int64_t"), ("tk", "const float *"),
        ("tv", "const float *"), ("n_rest", "int"), ("rotate", "int"), ("way", "int"), ("out", "float *"),
        ("n_threads", "int"))),
    Signature("qattn", "kv_half_attend", "int", (
        ("hkv", "int"), ("g", "int"), ("D", "int"), ("bf16", "int"), ("T", "int"), ("q", "const float *"),
        ("kv", "const uint16_t *"), ("S", "int64_t"), ("slots", "const int64_t *"), ("first_slot", "int64_t"),
        ("L", "int"), ("way", "int"), ("out", "float *"), ("n_threads", "int"))),
    # pgemm.c: multi-row products by packed fp32 weights
    Signature("pgemm", "kv_packed_matmul", "int", (
        ("n", "int"), ("in", "int"), ("k", "int"), ("part", "int"), ("x", "const float *"), ("ldx", "int64_t"),
        ("w", "const float *"), ("bias", "const float *"), ("y", "float *"), ("n_threads", "int"))),
)

SIGNATURES: dict[str, Signature] = {s.symbol: s for s in _TABLE}

_SCALARS: dict[str, type | None] = {
    "void": None, "int": ctypes.c_int, "unsigned": ctypes.c_uint, "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t, "float": ctypes.c_float, "double": ctypes.c_double,
}


def ctype(c_type: str, result: bool = False) -> type | None:
    """The ctypes type passing (or, with ``result``, returning) a value of C type ``c_type``: any
    pointer is an address (c_void_p), save a returned ``const char *``, which reads as bytes."""
    words = c_type.replace("*", " * ").split()
    if "*" in words:
        return ctypes.c_char_p if result and words == ["const", "char", "*"] else ctypes.c_void_p
    base = " ".join(w for w in words if w != "const")
    if base not in _SCALARS or (base == "void" and not result):
        raise ValueError(f"kernels/signatures.py: no ctypes type for C type {c_type!r}")
    return _SCALARS[base]


def bind(lib: ctypes.CDLL, name: str) -> ctypes.CDLL:
    """Set argtypes and restype of every symbol of library ``name`` on ``lib`` (AttributeError
    when it lacks one); returns ``lib``."""
    for s in _TABLE:
        if s.lib == name:
            fn = getattr(lib, s.symbol)
            fn.argtypes = [ctype(t) for _, t in s.params]
            fn.restype = ctype(s.ret, result=True)
    return lib
