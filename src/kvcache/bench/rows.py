"""The row every system's decode-bench measurements share, kept free of torch and of the engine so
that peer child processes (llama.cpp's) import nothing they do not run.

``test`` is ``decode`` (batch 1 after a short chat prompt), ``prefill`` (``tokens`` prompt tokens
into an empty cache) or ``depth`` (decode after ``tokens`` tokens of context); ``pair`` is the
kvcache weights mode a row compares with (a peer's F32 row pairs with ``fp32``, its Q8_0 row with
``q8``, the GGUF as shipped with ``file``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvcache.bench.report import median

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


# ---------------------------------------------------------------------------------------------
# the headline rows a suite gives `bench report` (its ``headline(data)``), and their helpers


@dataclass(frozen=True)
class Headline:
    """One headline: kvcache's figure beside the peer's from the same run. ``ratio`` says how many
    times better kvcache did: kvcache / peer for rates (tok/s), peer / kvcache for times and sizes
    (``higher_better`` False)."""

    what: str
    kvcache: float
    peer_name: str
    peer: float
    unit: str
    higher_better: bool = True

    @property
    def ratio(self) -> float:
        return self.kvcache / self.peer if self.higher_better else self.peer / self.kvcache


def model_name(meta: dict, weights: str = "") -> str:
    """A short name for the model a run measured: ``1b-0-Q4_0`` -> ``1B Q4_0``, the bundled
    ``smollm2`` with ``file (Q4_1)`` weights -> ``SmolLM2-135M Q4_1``, a path -> its file name."""
    name = str(meta.get("model") or "")
    name = re.sub(r"\.gguf$", "", name.replace("\\", "/").rsplit("/", 1)[-1])
    from kvcache.models import fetch_qwen

    if name == fetch_qwen.NAME:  # the alias `make qwen` installs: named as its file is
        name = fetch_qwen.FILE.removesuffix(".gguf")
    m = re.fullmatch(r"(\d+[bBmM])-\d+-(\w+)", name)
    if m:
        return f"{m.group(1).upper()} {m.group(2)}"
    m = re.fullmatch(r"h(\d+)-l(\d+)-.*-(\w+)", name)
    if m:
        return f"h{m.group(1)}-l{m.group(2)} {m.group(3)}"
    if name.lower().startswith("smollm2"):
        m = re.search(r"\((\w+)\)", weights) or re.search(r"\b(Q\d\w*)", str(meta.get("model") or ""))
        name = "SmolLM2-135M" + (f" {m.group(1)}" if m else "")
        return name
    kind = shipped_type(name)  # a file named as it ships
    if kind:
        return f"{name[: -len(kind) - 1]} {kind}"
    m = re.search(r"\((\w+)\)", weights)  # a model named by its alias: the type the weights label says
    return (name + (f" {m.group(1)}" if m else "")) if name else "model not recorded"


def one(rows: Iterable[dict], **match: object) -> dict:
    """The one row whose keys hold these values (KeyError when there is none)."""
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match}")


def positive(x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x <= 0:
        raise ValueError(f"not a positive number: {x!r}")
    return float(x)


def suite_parts(d: dict) -> tuple[dict, list[dict], str]:
    """A suite file's meta, its result rows and the model they name."""
    return d["meta"], d["results"], model_name(d["meta"])


def beside_same_file(what: str, ours: dict, peer: dict) -> Headline:
    """A tok/s headline: kvcache's row beside a peer that ran the same GGUF file."""
    return Headline(what, positive(ours["tok_s"]), f"{peer['system']}, same file", positive(peer["tok_s"]), "tok/s")
