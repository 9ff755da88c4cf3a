"""Optional native kernels, compiled on first use with the system's C compiler.

``qattn.c`` decodes attention straight from quantized pages. It is built once per machine into
``$KVCACHE_HOME/kernels`` (``cc -O3 -march=native -fopenmp``) and loaded with ctypes; when there
is no compiler, the build fails, or ``KVCACHE_NO_KERNELS=1``, callers fall back to the pure torch
path (dequantize, then attend), which gives the same result.
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

_SRC = Path(__file__).with_name("qattn.c")
_LIB: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def _build() -> Path:
    src = _SRC.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler")
    flags = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine(), platform.node()]).encode()).hexdigest()[:16]
    out = cache_home() / "kernels" / f"qattn-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        subprocess.run([cc, *flags, str(_SRC), "-o", str(so), "-lm"], check=True, capture_output=True, timeout=300)
        os.replace(so, out)
    return out


def qattn() -> ctypes.CDLL | None:
    """The quantized decode-attention library, or None when it cannot be had here."""
    global _LIB
    if _LIB is None:
        if os.environ.get("KVCACHE_NO_KERNELS") == "1":
            _LIB = False
        else:
            try:
                lib = ctypes.CDLL(str(_build()))
                fn = lib.kv_quant_decode
                i, p, i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
                fn.argtypes = [i, i, i, i, i, i, p, p, i, p, p, p, p, p, p, i64, p, p, i, p, i]
                fn.restype = ctypes.c_int
                _LIB = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"kvcache: native quantized attention unavailable ({e}); using the torch path",
                              stacklevel=2)
                _LIB = False
    return _LIB or None


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
