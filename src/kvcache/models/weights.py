"""How projection weights are held: ``weights=`` modes, lazy GGUF tensors, and the builder the
model families call for every projection.

Modes:
  ``file``  (default) each tensor keeps the type the file gives it: quantized GGUF tensors are
            repacked for the int8 kernels (QWeight), fp32/fp16 tensors stay fp32. Nothing is
            expanded to fp32 on the way; a model without quantized tensors (an HF folder) is fp32.
  ``fp32``  every weight expanded to fp32 (the reference path).
  ``q8``    every projection quantized at load to 8 bits per weight, a scale per 32 (Q8_0's rule).
  ``q4``    every projection quantized at load to 4 bits, a scale and a minimum per 32 (Q4_1's rule).

Models call ``projection(parts, norm, mode)`` with the nn.Linear weights [out_i, K] of a fused
projection (fp32 tensors or ``GGUFTensor``s, the file's quantized bytes read on demand) and the
RMSNorm weight that feeds it; they get back packed fp32 (the norm folded into the matrix) or a
QWeight / QStack (the norm applied to the input). Without the native kernels every mode is fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from kvcache.errors import InvalidParams, ModelLoadError
from kvcache.models import repacked
from kvcache.models.gguf_tensor import GGUFTensor, qtype
from kvcache.kernels.qweight import GGML, Q4_F16, S8_F16, QStack, QWeight, common_format, kernels_available

MODES = ("file", "fp32", "q8", "q4")
CHUNK_BYTES = 8 << 20  # rows of a GGUF tensor read and repacked at a time (bounds the load's peak)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidParams(f"unknown weights mode {mode!r}; choose one of: {', '.join(MODES)}")
    return mode


def effective_mode(mode: str) -> str:
    """``mode``, or ``fp32`` when the native kernels cannot be had (with a warning)."""
    if mode != "fp32" and not kernels_available():
        import warnings

        warnings.warn(f"kvcache: weights={mode} needs the native kernels; loading fp32 weights", stacklevel=3)
        return "fp32"
    return mode


Part = torch.Tensor | GGUFTensor


def as_fp32(w: Part) -> torch.Tensor:
    return w.dequantize() if isinstance(w, GGUFTensor) else w.float()


def projection(parts: Sequence[Part], norm: torch.Tensor | None, mode: str,
               k: int | None = None) -> nn.Parameter | QWeight | QStack:
    """The fused projection of ``parts`` (stacked along their output rows) with ``norm`` folded
    in, held as ``mode`` says (see the module docstring)."""
    from kvcache.models.layers import fold_norm, pack

    k = k or parts[0].shape[1]
    quantized = [isinstance(p, GGUFTensor) for p in parts]
    keep = mode == "file" and all(quantized)
    requant = mode in ("q8", "q4") and k % 32 == 0
    if not keep and not requant:
        w = torch.cat([as_fp32(p) for p in parts]) if len(parts) > 1 else as_fp32(parts[0])
        return pack(fold_norm(norm, w) if norm is not None else w)
    scale = None if norm is None else norm.detach().float().contiguous()
    if requant:
        return _requantized(list(parts), mode, k, scale)
    return _from_file(list(parts), scale)  # type: ignore[arg-type]


def _requantized(parts: list[Part], mode: str, k: int, scale: torch.Tensor | None) -> QWeight:
    """The parts quantized anew by GGUF's own rule (Q8_0 for q8, Q4_1 for q4); a GGUF's are kept in
    the store of that mode (models/repacked.py) and mapped by later loads."""
    fmt, ggml = (S8_F16, GGML["Q8_0"]) if mode == "q8" else (Q4_F16, GGML["Q4_1"])
    store = repacked.current()
    key = store.key(parts) if store is not None else None  # None: a part made during the build

    def fill(qw: QWeight, done: Callable[[int], None]) -> None:
        base = 0
        for p in parts:
            _put_requantized(qw, p, ggml, base)
            base += p.shape[0]
            done(p.out * p.row_bytes if isinstance(p, GGUFTensor) else p.numel() * 4)

    return _kept(store if key is not None else None, key or "", fmt, sum(p.shape[0] for p in parts), k, scale, fill)


def _kept(store: repacked.RepackStore | None, key: str, fmt: int, out: int, k: int, scale: torch.Tensor | None,
          fill: Callable[[QWeight, Callable[[int], None]], None]) -> QWeight:
    """The QWeight ``key`` names: mapped from the store when it holds it, else made by ``fill(qw,
    done)`` (``done(nbytes)`` moves the store's progress bar) and handed to the store to keep."""
    found = store.get(key, fmt, out, k) if store is not None else None
    if found is not None:
        return QWeight(fmt, out, k, scale, arrays=tuple(found)).seal()  # type: ignore[arg-type]
    qw = QWeight(fmt, out, k, scale)
    fill(qw, store.repacked if store is not None else lambda nbytes: None)
    if store is not None:
        store.put(key, fmt, out, k, list(qw.parts()))
    return qw.seal()


def _from_file(parts: list[GGUFTensor], scale: torch.Tensor | None) -> QWeight | QStack:
    fmt = common_format([p.ggml_type for p in parts])
    if fmt is None:  # signed and unsigned types: one part per run of the same kind
        runs: list[list[GGUFTensor]] = []
        for p in parts:
            if runs and common_format([runs[-1][0].ggml_type, p.ggml_type]) is not None:
                runs[-1].append(p)
            else:
                runs.append([p])
        return QStack([_from_file(run, scale) for run in runs])  # type: ignore[misc]
    def fill(qw: QWeight, done: Callable[[int], None]) -> None:
        base = 0
        for p in parts:
            step = max(8, CHUNK_BYTES // max(1, p.row_bytes))
            for r0 in range(0, p.out, step):
                r1 = min(p.out, r0 + step)
                try:
                    qw.put_gguf(p.ggml_type, p.read(r0, r1), p.rows_to(r0, r1, base))
                except ModelLoadError as e:  # which tensor, in the file's words
                    raise ModelLoadError(f"{p.path}: the tensor at byte {p.offset}: {e}") from None
                done((r1 - r0) * p.row_bytes)
            base += p.out

    return _kept(repacked.current(), repacked.gguf_key(parts), fmt, sum(p.out for p in parts), parts[0].k, scale, fill)


def _put_requantized(qw: QWeight, part: Part, ggml: int, base: int) -> None:
    """Quantize fp32 rows by GGUF's own rule (Q8_0 or Q4_1) and store them, a chunk at a time."""
    from gguf.quants import quantize

    w = as_fp32(part)
    out = w.shape[0]
    step = max(8, CHUNK_BYTES // (4 * w.shape[1]))
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        raw = quantize(w[r0:r1].numpy(), qtype(ggml))
        qw.put_gguf(ggml, raw, np.arange(base + r0, base + r1, dtype=np.int64))


def embedding(table: Part, mode: str) -> nn.Parameter | QWeight:
    """An untied embedding table [V, H]: quantized rows stay quantized under ``file``."""
    from kvcache.models.layers import frozen

    if mode == "file" and isinstance(table, GGUFTensor):
        return _from_file([table], None)  # type: ignore[return-value]
    return frozen(as_fp32(table))

