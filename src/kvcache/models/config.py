"""ModelConfig: the architecture facts the model code and the cache need, parsed from an HF config.

Every model we load ends up as an HF-format config dict (GGUF files are converted to one), so this is
the single place that reads architecture hyper-parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcache.errors import ModelLoadError, UnsupportedArchitecture

# HF `model_type` -> our family name (the module in kvcache.models that implements it).
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "qwen3moe",
    "mixtral": "qwen3moe",  # Mixtral: Mistral's attention (no q/k norm) with the same sparse MLP
    "olmoe": "qwen3moe",  # OLMoE: one RMSNorm over all of q and one over all of k, the same sparse MLP
    "phi3": "llama",
    "smollm3": "llama",  # SmolLM3: Llama with RoPE left out of every fourth layer (rope_layers)
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gemma2": "gemma3",  # Gemma 2: Gemma 3's layers without the q/k norm, attention logits soft-capped
    "gpt_oss": "gptoss",  # gpt-oss: a mixture with learned attention sinks, biased experts, clamped SwiGLU
    "gpt2": "gpt2",
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # rope_theta for sliding-window layers where it differs (Gemma 3's local layers)
    rope_local_theta: float | None = None
    # linear/llama3/yarn scaling parameters as in HF's rope_scaling, or None
    rope_scaling: dict[str, Any] | None = None
    # per layer: None (full attention) or the sliding window in tokens (a key is visible when
    # query_pos - key_pos < window, HF's convention)
    layer_windows: tuple[int | None, ...] = ()
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # attention scale; None means head_dim ** -0.5
    attn_scale: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # share of head_dim that RoPE rotates (Phi-3/Phi-4-mini style partial rotary), 1.0 = all of it
    partial_rotary_factor: float = 1.0
    # per layer: whether RoPE turns its q and k (False: a NoPE layer, SmolLM3's every fourth);
    # empty: every layer
    rope_layers: tuple[bool, ...] = ()
    # attention logit soft cap (Gemma 2's attn_logit_softcapping): scores -> cap * tanh(scores / cap)
    # before the mask; None: none
    attn_softcap: float | None = None
    # a learned logit per layer and query head joins every attention softmax with no value (gpt-oss's
    # sinks, held by the model's weights); no native attention kernel takes them
    attn_sink_logits: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def kv_bytes_per_token(self, element_size: int = 4) -> int:
        """Bytes of K and V for one token across all layers (full attention accounting)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse an HF config.json dict. Raises UnsupportedArchitecture for unknown model types and
        ModelLoadError for a config that lacks a needed value."""
        try:
            return cls._from_hf(cfg)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"config.json has a bad value ({e})") from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        mt = cfg.get("model_type", "")
        if mt == "gemma3" and "text_config" in cfg:
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
            mt = "gemma3_text"
        if mt not in FAMILIES:
            raise UnsupportedArchitecture(
                f"unsupported architecture {mt or '(none)'!r}; supported: {', '.join(sorted(FAMILIES))}"
            )
        if mt == "gpt2":
            return _gpt2(cfg)
        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        windows = _layer_windows(cfg, n_layers)
        rope_theta, local_theta, scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
        scale = None
        if mt.startswith("gemma"):
            scale = float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
        cap = cfg.get("attn_logit_softcapping")
        if cap is not None and not mt.startswith("gemma"):  # only Gemma's model code checks its contexts carry it
            raise UnsupportedArchitecture(f"{mt} with attn_logit_softcapping is not supported")
        if cap is not None and float(cap) <= 0:
            raise ModelLoadError(f"config.json has attn_logit_softcapping {cap}; a soft cap must be positive")
        return cls(
            model_type=mt,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_local_theta=local_theta,
            rope_scaling=scaling,
            layer_windows=windows,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", mt.startswith("gemma"))),
            attention_bias=bool(cfg.get("attention_bias", mt in ("qwen2", "gpt_oss"))),
            qk_norm=mt in ("qwen3", "gemma3_text"),
            hidden_act=act,
            attn_scale=scale,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            partial_rotary_factor=_partial_rotary(cfg),
            rope_layers=_rope_layers(cfg, n_layers),
            attn_softcap=float(cap) if cap is not None else None,
            attn_sink_logits=mt == "gpt_oss",
            raw=dict(cfg),
        )

    def has_rope(self, layer: int) -> bool:
        """Whether RoPE turns layer ``layer``'s queries and keys."""
        return not self.rope_layers or self.rope_layers[layer]


def _rope_layers(cfg: dict[str, Any], n_layers: int) -> tuple[bool, ...]:
    """SmolLM3's NoPE layers: ``no_rope_layers`` (1 where RoPE is used), or one NoPE layer every
    ``no_rope_layer_interval`` (4) layers as transformers fills it in; () for other families."""
    if cfg.get("model_type") != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval")
        every = 4 if every is None else int(every)
        if every < 1:
            raise ModelLoadError(f"config.json has no_rope_layer_interval {every}; it must be at least 1")
        return tuple((i + 1) % every != 0 for i in range(n_layers))
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"config.json's no_rope_layers must be {n_layers} values of 0 or 1, one a layer")
    return tuple(bool(f) for f in flags)


def _layer_windows(cfg: dict[str, Any], n_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if cfg.get("model_type") == "smollm3" and not cfg.get("use_sliding_window"):
        return (None,) * n_layers  # its layer_types name windows that only use_sliding_window turns on
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    mt = cfg.get("model_type")
    if mt in ("mistral", "phi3", "mixtral") and window:
        return (int(window),) * n_layers
    if mt in ("qwen2", "qwen3") and window and cfg.get("use_sliding_window"):
        upto = int(cfg.get("max_window_layers", n_layers))
        return tuple(int(window) if i >= upto else None for i in range(n_layers))
    return (None,) * n_layers


def _rope(cfg: dict[str, Any]) -> tuple[float, float | None, dict[str, Any] | None]:
    """(global theta, local theta for sliding layers or None, scaling dict or None)."""
    params = cfg.get("rope_parameters")
    local = cfg.get("rope_local_base_freq")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        if "full_attention" in params:  # per layer type (transformers 5 Gemma 3)
            full = params["full_attention"]
            theta = full.get("rope_theta", theta)
            local = params.get("sliding_attention", {}).get("rope_theta", local)
            scaling = full if full.get("rope_type", "default") != "default" else None
        else:
            theta = params.get("rope_theta", theta)
            scaling = params if params.get("rope_type", "default") != "default" else None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), (float(local) if local else None), scaling


def _partial_rotary(cfg: dict[str, Any]) -> float:
    """partial_rotary_factor at the top level (transformers 4) or inside rope_parameters (5)."""
    params = cfg.get("rope_parameters")
    value = cfg.get("partial_rotary_factor")
    if value is None and isinstance(params, dict):
        value = params.get("partial_rotary_factor")
    return float(value) if value is not None else 1.0


def _gpt2(cfg: dict[str, Any]) -> ModelConfig:
    hidden = int(cfg.get("n_embd", cfg.get("hidden_size", 768)))
    heads = int(cfg.get("n_head", cfg.get("num_attention_heads", 12)))
    layers = int(cfg.get("n_layer", cfg.get("num_hidden_layers", 12)))
    eos = cfg.get("eos_token_id", 50256)
    return ModelConfig(
        model_type="gpt2",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("n_inner") or 4 * hidden),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position=int(cfg.get("n_positions", 1024)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        layer_windows=(None,) * layers,
        tie_embeddings=True,
        attention_bias=True,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        raw=dict(cfg),
    )
