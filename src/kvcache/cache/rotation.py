"""The normalized Walsh-Hadamard transform over the last dimension: the rotation of rotated KV
encodings (``--kv int4,rotate``).

Rotating K and V by an orthogonal matrix per head before quantizing spreads a few outlier
channels over all of them, so one range fits a group better (QuaRot, SpinQuant). The normalized
Hadamard matrix ``H / sqrt(b)`` (Sylvester's construction, ``b`` a power of two) is symmetric and
orthogonal, hence its own inverse: ``hadamard`` rotates and un-rotates alike.

A last dimension D that is not a power of two is cut into D / b independent blocks of b, the
largest power of two dividing D (head_dim 80: five blocks of 16; 96: three of 32), and each block
is rotated on its own: still orthogonal and its own inverse, spreading outliers within a block.

The butterfly takes log2(b) stages of adds and subtracts (O(D log D)), in one fixed order, in
float32. cache/qpool.py applies it when it quantizes pages and when it dequantizes them;
kernels/qattn.c attends over rotated codes in place with the same transform (the query turned
into the pages' basis, the output turned back).
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_size", "hadamard", "sylvester"]


def block_size(d: int) -> int:
    """The largest power of two dividing ``d`` (d >= 1): the width of each rotated block."""
    if d < 1:
        raise ValueError(f"the rotated dimension must be at least 1, got {d}")
    return d & -d


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> [..., D] float32: each block of ``block_size(D)`` channels times the
    normalized Hadamard matrix. Applying it twice gives x back (to float32 rounding)."""
    d = x.shape[-1]
    b = block_size(d)
    n = x.numel() // b
    a = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    a.copy_(x)  # one copy of x, whatever its dtype and strides
    a = a.view(n, b)  # [N, b]: every block a row
    t = torch.empty_like(a)
    h = 1
    while h < b:  # stage h: channels i and i + h of each run of 2h -> their sum, their difference
        src, dst = a.view(n, b // (2 * h), 2, h), t.view(n, b // (2 * h), 2, h)
        torch.add(src[:, :, 0], src[:, :, 1], out=dst[:, :, 0])
        torch.sub(src[:, :, 0], src[:, :, 1], out=dst[:, :, 1])
        a, t = t, a
        h *= 2
    if b > 1:
        a.mul_(1.0 / math.sqrt(b))
    return a.view(x.shape)


def sylvester(b: int) -> torch.Tensor:
    """The normalized Hadamard matrix of order b (a power of two) by Sylvester's construction:
    [b, b] float64, H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2). The reference the tests check
    ``hadamard`` against."""
    if b < 1 or b & (b - 1):
        raise ValueError(f"Sylvester's construction needs a power of two, got {b}")
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < b:
        m = torch.cat((torch.cat((m, m), 1), torch.cat((m, -m), 1)), 0)
    return m / math.sqrt(b)
