"""What the bridge needs to know about an HF model: its decoder's attention layers (full or
sliding, and the window), its context length, and, for attention sinks, its rotary embedding.

Read from a ``transformers.PretrainedConfig`` with transformers' own layer-type logic, so sliding
layers follow the model (Gemma 3, Mistral). Head counts and head size are taken from the first
K/V the model hands the cache (``model_config``), so any decoder works, encoder–decoder ones
included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcache.errors import InvalidParams, KVCacheError
from kvcache.models.config import ModelConfig
from kvcache.kernels.rotary import Rotary

_SLIDING = "sliding_attention"
_KNOWN = ("full_attention", _SLIDING)


@dataclass(frozen=True)
class Layout:
    model_type: str
    layer_types: tuple[str, ...]  # per decoder layer: full_attention | sliding_attention
    windows: tuple[int | None, ...]  # per layer: the model's own sliding window, None for full
    max_position: int
    hf_config: Any = None  # the decoder's PretrainedConfig (for the rotary embedding of sinks)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def model_config(self, num_kv_heads: int, head_dim: int) -> ModelConfig:
        """The ModelConfig a PagedKVCache needs, once the K/V shapes are known."""
        return ModelConfig(model_type=self.model_type, vocab_size=0, hidden_size=0, intermediate_size=0,
                           num_layers=self.num_layers, num_heads=num_kv_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, max_position=self.max_position, layer_windows=self.windows)

    def rotaries(self) -> list[Rotary | None]:
        """Per layer, the rotary embedding that placed its keys (None: the model has no RoPE).
        Raises KVCacheError for a model whose RoPE kvcache does not know."""
        raw = self.hf_config.to_dict() if self.hf_config is not None else {}
        if raw.get("model_type") == "gpt2":
            return [None] * self.num_layers  # learned absolute positions: keys carry no rotation
        try:
            mc = ModelConfig.from_hf(raw)
        except KVCacheError:
            raise InvalidParams(f"attention sinks re-position keys with the model's RoPE, which kvcache does not "
                                f"know for {self.model_type!r} (it does for Llama, Mistral, Qwen2/3, Phi-3, "
                                "Gemma 3, SmolLM3); use window=N without sinks") from None
        if mc.family == "gemma3":
            glob = Rotary(mc.head_dim, mc.rope_theta, mc.rope_scaling, mc.max_position)
            local = Rotary(mc.head_dim, mc.rope_local_theta or mc.rope_theta)
            return [local if t == _SLIDING else glob for t in self.layer_types]
        rot = Rotary(int(mc.head_dim * mc.partial_rotary_factor), mc.rope_theta, mc.rope_scaling, mc.max_position)
        return [rot if mc.has_rope(i) else None for i in range(self.num_layers)]  # SmolLM3's NoPE layers: None


def layout_of(config: Any) -> Layout:
    """The decoder layout of an HF ``PretrainedConfig`` (a model's ``.config``)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    types, kwargs = list(types), list(kwargs)
    n = (getattr(config, "num_decoder_layers", None) or getattr(config, "decoder_layers", None)
         if config.is_encoder_decoder else None) or getattr(text, "num_hidden_layers", None)
    if n and n != len(types) and set(types) == {"full_attention"}:  # some encoder-decoder configs
        types, kwargs = ["full_attention"] * int(n), [{}] * int(n)
    odd = sorted(set(types) - set(_KNOWN))
    if odd:
        raise InvalidParams(f"kvcache.hf supports full and sliding attention layers; this model has {', '.join(odd)}")
    windows = tuple(int(k["sliding_window"]) if t == _SLIDING else None for t, k in zip(types, kwargs))
    max_pos = (getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
               or getattr(text, "max_target_positions", None) or 4096)
    return Layout(str(getattr(text, "model_type", "") or config.model_type), tuple(types), windows, int(max_pos),
                  text)
