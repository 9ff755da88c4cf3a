"""``kvcache size``: how many bytes a model's KV cache takes under each strategy, and what fits.

Counts the bytes the cache holds for ``context`` tokens of ``batch`` sequences: per layer, the
tokens its visibility keeps (the model's sliding layers and a configured window keep at most the
window; sinks count inside it) times the bytes one token costs in the encoding (quantized:
codes with their fp16 scales and minimums; the latest ``residual`` tokens stay fp32). A press
keeps ``int(n * (1 - ratio))`` of n tokens (at least the ``protect`` latest), or ``keep``, and
records the position each kept slot holds (4 bytes per layer, KV head and token). Page rounding
is left out: it adds at most one page per layer and sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.cache import quant
from kvcache.cache.groups import layer_visibility
from kvcache.cache.config import CacheConfig
from kvcache.errors import InvalidParams, ModelLoadError
from kvcache.inspect.known_models import _ALIASES, _COMMON, KNOWN, known_names  # noqa: F401 - known_names re-exported
from kvcache.models.config import ModelConfig

_FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def load_model_config(model: str | None) -> tuple[str, ModelConfig]:
    """(display name, config) of a known name, a config.json, a model folder or a GGUF file."""
    name = _ALIASES.get(model.lower() if model else None, model)
    for known in KNOWN:
        if name and known.lower() == name.lower():
            return known, ModelConfig.from_hf({**_COMMON, **KNOWN[known]})
    from kvcache.models.bundled import BUNDLED, bundled_path

    path = bundled_path(str(model)) if model in BUNDLED else Path(str(model))  # its GGUF (or how to get it)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        from kvcache.models.gguf_convert import read_gguf

        cfg = read_gguf(path)[2]
        return path.stem, ModelConfig.from_hf({**_COMMON, **cfg})
    if path.name == "config.json" and path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path} cannot be read ({e})") from None
        return path.parent.name, ModelConfig.from_hf({**_COMMON, **cfg})
    raise InvalidParams(f"unknown model {model!r}: give a config.json, a model folder, a GGUF file, a bundled "
                        f"model ({', '.join(BUNDLED)}) or one of: {known_names()}")


@dataclass(frozen=True)
class Size:
    bytes_total: int  # all layers, all sequences
    per_layer: tuple[int, ...]  # one sequence
    kept: tuple[int, ...]  # tokens each layer keeps for one sequence


def token_bytes(model: ModelConfig, cfg: CacheConfig) -> tuple[float, float]:
    """(stored bytes, fp32 bytes) of one token in one layer, K and V."""
    fp32 = 2 * model.num_kv_heads * model.head_dim * 4
    if cfg.quantized:
        return quant.bytes_per_token(model.num_kv_heads, model.head_dim, cfg.bits, cfg.group_size), fp32
    return fp32 / 4 * _FLOAT_BYTES[cfg.encoding], fp32


def kv_size(model: ModelConfig, cfg: CacheConfig, context: int, batch: int = 1) -> Size:
    if context < 1 or batch < 1:
        raise InvalidParams(f"context and batch must be at least 1 (got {context} and {batch})")
    stored, fp32 = token_bytes(model, cfg)
    per_layer, kept = [], []
    for i in range(model.num_layers):
        window, _ = layer_visibility(model, cfg, i)
        n = press_kept(cfg, context if window is None else min(context, window))
        fp_tokens = min(n, cfg.residual) if cfg.quantized else 0
        slots = n * model.num_kv_heads * 4 if cfg.press is not None else 0  # positions of the kept slots
        per_layer.append(int(round((n - fp_tokens) * stored + fp_tokens * fp32)) + slots)
        kept.append(n)
    return Size(sum(per_layer) * batch, tuple(per_layer), tuple(kept))


def press_kept(cfg: CacheConfig, n: int) -> int:
    """Tokens a layer keeps of ``n`` under the config's press (all of them without one)."""
    if cfg.press is None:
        return n
    if cfg.keep is not None:
        return min(n, cfg.keep)
    return max(min(n, cfg.protect), int(n * (1 - cfg.ratio)))  # type: ignore[operator]


def bounded(model: ModelConfig, cfg: CacheConfig) -> bool:
    """Whether the cache stops growing with the context (every layer keeps a window)."""
    return all(layer_visibility(model, cfg, i)[0] is not None for i in range(model.num_layers))


UNCAPPED = 2**40  # the longest context past the model's limit: "unbounded" when a window keeps it this long


def longest_context(model: ModelConfig, cfg: CacheConfig, batch: int, budget: int, capped: bool = True) -> int:
    """The longest context (up to the model's, unless not ``capped``: then up to ``UNCAPPED``) whose
    KV for ``batch`` sequences fits ``budget`` bytes; raises when not even one token fits."""
    one = kv_size(model, cfg, 1, batch).bytes_total
    if one > budget:
        raise InvalidParams(f"a budget of {budget:,} bytes is smaller than one token's KV for batch {batch} "
                            f"({one:,} bytes)")
    lo, hi = 1, model.max_position if capped else UNCAPPED
    if kv_size(model, cfg, hi, batch).bytes_total <= budget:
        return hi
    while lo < hi:  # bytes grow monotonically with the context
        mid = (lo + hi + 1) // 2
        if kv_size(model, cfg, mid, batch).bytes_total <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_batch(model: ModelConfig, cfg: CacheConfig, context: int, budget: int) -> int:
    return int(budget // kv_size(model, cfg, context, 1).bytes_total)
