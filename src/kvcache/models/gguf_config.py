"""GGUF metadata -> the config.json of the HF model type of its architecture.

Every key that changes the arithmetic lands here or is refused by models/gguf_check.py first; RoPE
factor tensors (llama3's ``rope_freqs``, Phi-3's long and short factors) stay tensors: the model
reads them from its weights (models/rope_factors.py).
"""

from __future__ import annotations

from typing import Any

from kvcache.models.gguf_names import has_experts

MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
               "smollm3": "smollm3", "olmoe": "olmoe", "gpt-oss": "gpt_oss",
               "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}


def _one(value: Any) -> Any:
    """A key's value, or the one value of a per-layer array (gguf_check refuses non-uniform ones)."""
    return value[0] if isinstance(value, list) and value else value


def hf_config_from_meta(arch: str, meta: dict[str, Any], n_vocab: int | None, tensors: set[str]) -> dict[str, Any]:
    """config.json for the HF model type of a GGUF architecture; ``tensors``: the file's tensor names."""

    def get(key: str, default: Any = None) -> Any:
        return _one(meta.get(f"{arch}.{key}", default))

    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    vocab = int(get("vocab_size", n_vocab or 0))
    has_output = "output.weight" in tensors
    if arch == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
                "n_embd": int(get("embedding_length")), "n_layer": int(get("block_count")),
                "n_head": int(get("attention.head_count")), "n_positions": int(get("context_length")),
                "n_inner": int(get("feed_forward_length")), "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
                "bos_token_id": bos, "eos_token_id": eos, "tie_word_embeddings": not has_output}
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    max_pos = int(get("context_length", 2048))
    cfg: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
    }
    rope_dims = get("rope.dimension_count")
    if rope_dims and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    scaling = _rope_scaling(get, max_pos, tensors)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if arch == "smollm3":  # llama.cpp's rule (no key says it): every fourth layer without RoPE
        cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    if arch in ("mistral", "phi3") and get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    if arch == "qwen3moe":
        cfg.update({"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
                    "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
                    # llama.cpp's qwen3moe always renormalises the chosen experts' weights
                    "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1})
    if arch == "olmoe":  # each expert feed_forward_length wide; llama.cpp never renormalises its top-k weights
        cfg.update({"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
                    "norm_topk_prob": False})
    if has_experts(arch, meta):  # Mixtral, as llama.cpp's converter writes it
        cfg.update({"model_type": "mixtral", "num_local_experts": int(get("expert_count")),
                    "num_experts_per_tok": int(get("expert_used_count")),
                    "moe_intermediate_size": int(get("feed_forward_length"))})
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma(arch, meta, get, layers, hidden, heads, head_dim))
    if arch == "gpt-oss":  # llama.cpp's openai-moe: a window on every other layer from the first unless the
        # file's pattern says otherwise, the experts' clamped SwiGLU at its fixed alpha and limit
        window = int(get("attention.sliding_window"))
        cfg.update({"num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
                    "intermediate_size": int(get("expert_feed_forward_length")), "attention_bias": True,
                    "sliding_window": window, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                    "layer_types": _layer_types(meta, arch, layers, 2)})
    return cfg


def _layer_types(meta: dict[str, Any], arch: str, layers: int, pattern: int) -> list[str]:
    """Each layer's ``sliding_attention`` or ``full_attention`` as llama.cpp's loader reads them: the
    file's ``attention.sliding_window_pattern`` (one flag a layer, or n: every n-th layer full, the
    others sliding; 0: all sliding), else ``pattern``."""
    given = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
    if isinstance(given, list):
        sliding = [bool(b) for b in given][:layers]
    else:
        n = int(given)
        sliding = [n == 0 or (i % n) < n - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _rope_scaling(get: Any, max_pos: int, tensors: set[str]) -> dict[str, Any] | None:
    """HF's rope_scaling dict of the file's rope.scaling.* keys (gguf_check refused other types)."""
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind is None and get("rope.scale_linear") is not None:  # the older key of a linear scaling
        kind, factor = "linear", get("rope.scale_linear")
    orig = get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors or kind == "longrope":
        out: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(orig or max_pos)}
        if get("rope.scaling.attn_factor") is not None:
            out["attention_factor"] = float(get("rope.scaling.attn_factor"))
        return out
    if kind == "linear" and factor and float(factor) != 1.0:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor or 1.0), "original_max_position_embeddings": int(orig or max_pos)}
        for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                          ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}") is not None:
                out[name] = float(get(f"rope.scaling.{key}"))
        return out
    return None


def _gemma(arch: str, meta: dict[str, Any], get: Any, layers: int, hidden: int, heads: int,
           head_dim: int) -> dict[str, Any]:
    """Gemma 2's and 3's sliding layers, local RoPE base, query scale and soft caps, as llama.cpp's
    loader reads them. Gemma 3: a window only when the file gives one, every sixth layer global
    unless ``sliding_window_pattern`` says otherwise, the local base 10000 unless given, the 62-layer
    27B model's query scale hidden / heads. Gemma 2: a window of 4096 unless given on every other
    layer from the first (pattern 2), one RoPE base unless ``rope.freq_base_swa`` differs, the
    46-layer 27B model's scale hidden / heads, the head tied to the embeddings, both soft caps
    (50 and 30 unless given). llama.cpp never caps a gemma3 file's attention: gguf_check refuses
    a gemma3 file that asks for it."""
    two = arch == "gemma2"
    window = int(get("attention.sliding_window") or (4096 if two else 0))
    types = _layer_types(meta, arch, layers, 2 if two else 6) if window > 0 else ["full_attention"] * layers
    base = float(get("rope.freq_base", 10000.0))
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == (46 if two else 62) else head_dim,
        "sliding_window": window or None,
        "rope_local_base_freq": float(get("rope.freq_base_swa", base if two else 10000.0)),
        "layer_types": types,
    }
    if two:  # llama.cpp's gemma2 caps both, at 50 and 30 where the file says nothing
        out.update({"tie_word_embeddings": True, "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0)),
                    "final_logit_softcapping": float(get("final_logit_softcapping", 30.0))})
    elif get("final_logit_softcapping"):  # gemma3: a final cap only where the file gives one (0: none)
        out["final_logit_softcapping"] = float(get("final_logit_softcapping"))
    return out
