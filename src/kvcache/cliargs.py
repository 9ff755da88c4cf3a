"""Command-line options shared by several subcommands (no heavy imports: the parser builds fast)."""

from __future__ import annotations

import argparse

WEIGHTS = ("file", "fp32", "q8", "q4")


def add_weights_arg(p: argparse.ArgumentParser, default: str = "file") -> None:
    p.add_argument("--weights", default=default, choices=WEIGHTS,
                   help="how weights are held: file (a GGUF's own quantized types, multiplied by int8 kernels; "
                        "the default), fp32, or q8/q4 (quantized at load, HF folders too)")
