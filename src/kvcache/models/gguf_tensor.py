"""A quantized GGUF tensor left in its file, read row by row when a weight is built from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcache.errors import ModelLoadError

# GGUF (ggml) type id -> (values, bytes) per block, for the quantized types kvcache repacks
BLOCK = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84), 11: (256, 110),
         12: (256, 144), 13: (256, 176), 14: (256, 210), 39: (32, 17)}
MXFP4, Q5_0 = 39, 6
# MXFP4's sixteen codes as multiples of half its block scale 2^(e - 127): every weight an integer in
# -12..12 times 2^(e - 128), which Q5_0's codes (q - 16) d hold exactly with d = 2^(e - 128) in fp16
_MXFP4_HALVES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)
_FP16_EXP = (104, 143)  # 2^(e - 128) as an fp16 (subnormals included) for e in this range


def mxfp4_as_q5_0(raw: np.ndarray, what: str) -> np.ndarray:
    """MXFP4 blocks [rows, n * 17] (a scale byte e, then 16 bytes: element j in the low nibble of
    byte j, element j + 16 in its high nibble) -> the same weights as Q5_0 blocks [rows, n * 22]
    (fp16 d, the fifth bits of the 32 codes, their low nibbles), bit-exact. ModelLoadError naming
    ``what`` when a block's scale has no fp16 form (its weights are not all zero)."""
    rows = raw.shape[0]
    blk = raw.reshape(rows, -1, 17)
    e = blk[:, :, 0].astype(np.int32)  # [rows, n]
    nib = np.concatenate((blk[:, :, 1:] & 0x0F, blk[:, :, 1:] >> 4), axis=2)  # [rows, n, 32]: elements 0..31
    vals = _MXFP4_HALVES[nib]
    bad = ((e < _FP16_EXP[0]) | (e > _FP16_EXP[1])) & (vals != 0).any(axis=2)
    if bad.any():
        raise ModelLoadError(f"{what}: an MXFP4 block's scale 2^{int(e[bad][0]) - 127} is outside what kvcache "
                             "holds exactly (2^-23 .. 2^16)")
    q = (vals + 16).astype(np.uint8)  # [rows, n, 32] in 4..28
    d = np.ldexp(np.float32(1.0), np.clip(e, *_FP16_EXP) - 128).astype(np.float16)  # [rows, n]
    out = np.empty((rows, blk.shape[1], 22), dtype=np.uint8)
    out[:, :, 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
    high = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    out[:, :, 2:6] = high.sum(axis=2, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(rows, -1, 4)
    out[:, :, 6:22] = (q[:, :, :16] & 0x0F) | ((q[:, :, 16:] & 0x0F) << 4)
    return out.reshape(rows, -1)


def qtype(ggml_id: int):  # -> gguf.GGMLQuantizationType
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_id)


@dataclass(eq=False)
class GGUFTensor:
    """A quantized GGUF tensor left in the file: an nn.Linear weight [out, K] of ``ggml_type``.
    ``permute_heads``: llama.cpp permuted the rows of this llama Q or K weight of that many heads
    for its interleaved RoPE; ``dst`` maps them back to HF's rows."""

    path: str
    ggml_type: int
    out: int
    k: int
    offset: int  # of its data in the file
    permute_heads: int | None = None
    source: int | None = None  # the file's type where it is read as ``ggml_type`` (MXFP4 as Q5_0)

    @property
    def dst(self) -> np.ndarray | None:
        """[out] int64: the HF row of each file row (None: the same row)."""
        if self.permute_heads is None:
            return None
        d = self.out // self.permute_heads  # rows per head, stored as (d/2, 2), wanted as (2, d/2)
        r = np.arange(self.out, dtype=np.int64).reshape(self.permute_heads, d // 2, 2)
        return (r // d * d + (r % d) % 2 * (d // 2) + (r % d) // 2).reshape(-1)

    @property
    def row_bytes(self) -> int:
        """Bytes of a row as ``read`` gives it (of ``ggml_type``)."""
        values, nbytes = BLOCK[self.ggml_type]
        return self.k // values * nbytes

    @property
    def file_row_bytes(self) -> int:
        """Bytes of a row in the file (of ``source`` where there is one)."""
        values, nbytes = BLOCK[self.source if self.source is not None else self.ggml_type]
        return self.k // values * nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out, self.k)

    def read(self, r0: int, r1: int) -> np.ndarray:
        """Raw rows r0..r1-1 [rows, row_bytes] uint8 of ``ggml_type`` (read, not mapped: nothing
        stays resident; MXFP4 rows rewritten as Q5_0 ones)."""
        step = self.file_row_bytes
        n = (r1 - r0) * step
        buf = np.empty(n, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + r0 * step)
            got = f.readinto(memoryview(buf))
        if got != n:
            raise ModelLoadError(f"{self.path} is truncated: a tensor's rows end past the file")
        if self.source == MXFP4:
            return mxfp4_as_q5_0(buf.reshape(r1 - r0, step), f"{self.path} at byte {self.offset}")
        return buf.reshape(r1 - r0, step)

    def rows_to(self, r0: int, r1: int, base: int) -> np.ndarray:
        rows = np.arange(r0, r1, dtype=np.int64) if self.dst is None else self.dst[r0:r1]
        return rows + base

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, K] in HF's row order."""
        from gguf.quants import dequantize

        w = dequantize(self.read(0, self.out), qtype(self.ggml_type)).reshape(self.out, self.k)
        if self.dst is not None:
            w = w[np.argsort(self.dst)]
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
