"""Llama/Qwen-shaped GGUFs with random weights and a real tokenizer (the benchmark models and the
tests' files of a given shape).

Speed does not depend on what the weights say, so kvcache and llama.cpp can be measured on the very
same files at 1B-3B sizes without downloading anything: ``write_f16`` writes an F16 GGUF of architecture ``llama`` (norms in F32, as llama.cpp's converter
writes them) with normal(0, 0.02) weights and all-ones norms, and the tokenizer metadata
(``tokenizer.*``) copied from the bundled SmolLM2 GGUF, so its vocabulary (49152 tokens) is a real
one; bench/randmodel.py's ``make`` quantizes it with llama.cpp's own ``llama-quantize`` into any
ftype that tool names and caches the files. Weights are generated one tensor at a time (in row chunks), so a 3B file never needs
more than one tensor in memory. A Qwen shape is written as ``llama`` too (no Q/K/V biases), and
Llama 3.2's rope scaling is left out (no ``rope_freqs`` tensor): neither changes the speed. The sparse shapes (``qwen3moe``) are models/random_moe.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from kvcache.models.random_weights import add_llm_keys, open_writer, random_f16 as _random, write_planned



@dataclass(frozen=True)
class Shape:
    """A llama-architecture shape (head_dim 0: hidden // heads)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    context: int = 8192
    eps: float = 1e-5
    tied: bool = True

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "135m": Shape(576, 30, 9, 3, 1536, rope_theta=100000.0),  # SmolLM2-135M
    "1b": Shape(2048, 16, 32, 8, 8192, head_dim=64, rope_theta=500000.0),  # Llama-3.2-1B
    "3b": Shape(3072, 28, 24, 8, 8192, head_dim=128, rope_theta=500000.0),  # Llama-3.2-3B
}
_INT_KEYS = ("hidden", "layers", "heads", "kv_heads", "ffn", "head_dim", "context")
_ABBR = {"hidden": "h", "layers": "l", "heads": "a", "kv_heads": "kv", "ffn": "ff", "head_dim": "d",
         "rope_theta": "theta", "context": "ctx", "eps": "eps"}  # in the file names of custom shapes
_ABBR_ALWAYS = ("hidden", "layers", "heads", "kv_heads", "ffn")


class ShapeError(ValueError):
    pass


def parse_shape(text: str) -> tuple[str, Shape]:
    """``"1b"``, ``"1b,layers=2"`` or ``"hidden=2048,layers=16,heads=32,kv_heads=8,ffn=8192"``
    (keys: the fields of Shape) -> (a file-name-safe name, the shape)."""
    parts = [p.strip() for p in text.strip().lower().split(",") if p.strip()]
    base: Shape | None = None
    if parts and "=" not in parts[0]:
        if parts[0] not in SHAPES:
            raise ShapeError(f"unknown shape {parts[0]!r}; named shapes: {', '.join(SHAPES)}")
        base, name, parts = SHAPES[parts[0]], parts[0], parts[1:]
    known = {f.name for f in fields(Shape)}
    given: dict[str, object] = {}
    for p in parts:
        key, _, val = p.partition("=")
        key = key.strip().replace("-", "_")
        if key not in known or not val.strip():
            raise ShapeError(f"bad shape item {p!r}: want key=value with key one of {', '.join(sorted(known))}")
        try:
            if key == "tied":
                given[key] = val.strip() in ("1", "true", "yes")
            else:
                given[key] = int(val) if key in _INT_KEYS else float(val)
        except ValueError:
            raise ShapeError(f"bad shape item {p!r}: not a number") from None
    if base is None:
        missing = [k for k in ("hidden", "layers", "heads", "ffn") if k not in given]
        if missing:
            raise ShapeError(f"shape {text!r} lacks {', '.join(missing)} (or start from a named shape: "
                             f"{', '.join(SHAPES)})")
        given.setdefault("kv_heads", given["heads"])
        shape = Shape(**given)  # type: ignore[arg-type]
    else:
        shape = replace(base, **given)  # type: ignore[arg-type]
    if min(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn) <= 0 or shape.heads % shape.kv_heads:
        raise ShapeError(f"shape {text!r}: sizes must be positive and heads a multiple of kv_heads")
    if shape.dim % 2 or (not shape.head_dim and shape.hidden % shape.heads):
        raise ShapeError(f"shape {text!r}: head_dim must be even (and hidden a multiple of heads without head_dim)")
    if base is None or given:  # e.g. h64-l2-a4-kv2-ff128
        items = [f"{_ABBR[f.name]}{getattr(shape, f.name):g}" for f in fields(Shape) if f.name in _ABBR
                 and (f.name in _ABBR_ALWAYS or getattr(shape, f.name) != f.default)]
        name = "-".join(items + ([] if shape.tied else ["untied"])).replace("+", "")
    return name, shape


def _tensors(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes ([out, in]) in llama.cpp's order. Q and K are written as
    convert_hf_to_gguf.py writes them after its RoPE row permutation: the same shapes."""
    q, kv = s.heads * s.dim, s.kv_heads * s.dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (q, s.hidden)),
                (b + "attn_k.weight", (kv, s.hidden)), (b + "attn_v.weight", (kv, s.hidden)),
                (b + "attn_output.weight", (s.hidden, q)), (b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden)),
                (b + "ffn_down.weight", (s.hidden, s.ffn))]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden)))
    return out


def write_f16(shape: Shape, out: Path, seed: int = 0, name: str = "random", progress: bool = True) -> Path:
    """Write ``shape`` with random weights as an F16 GGUF (1-D norms F32) at ``out``; returns ``out``."""
    import gguf

    tmp = out.with_name(out.name + ".tmp")
    w, vocab = open_writer(tmp, "llama", name, seed)
    add_llm_keys(w, shape.context, shape.hidden, shape.layers, shape.ffn, shape.heads, shape.kv_heads, shape.dim,
                 shape.rope_theta, shape.eps)
    w.add_rope_dimension_count(shape.dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = _tensors(shape, vocab)
    for tname, tshape in plan:
        dtype = np.float32 if len(tshape) == 1 else np.float16
        w.add_tensor_info(tname, tshape, np.dtype(dtype), int(np.prod(tshape)) * np.dtype(dtype).itemsize)
    total = sum(int(np.prod(t)) * 2 for _, t in plan if len(t) > 1)

    def one(i: int, _name: str, tshape: tuple[int, ...], done: Callable[[int], object]) -> None:
        rng = np.random.default_rng([seed, i])  # each tensor its own stream: order-independent
        w.write_tensor_data(np.ones(tshape, np.float32) if len(tshape) == 1 else _random(tshape, rng, done))

    return write_planned(w, tmp, out, plan, total, progress, one)
