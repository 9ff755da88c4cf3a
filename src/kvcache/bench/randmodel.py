"""Benchmark models: Llama/Qwen-shaped GGUFs with random weights and a real tokenizer.

This module owns making them. Speed does not depend on what the weights say, so kvcache and
llama.cpp can be measured on the very same files at 1B-3B sizes without downloading anything:
``write_f16`` writes an F16 GGUF of architecture ``llama`` (norms in F32, as llama.cpp's converter
writes them) with normal(0, 0.02) weights and all-ones norms, and the tokenizer metadata
(``tokenizer.*``) copied from the bundled SmolLM2 GGUF, so its vocabulary (49152 tokens) is a real
one; ``make`` quantizes it with llama.cpp's own ``llama-quantize`` into any ftype that tool names.
Files are cached as ``$KVCACHE_HOME/benchmodels/<shape>-<seed>-<ftype>.gguf``: a second call is
instant. Weights are generated one tensor at a time (in row chunks), so a 3B file never needs
more than one tensor in memory. A Qwen shape is written as ``llama`` too (no Q/K/V biases), and
Llama 3.2's rope scaling is left out (no ``rope_freqs`` tensor): neither changes the speed.

    python -m kvcache.bench.randmodel --shape 1b --ftype Q4_0,Q4_K_M,Q8_0 [--llama-cpp-bin DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from kvcache.bench.randweights import (  # noqa: F401
    STD, add_llm_keys, open_writer, random_f16 as _random, write_planned,
)



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


def bin_dir(arg: str | None = None) -> Path:
    """--llama-cpp-bin, else $KVCACHE_LLAMA_CPP_BIN, else ``make llamacpp``'s folder."""
    from kvcache.bench.peers import default_bin

    return Path(arg).expanduser() if arg else default_bin() or Path(sys.prefix) / "llama.cpp" / "bin"


def cache_dir() -> Path:
    from kvcache.paths import cache_home

    d = cache_home() / "benchmodels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def make(shape_text: str, ftypes: list[str], seed: int = 0, llama_bin: Path | None = None,
         progress: bool = True) -> list[Path]:
    """The cached GGUF of ``shape_text`` in each ftype (``F16``: the unquantized file), made when
    missing. Raises ShapeError for bad text, RuntimeError when llama-quantize is missing or fails."""
    from kvcache.bench.peers import quantize, tool

    from kvcache.bench.randmoe import moe_shape, write_f16 as write_moe_f16

    moe = moe_shape(shape_text)  # a qwen3moe shape (bench/randmoe.py), or None
    name, shape = (shape_text.strip().lower(), moe) if moe is not None else parse_shape(shape_text)
    wanted = [f.strip().upper() for f in ftypes if f.strip()]
    for f in wanted:
        if not re.fullmatch(r"[A-Z0-9_]+", f):
            raise ShapeError(f"bad ftype {f!r}: want a name llama-quantize knows, such as Q4_0, Q4_K_M, Q8_0")
    d = cache_dir()
    path = {f: d / f"{name}-{seed}-{f}.gguf" for f in wanted}
    todo = [f for f in wanted if f != "F16" and not path[f].is_file()]
    where = llama_bin or bin_dir()
    if todo and tool(where, "llama-quantize") is None:
        raise RuntimeError(f"no llama-quantize in {where}: build it with `make llamacpp` or pass --llama-cpp-bin DIR")
    f16 = d / f"{name}-{seed}-F16.gguf"
    if (todo or "F16" in wanted) and not f16.is_file():
        (write_f16 if moe is None else write_moe_f16)(shape, f16, seed, name, progress)  # type: ignore[arg-type]
    for f in todo:
        why = quantize(where, f16, f, path[f])
        if why is not None:
            raise RuntimeError(f"{f}: {why}")
    return [path[f] for f in wanted]


def _moe_names() -> list[str]:
    from kvcache.bench.randmoe import MOE_SHAPES

    return list(MOE_SHAPES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench.randmodel", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", help=f"{', '.join(SHAPES)}, or e.g. "
                   "'hidden=2048,layers=16,heads=32,kv_heads=8,ffn=8192' (also head_dim, rope_theta, context, "
                   "eps, tied), or a named shape with overrides: '1b,layers=4'; mixture-of-experts "
                   "(qwen3moe) shapes: " + ", ".join(_moe_names()))
    p.add_argument("--ftype", default="Q4_0", help="comma-separated llama-quantize ftypes (F16: no quantizing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp-bin", default=None, metavar="DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        paths = make(a.shape, a.ftype.split(","), a.seed, bin_dir(a.llama_cpp_bin), not a.quiet)
    except (ShapeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
