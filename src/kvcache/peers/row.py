"""The rows every system's measurements are (kvcache's own and each peer's), kept free of torch and
of the engine so that peer child processes (llama.cpp's) import nothing they do not run: ``Row``
(`bench decode`), ``spec_row`` (`bench spec`), ``DepthRow`` (`bench context --long`) and
``BatchRow`` (`bench throughput`), with ``median`` and the nearest-rank ``percentile``.

A decode row's ``test`` is ``decode`` (batch 1 after a short chat prompt), ``prefill`` (``tokens``
prompt tokens into an empty cache) or ``depth`` (decode after ``tokens`` tokens of context);
``pair`` is the kvcache weights mode a row compares with (a peer's F32 row pairs with ``fp32``, its
Q8_0 row with ``q8``, the GGUF as shipped with ``file``).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Tick = Callable[[], None]


def median(xs: list[float]) -> float | None:
    """The median of ``xs`` (None for no values)."""
    return statistics.median(xs) if xs else None


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (nearest rank; None for no values)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


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
        med = median
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




# the row of `bench spec`, whichever system made it


def method_label(method: str, lookup: int) -> str:
    """How a speculation row names its kind of speculation."""
    return {"prediction": "prediction: the file", "miss": "prediction: another file",
            "ceiling": "prediction: its output",
            "lookup": f"prompt lookup {lookup}", "draft": "draft: its GGUF"}[method]


def spec_row(system: str, weights: str, pair: str, workload: str, method: str, label: str, prompt_tokens: int,
             note: str = "", **measured: Any) -> dict[str, Any]:
    """One row of the suite, whichever system made it: the measured figures (``tokens``,
    ``plain_tok_s``, ``spec_tok_s``, ``proposed``, ``accepted``, ``forwards``, the ms per forward
    each side, ``runs``, ``mismatches`` and any more), the figures derived from them, and None for
    what was not measured (a skipped row carries only its ``note``)."""
    r: dict[str, Any] = {"system": system, "weights": weights, "pair": pair, "workload": workload, "method": method,
                         "speculation": label, "prompt_tokens": prompt_tokens, "tokens": None, "plain_tok_s": None,
                         "spec_tok_s": None, "speedup": None, "proposed": None, "accepted": None,
                         "acceptance": None, "forwards": None, "tokens_per_forward": None,
                         "plain_ms_per_forward": None, "spec_ms_per_forward": None, "forward_cost": None, "runs": 0,
                         "mismatches": 0, "identical": None, **measured, "note": note}
    if r["spec_tok_s"] is None:
        return r
    plain, spec, n, fwd = r["plain_tok_s"], r["spec_tok_s"], r["tokens"], r["forwards"]
    pms, sms = r["plain_ms_per_forward"], r["spec_ms_per_forward"]
    r.update(speedup=spec / plain if plain else None, identical=r["mismatches"] == 0,
             acceptance=r["accepted"] / r["proposed"] if r["proposed"] else None,
             tokens_per_forward=(n - 1) / fwd if fwd and fwd > 0 else None,
             forward_cost=sms / pms if sms is not None and pms else None)
    return r


# the row of `bench context --long`, whichever system made it


@dataclass
class DepthRow:
    system: str  # kvcache | llama.cpp
    kv: str  # kvcache's --kv spec, or llama.cpp's KV type (f16, q8_0, q4_0)
    test: str  # decode (after ``context`` tokens) | prefill (a prompt of ``context`` tokens)
    context: int
    samples: list[float] = field(default_factory=list)  # decode: new tokens/s; prefill: seconds
    kv_bytes_per_token: float = 0.0  # decode: KV bytes per context token (kvcache: its accounting)
    weight_bytes: int = 0  # decode: bytes of weights one step reads
    new: int = 0  # decode: new tokens per run
    stages: int = 0  # prefill: forwards the prompt went in (kvcache grows in stages)
    note: str = ""  # why there are no samples

    def summary(self, read_gb_s: float | None) -> dict[str, object]:
        out: dict[str, object] = {"system": self.system, "kv": self.kv, "test": self.test, "context": self.context,
                                  "samples": list(self.samples), "note": self.note}
        med = median(self.samples)
        if self.test == "decode":
            nbytes = step_bytes(self.weight_bytes, self.kv_bytes_per_token, self.context, self.new)
            gb_s = nbytes * med / 1e9 if med is not None else None
            out.update(tok_s=med, tok_s_min=min(self.samples, default=None), tok_s_max=max(self.samples, default=None),
                       new_tokens=self.new, weight_bytes=self.weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token,
                       kv_bytes_read=nbytes - self.weight_bytes, bytes_per_token=nbytes, gb_s=gb_s,
                       wall_share=gb_s / read_gb_s if gb_s is not None and read_gb_s else None)
        else:
            out.update(seconds=med, tok_s=self.context / med if med else None,
                       s_per_1k=1000 * med / self.context if med else None, stages=self.stages)
        return out


# the row of `bench throughput`, whichever system made it


@dataclass
class BatchRow:
    """One system's run of a batch of requests (`bench throughput`): its wall time, new tokens, and
    each request's time to first token and time per output token."""

    system: str
    wall_s: float = 0.0
    new_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    note: str = ""
    weights: str = "fp32"  # how the weights were held (transformers: fp32)

    def summary(self) -> dict[str, object]:
        return {"system": self.system, "weights": self.weights, "wall_s": self.wall_s or None, "new_tokens": self.new_tokens,
                "tok_s": self.new_tokens / self.wall_s if self.wall_s else None,
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p99_s": percentile(self.ttft_s, 0.99),
                "tpot_p50_ms": None if not self.tpot_s else percentile(self.tpot_s, 0.5) * 1000,  # type: ignore[operator]
                "tpot_p99_ms": None if not self.tpot_s else percentile(self.tpot_s, 0.99) * 1000,  # type: ignore[operator]
                "note": self.note}
