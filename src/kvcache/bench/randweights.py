"""Random weights for the benchmark models (bench/randmodel.py, bench/randmoe.py): normal(0, STD)
in float16, made a chunk of rows at a time so that no float32 copy of a whole tensor exists."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

STD = 0.02  # weight std; norms are 1.0
_CHUNK = 1 << 22  # values generated per step


def random_f16(shape: tuple[int, ...], rng: np.random.Generator, done: Callable[[int], object]) -> np.ndarray:
    """normal(0, STD) [shape] in float16; ``done(bytes)`` after each chunk."""
    a = np.empty(shape, dtype=np.float16)
    rows = max(1, _CHUNK // shape[1])
    for r in range(0, shape[0], rows):
        chunk = a[r:r + rows]
        chunk[...] = rng.standard_normal(chunk.shape, dtype=np.float32) * STD
        done(chunk.nbytes)
    return a
