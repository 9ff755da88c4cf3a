"""A quantized GGUF tensor left in its file, read row by row when a weight is built from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcache.errors import ModelLoadError

# GGUF (ggml) type id -> (values, bytes) per block, for the quantized types kvcache repacks
BLOCK = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84), 11: (256, 110),
         12: (256, 144), 13: (256, 176), 14: (256, 210), 39: (32, 17)}
MXFP4 = 39


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
    def shape(self) -> tuple[int, int]:
        return (self.out, self.k)

    def read(self, r0: int, r1: int) -> np.ndarray:
        """Raw rows r0..r1-1 [rows, row_bytes] uint8 of ``ggml_type`` (read, not mapped: nothing
        stays resident)."""
        step = self.row_bytes
        n = (r1 - r0) * step
        buf = np.empty(n, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + r0 * step)
            got = f.readinto(memoryview(buf))
        if got != n:
            raise ModelLoadError(f"{self.path} is truncated: a tensor's rows end past the file")
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
