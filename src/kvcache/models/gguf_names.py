"""GGUF tensor names and metadata -> HF tensor names and config.json, per architecture."""

from __future__ import annotations

import re
from typing import Any

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT2_BLOCK = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(arch: str, name: str) -> str | None:
    """HF name of a GGUF tensor, or None for tensors HF models do not have (e.g. rope_freqs)."""
    if arch == "gpt2":
        top = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
               "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
               "output.weight": None}
        if name in top:
            return top[name]
        m = _BLOCK.match(name)
        if not m or m.group(2) not in _GPT2_BLOCK:
            return None
        return f"transformer.h.{m.group(1)}.{_GPT2_BLOCK[m.group(2)]}.{m.group(3)}"
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    m = _BLOCK.match(name)
    if not m:
        return None
    table = _GEMMA_BLOCK if arch == "gemma3" else _LLAMA_BLOCK
    part = m.group(2)
    if arch == "phi3" and part == "ffn_up":
        return f"model.layers.{m.group(1)}.mlp.gate_up_proj.{m.group(3)}"
    if part not in table:
        return None
    return f"model.layers.{m.group(1)}.{table[part]}.{m.group(3)}"


def hf_config_from_meta(arch: str, meta: dict[str, Any], n_vocab: int | None, has_output: bool) -> dict[str, Any]:
    """config.json for the HF model type of a GGUF architecture."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    vocab = int(get("vocab_size", n_vocab or 0))
    if arch == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
                "n_embd": int(get("embedding_length")), "n_layer": int(get("block_count")),
                "n_head": int(get("attention.head_count")), "n_positions": int(get("context_length")),
                "n_inner": int(get("feed_forward_length")), "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
                "bos_token_id": bos, "eos_token_id": eos, "tie_word_embeddings": True}
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    model_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma3": "gemma3_text", "phi3": "phi3"}[arch]
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
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
    scale_type, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if scale_type == "linear" and factor and float(factor) != 1.0:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if arch in ("mistral", "phi3") and get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    if arch == "gemma3":
        window = int(get("attention.sliding_window", 512))
        cfg.update({
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim, "sliding_window": window, "rope_local_base_freq": 10000.0,
            # llama.cpp's Gemma 3: every sixth layer attends globally, the rest in the window
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        })
    return cfg
