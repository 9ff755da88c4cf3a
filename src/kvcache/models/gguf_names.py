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
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "olmoe", "gpt-oss", "gemma2", "gemma3", "phi3",
             "smollm3", "gpt2")  # GGUF architectures
_MOE = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj"}
# gpt-oss: the router under transformers' name, the norm before the experts as llama.cpp names it,
# the learned sink logits
_GPT_OSS_BLOCK = {**_LLAMA_BLOCK, **_MOE, "ffn_gate_inp": "mlp.router", "post_attention_norm": "post_attention_layernorm",
                  "attn_sinks": "self_attn.sinks"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# tensors outside the layers that are not HF weights: RoPE frequency factors (llama3's scaling, Phi-3's
# longrope), kept under these names for the model to read
ROPE_TENSORS = {"rope_freqs.weight": "model.rope_freqs", "rope_factors_long.weight": "model.rope_factors_long",
                "rope_factors_short.weight": "model.rope_factors_short"}

Required = bool | str  # True, False, or the name of a part that stands in for this one (fused QKV)


def expected_tensors(arch: str, meta: dict[str, Any]) -> tuple[dict[str, bool], dict[str, Required]]:
    """(top-level tensor -> required, per-layer part -> required) of ``arch`` as kvcache's model
    and llama.cpp's loader take them; any other tensor in a file is refused."""
    if arch == "gpt2":
        top = {"token_embd.weight": True, "position_embd.weight": True, "output_norm.weight": True,
               "output_norm.bias": True, "output.weight": False}
        return top, {f"{p}.{s}": True for p in _GPT2_BLOCK for s in ("weight", "bias")}
    top = {"token_embd.weight": True, "output_norm.weight": True, "output.weight": False}
    layer: dict[str, Required] = {f"{p}.weight": True for p in ("attn_norm", "attn_output", "ffn_norm")}
    qkv = "attn_qkv.weight" if arch == "phi3" else None
    for p in "qkv":
        layer[f"attn_{p}.weight"] = qkv or True
        layer[f"attn_{p}.bias"] = arch == "qwen2"
    if arch == "phi3":
        layer.update({"attn_qkv.weight": "attn_q.weight", "attn_qkv.bias": False, "ffn_up.weight": True,
                      "ffn_down.weight": True})
        top.update({"rope_factors_long.weight": False, "rope_factors_short.weight": False})
        return top, layer
    if arch == "gpt-oss":  # llama.cpp's openai-moe loader requires every one of these
        layer = {f"{p}.weight": True for p in ("attn_norm", "post_attention_norm", "attn_output", "attn_sinks", *_MOE)}
        layer.update({f"{p}.bias": True for p in ("attn_q", "attn_k", "attn_v", "attn_output", *_MOE)})
        layer.update({f"attn_{p}.weight": True for p in "qkv"})
        return top, layer
    layer.update({"attn_output.bias": False})
    if arch in ("qwen3", "qwen3moe", "olmoe", "gemma3"):
        layer.update({"attn_q_norm.weight": True, "attn_k_norm.weight": True})
    if arch in ("gemma2", "gemma3"):
        layer.update({"post_attention_norm.weight": True, "post_ffw_norm.weight": True})
    if arch == "gemma2":
        del top["output.weight"]  # llama.cpp's gemma2 always reads its head from token_embd
    if arch in ("qwen3moe", "olmoe") or has_experts(arch, meta):
        layer.update({f"{p}.weight": True for p in _MOE})
        if arch == "llama":
            top["rope_freqs.weight"] = False
        return top, layer
    layer.update({f"{p}.weight": True for p in ("ffn_gate", "ffn_up", "ffn_down")})
    if arch not in ("gemma2", "gemma3"):
        layer.update({f"{p}.bias": False for p in ("ffn_gate", "ffn_up", "ffn_down")})
    if arch in ("llama", "smollm3"):
        top["rope_freqs.weight"] = False
    return top, layer


def has_experts(arch: str, meta: dict[str, Any]) -> bool:
    """Whether a llama file is a mixture of experts (Mixtral: ``llama.expert_count`` > 0)."""
    value = meta.get(f"{arch}.expert_count") if arch == "llama" else None
    value = value[0] if isinstance(value, list) and value else value
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def hf_tensor_name(arch: str, name: str) -> str | None:
    """HF name of a GGUF tensor (RoPE factor tensors: ROPE_TENSORS' names; a MoE layer's expert
    tensors: a name with ``{e}`` for the expert), or None for a tensor no table maps."""
    if name in ROPE_TENSORS:
        return ROPE_TENSORS[name]
    if arch == "gpt2":
        top = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
               "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
               "output.weight": "lm_head.weight"}
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
    table = (_GEMMA_BLOCK if arch in ("gemma2", "gemma3") else _GPT_OSS_BLOCK if arch == "gpt-oss"
             else {**_LLAMA_BLOCK, **_MOE} if arch in ("qwen3moe", "olmoe", "llama") else _LLAMA_BLOCK)
    part = m.group(2)
    if arch == "phi3" and part == "ffn_up":
        return f"model.layers.{m.group(1)}.mlp.gate_up_proj.{m.group(3)}"
    if part not in table:
        return None
    return f"model.layers.{m.group(1)}.{table[part]}.{m.group(3)}"
