"""Optional native kernels, compiled on first use with the system's C compiler.

``qattn.c`` decodes attention straight from quantized pages; ``pattn.c`` decodes a batch of
sequences straight from float32 pages through their page tables; ``xattn.c`` attends a few new
tokens per sequence (an extend after a prefix hit, a chat turn, a short prefill chunk) over float32
pages in place; ``pgemm.c`` multiplies several rows by packed projection weights (register tiles
that reuse every weight across rows). Each is built once per machine into
``$KVCACHE_HOME/kernels`` (``cc -O3 -march=native -fopenmp``) and loaded with ctypes; when there
is no compiler, the build fails, or ``KVCACHE_NO_KERNELS=1``, callers fall back to the pure torch
path, which gives the same result.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from kvcache.models.paths import cache_home

_LIBS: dict[str, ctypes.CDLL | bool] = {}  # name -> library, or False: unavailable here


def _build(name: str) -> Path:
    path = Path(__file__).with_name(f"{name}.c")
    src = path.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler")
    flags = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine(), platform.node()]).encode()).hexdigest()[:16]
    out = cache_home() / "kernels" / f"{name}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        subprocess.run([cc, *flags, str(path), "-o", str(so), "-lm"], check=True, capture_output=True, timeout=300)
        os.replace(so, out)
    return out


def _load(name: str, symbol: str, argtypes: list) -> ctypes.CDLL | None:
    """The compiled library ``name`` with ``symbol``'s signature set, or None when it cannot be had."""
    if name not in _LIBS:
        if os.environ.get("KVCACHE_NO_KERNELS") == "1":
            _LIBS[name] = False
        else:
            try:
                lib = ctypes.CDLL(str(_build(name)))
                fn = getattr(lib, symbol)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
                _LIBS[name] = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"kvcache: native kernel {name} unavailable ({e}); using the torch path", stacklevel=3)
                _LIBS[name] = False
    return _LIBS[name] or None


_I, _P, _I64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64


def qattn() -> ctypes.CDLL | None:
    """The quantized decode-attention library, or None when it cannot be had here."""
    return _load("qattn", "kv_quant_decode",
                 [_I, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _I, _P, _I])


def pattn() -> ctypes.CDLL | None:
    """The batched float32 paged decode-attention library, or None."""
    return _load("pattn", "kv_paged_decode", [_I, _I, _I, _I, _I, _I64, _P, _P, _P, _I, _P, _P, _I])


def paged_decode(
    q: torch.Tensor,  # [B, Hkv, g, D] fp32 contiguous, softmax scale applied
    flat: torch.Tensor,  # [2, Hkv, S, D] fp32 contiguous: a pool layer
    tables: torch.Tensor,  # [B, max_pages] int64 contiguous
    lens: torch.Tensor,  # [B] int64: tokens each query attends to (its own included)
    page_size: int,
) -> torch.Tensor | None:  # [B, Hkv, g, D], or None when the kernel is unavailable
    lib = pattn()
    if lib is None or flat.dtype != torch.float32 or not flat.is_contiguous() or flat.device.type != "cpu":
        return None
    b, hkv, g, d = q.shape
    out = torch.empty(b, hkv, g, d)
    rc = lib.kv_paged_decode(b, hkv, g, d, page_size, flat.shape[2], q.data_ptr(), flat.data_ptr(),
                             tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(),
                             torch.get_num_threads())
    return out if rc == 0 else None


def quant_decode(
    q: torch.Tensor,  # [Hkv, g, D] fp32 contiguous, softmax scale applied
    pages: torch.Tensor,  # [n] int64 contiguous: pool pages in position order
    parts: dict[str, torch.Tensor],  # the layer's QuantPool tensors (kc ks km vc vs vm)
    page_size: int,
    group: int,
    bits: int,
    tail: torch.Tensor,  # [2, Hkv, t, D] fp32 contiguous: the tokens after the quantized pages
) -> torch.Tensor | None:  # [Hkv, g, D], or None when the kernel is unavailable
    lib = qattn()
    if lib is None:
        return None
    hkv, g, d = q.shape
    out = torch.empty(hkv, g, d)
    kc = parts["kc"]
    rc = lib.kv_quant_decode(
        hkv, g, d, page_size, group, bits, q.data_ptr(), pages.data_ptr(), pages.shape[0],
        kc.data_ptr(), parts["ks"].data_ptr(), parts["km"].data_ptr(), parts["vc"].data_ptr(),
        parts["vs"].data_ptr(), parts["vm"].data_ptr(), kc.shape[1], tail[0].data_ptr(), tail[1].data_ptr(),
        tail.shape[2], out.data_ptr(), torch.get_num_threads(),
    )
    return out if rc == 0 else None


def pgemm() -> ctypes.CDLL | None:
    """The packed-weight multi-row projection library, or None."""
    return _load("pgemm", "kv_packed_matmul", [_I, _I, _I, _I, _P, _I64, _P, _P, _P, _I])


def packed_matmul(
    x: torch.Tensor,  # [N, in] fp32 on the CPU, unit stride along in
    w: torch.Tensor,  # [k, in, part] fp32 contiguous: packed weights (models.layers.pack)
    bias: torch.Tensor | None,  # [k, 1, part] fp32 contiguous, or None
) -> torch.Tensor | None:  # [N, k * part], or None when the kernel is unavailable for these inputs
    lib = pgemm()
    if (lib is None or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
            or w.device.type != "cpu" or not w.is_contiguous() or x.dim() != 2 or x.stride(1) != 1
            or (bias is not None and not bias.is_contiguous())):
        return None
    k, inn, part = w.shape
    n = x.shape[0]
    y = torch.empty(n, k * part)
    rc = lib.kv_packed_matmul(n, inn, k, part, x.data_ptr(), x.stride(0), w.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y if rc == 0 else None


def xattn() -> ctypes.CDLL | None:
    """The float32 paged extend-attention library (several new tokens per sequence), or None."""
    return _load("xattn", "kv_paged_extend", [_I, _I, _I, _I, _I, _I64, _P, _P, _P, _I, _P, _P, _P, _P, _I])


def paged_extend(
    q: torch.Tensor,  # [N, Hq, D] fp32 contiguous, softmax scale applied; sequences' rows one after another
    flat: torch.Tensor,  # [2, Hkv, S, D] fp32 contiguous: a pool layer
    tables: torch.Tensor,  # [B, max_pages] int64 contiguous
    row0: torch.Tensor,  # [B] int64: each sequence's first row in q
    new: torch.Tensor,  # [B] int64: its new tokens (rows), at least 1
    lens: torch.Tensor,  # [B] int64: tokens it holds, the new ones included
    page_size: int,
) -> torch.Tensor | None:  # [N, Hq, D], or None when the kernel is unavailable for these inputs
    lib = xattn()
    if lib is None or flat.dtype != torch.float32 or not flat.is_contiguous() or flat.device.type != "cpu":
        return None
    n, hq, d = q.shape
    hkv = flat.shape[1]
    out = torch.empty(n, hq, d)
    rc = lib.kv_paged_extend(tables.shape[0], hkv, hq // hkv, d, page_size, flat.shape[2], q.data_ptr(),
                             flat.data_ptr(), tables.data_ptr(), tables.shape[1], row0.data_ptr(), new.data_ptr(),
                             lens.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None
