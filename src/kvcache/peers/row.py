"""The row every system's decode-bench measurements share (kvcache's own and each peer's), kept
free of torch and of the engine so that peer child processes (llama.cpp's) import nothing they do
not run.

``test`` is ``decode`` (batch 1 after a short chat prompt), ``prefill`` (``tokens`` prompt tokens
into an empty cache) or ``depth`` (decode after ``tokens`` tokens of context); ``pair`` is the
kvcache weights mode a row compares with (a peer's F32 row pairs with ``fp32``, its Q8_0 row with
``q8``, the GGUF as shipped with ``file``).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

Tick = Callable[[], None]


def shipped_type(name: str) -> str | None:
    """The quantization type a GGUF's file name ends with, as llama.cpp names it: ``Q4_1`` for
    ``SmolLM2-135M-Instruct.Q4_1.gguf``, ``Q4_K_M`` for ``qwen2.5-coder-1.5b-instruct-q4_k_m.gguf``;
    None when the name does not say."""
    stem = name.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".gguf")
    m = re.search(r"[-._]((?:i?q\d|bf16|f16|f32)\w*)$", stem, flags=re.I)
    return m.group(1).upper() if m else None


def step_bytes(wbytes: int, kv_per_token: float, prompt_len: int, new: int) -> float:
    """Average bytes moved per decode step: all weights plus the K/V attended to."""
    avg_ctx = prompt_len + new / 2
    return wbytes + kv_per_token * avg_ctx


@dataclass
class Row:
    system: str  # kvcache | transformers | llama.cpp
    weights: str  # as shown: "file (Q4_1)", "q8", "fp32", "Q8_0", "F32", "Q4_1 (as shipped)"
    cache: str  # kvcache's --kv spec, transformers' cache class, llama.cpp's KV type
    pair: str = ""  # the kvcache weights mode this row is compared with (file, q8, q4, fp32)
    test: str = "decode"  # decode | prefill | depth
    tokens: int = 0  # decode: prompt tokens; prefill: tokens prefilled; depth: context before decoding
    tok_s: list[float] = field(default_factory=list)  # decode: new tokens/s; prefill: prompt tokens/s
    ttft_s: list[float] = field(default_factory=list)
    gb_s: list[float] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, object]:
        med = _median
        tok = med(self.tok_s)
        return {
            "system": self.system, "weights": self.weights, "cache": self.cache, "pair": self.pair,
            "test": self.test, "tokens": self.tokens, "tok_s": tok,
            "tok_s_min": min(self.tok_s, default=None), "tok_s_max": max(self.tok_s, default=None),
            "ttft_ms": None if not self.ttft_s else med(self.ttft_s) * 1000,  # type: ignore[operator]
            "seconds": self.tokens / tok if self.test == "prefill" and tok else None,
            "gb_s": med(self.gb_s), "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> "Row":
        """A row sent back by a child process (``vars(row)``)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})  # type: ignore[arg-type]



def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
