"""Benchmark models: the random-weight GGUFs of models/random_llama.py and models/random_moe.py,
quantized by llama.cpp's own ``llama-quantize`` into any ftype that tool names, and cached as
``$KVCACHE_HOME/benchmodels/<shape>-<seed>-<ftype>.gguf`` (a second call is instant).
``kvcache bench ... --model random:SHAPE:FTYPE`` makes them through ``make``.

    python -m kvcache.bench.randmodel --shape 1b --ftype Q4_0,Q4_K_M,Q8_0 [--llama-cpp-bin DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kvcache.models.random_llama import SHAPES, ShapeError, parse_shape, write_f16


def bin_dir(arg: str | None = None) -> Path:
    """--llama-cpp-bin, else $KVCACHE_LLAMA_CPP_BIN, else ``make llamacpp``'s folder."""
    from kvcache.peers.llama_cpp import default_bin

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
    from kvcache.peers.llama_cpp import quantize, tool

    from kvcache.models.random_moe import moe_shape, write_f16 as write_moe_f16

    moe = moe_shape(shape_text)  # a qwen3moe or gpt-oss shape (models/random_moe.py), or None
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
    from kvcache.models.random_moe import MOE_SHAPES

    return list(MOE_SHAPES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcache.bench.randmodel", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", help=f"{', '.join(SHAPES)}, or e.g. "
                   "'hidden=2048,layers=16,heads=32,kv_heads=8,ffn=8192' (also head_dim, rope_theta, context, "
                   "eps, tied), or a named shape with overrides: '1b,layers=4'; mixture-of-experts "
                   "(qwen3moe, gpt-oss) shapes: " + ", ".join(_moe_names()))
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
