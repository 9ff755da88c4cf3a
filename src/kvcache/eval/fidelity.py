"""Perplexity, next-token agreement and KL divergence of a cache strategy against the full cache.

Both caches read the same text in lockstep, ``chunk`` tokens per forward: for every position the
strategy's next-token distribution is compared with the full cache's. Windows and sinks apply per
query inside a chunk (the mask), so a chunk sees what token-by-token decoding would; a quantized
cache quantizes whole pages as they leave its fp32 window, between chunks.
"""

from __future__ import annotations

import math
import pydoc_data.topics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.engine.runner import ModelRunner
from kvcache.errors import InvalidParams, KVCacheError


def builtin_text() -> str:
    """English prose every Python ships: the documentation topics of the standard library."""
    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def read_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): the UTF-8 file at ``path``, or the built-in text."""
    if path is None:
        return builtin_text(), "pydoc_data.topics"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KVCacheError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        raise InvalidParams(f"{path} is empty: nothing to evaluate")
    return text, path


@dataclass(frozen=True)
class Fidelity:
    spec: str
    tokens: int
    ppl: float  # perplexity of the text under this strategy
    ppl_full: float  # the same under the full fp32 cache
    agreement: float  # share of positions whose most likely next token equals the full cache's
    kl: float  # mean KL(full || strategy) of the next-token distributions, nats
    bytes_per_token: float  # the cache's bytes held per token at the end of the text

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def compare(
    model: torch.nn.Module,
    ids: list[int],
    spec: str | CacheConfig,
    chunk: int = 64,
    reference: str = "dynamic",
    progress: Callable[[int], None] | None = None,
) -> Fidelity:
    """Read ``ids`` with ``spec`` and with the full cache side by side; ids[0] is context only."""
    if len(ids) < 2:
        raise InvalidParams("the text must give at least 2 tokens to measure anything")
    if chunk < 1:
        raise InvalidParams(f"chunk must be at least 1, got {chunk}")
    cfg = parse_kv_spec(spec)
    ref, cand = ModelRunner(model, parse_kv_spec(reference)), ModelRunner(model, cfg)
    if len(ids) > ref.capacity:
        raise InvalidParams(f"the text has {len(ids)} tokens, more than the model's context of {ref.capacity}; "
                            "use fewer tokens")
    a, b = ref.new_sequence(), cand.new_sequence()
    nll_ref = nll_cand = kl = 0.0
    agree = n = 0
    held = 0.0
    try:
        for start in range(0, len(ids) - 1, chunk):
            feed = ids[start : min(start + chunk, len(ids) - 1)]
            target = torch.tensor(ids[start + 1 : start + 1 + len(feed)])
            lp_ref = torch.log_softmax(ref.score(a, feed), -1)  # [T, V]
            lp = torch.log_softmax(cand.score(b, feed), -1)
            rows = torch.arange(len(feed))
            nll_ref -= float(lp_ref[rows, target].sum())
            nll_cand -= float(lp[rows, target].sum())
            kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
            agree += int((lp_ref.argmax(-1) == lp.argmax(-1)).sum())
            n += len(feed)
            if progress:
                progress(len(feed))
        stats = cand.stats()
        held = stats.bytes_used / max(1, stats.tokens_stored) if stats is not None else 0.0
    finally:
        ref.free(a)
        cand.free(b)
    return Fidelity(cfg.spec(), n, math.exp(nll_cand / n), math.exp(nll_ref / n), agree / n, kl / n, held)
