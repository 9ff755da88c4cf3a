"""Random weights for the benchmark models (bench/randmodel.py, bench/randmoe.py): normal(0, STD)
in float16, made a chunk of rows at a time so that no float32 copy of a whole tensor exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def add_llm_keys(w: Any, context: int, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int,
                 head_dim: int, theta: float, eps: float) -> None:
    """The hyper-parameter keys every benchmark GGUF has, on the gguf writer ``w``."""
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)


def copy_fields(w: Any, fields: dict[str, Any]) -> None:
    """GGUF reader fields (the bundled tokenizer's) written as they are by the writer ``w``."""
    import gguf

    for key, f in fields.items():
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), vtype)
