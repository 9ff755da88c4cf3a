"""Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2 (QKV bias), Qwen3 (QK norm), Phi-3.

Q/K/V are fused into one projection and gate/up into another at load time (one product each;
Phi-3 checkpoints ship them fused already). The RMSNorm weights before attention and MLP are
folded into those projections (into the fp32 matrix, or as the input scale of a quantized one:
models/weights.py). Biases are taken wherever the checkpoint has them (Qwen2's q/k/v, Llama's
attention_bias / mlp_bias).
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.attention.interface import AttentionContext
from kvcache.errors import ModelLoadError
from kvcache.kernels.qweight import LayerStack
from kvcache.kernels.rotary import Rotary
from kvcache.models.base import CausalLM
from kvcache.models.config import ModelConfig
from kvcache.models.layers import (
    ACT_KERNEL, activation, attention_block, frozen, mlp, pack_bias, packed_rows,
    text_model_names,
)
from kvcache.models.weights import embedding, projection


def _cat_bias(sd: dict, keys: list[str], sizes: list[int]) -> torch.Tensor | None:
    """Concatenated biases [sum(sizes)] of fused projections; zeros for a part without one; None
    when no part has a bias."""
    if not any(k in sd for k in keys):
        return None
    return torch.cat([sd[k].float() if k in sd else torch.zeros(n) for k, n in zip(keys, sizes)])


class LlamaLayer(nn.Module):
    def __init__(self, sd: dict, p: str, cfg: ModelConfig, weights: str) -> None:
        super().__init__()
        a, m = f"{p}.self_attn", f"{p}.mlp"
        hq, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        if f"{a}.qkv_proj.weight" in sd:  # Phi-3 ships it fused
            qkv, qkv_b = [sd[f"{a}.qkv_proj.weight"]], sd.get(f"{a}.qkv_proj.bias")  # [(Hq + 2 Hkv) D, H]
        else:
            qkv = [sd[f"{a}.{n}_proj.weight"] for n in "qkv"]
            qkv_b = _cat_bias(sd, [f"{a}.{n}_proj.bias" for n in "qkv"], [hq * d, hkv * d, hkv * d])
        if f"{m}.gate_up_proj.weight" in sd:  # Phi-3
            gate_up, gate_up_b = [sd[f"{m}.gate_up_proj.weight"]], sd.get(f"{m}.gate_up_proj.bias")  # [2 I, H]
        else:
            gate_up = [sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"]]
            gate_up_b = _cat_bias(sd, [f"{m}.gate_proj.bias", f"{m}.up_proj.bias"], [inter, inter])
        # the norms before attention and MLP are folded into the projections they feed
        self.qkv = projection(qkv, sd[f"{p}.input_layernorm.weight"], weights)  # [k, H, (Hq + 2 Hkv) D / k]
        self.qkv_b = pack_bias(qkv_b, self.qkv)
        self.o = projection([sd[f"{a}.o_proj.weight"]], None, weights)  # [k, Hq D, H / k]
        self.o_b = pack_bias(sd.get(f"{a}.o_proj.bias"), self.o)
        self.gate_up = projection(gate_up, sd[f"{p}.post_attention_layernorm.weight"], weights)  # [k, H, 2I / k]
        self.gate_up_b = pack_bias(gate_up_b, self.gate_up)
        self.down = projection([sd[f"{m}.down_proj.weight"]], None, weights)  # [k, I, H / k]
        self.down_b = pack_bias(sd.get(f"{m}.down_proj.bias"), self.down)
        # Qwen3: per-head RMSNorm of q and k; one weight [Hq + Hkv, D] normalizes both in one call
        self.qk_norm = None
        if cfg.qk_norm:
            q_w, k_w = sd[f"{a}.q_norm.weight"].float(), sd[f"{a}.k_norm.weight"].float()  # [D] each
            self.qk_norm = frozen(torch.cat((q_w.expand(hq, d), k_w.expand(hkv, d))))


def rotary_of(config: ModelConfig, sd: dict) -> Rotary:
    """The model's RoPE: its config's scaling, with a GGUF's factor tensors (``model.rope_freqs``,
    llama3's scaling as llama.cpp's converter writes it; Phi-3's long and short factors)."""
    rot = int(config.head_dim * config.partial_rotary_factor)
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    long_f, short_f = sd.get("model.rope_factors_long"), sd.get("model.rope_factors_short")
    if long_f is not None or short_f is not None:
        if long_f is None or short_f is None:
            raise ModelLoadError("the file has one of rope_factors_long and rope_factors_short; longrope needs both")
        scaling = {"rope_type": "longrope", **(scaling or {}),
                   "long_factor": long_f.float().tolist(), "short_factor": short_f.float().tolist()}
    if scaling is not None and scaling.get("rope_type") == "longrope":
        scaling.setdefault("original_max_position_embeddings",
                           config.raw.get("original_max_position_embeddings", config.max_position))
    freqs = sd.get("model.rope_freqs")  # [rot / 2]
    return Rotary(rot, config.rope_theta, scaling, config.max_position, None if freqs is None else freqs.float())


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict, weights: str = "fp32") -> None:
        super().__init__()
        self.config = config
        sd = text_model_names(sd)
        try:
            embed = sd["model.embed_tokens.weight"]  # [V, H]
            self.layers = nn.ModuleList(
                LlamaLayer(sd, f"model.layers.{i}", config, weights) for i in range(config.num_layers)
            )
            self.norm = frozen(sd["model.norm.weight"])  # [H]
        except KeyError as e:
            missing = e.args[0]
            raise ModelLoadError(f"weights are missing tensor {missing!r} for a {config.model_type} model") from None
        head = sd.get("lm_head.weight")
        self.tied = config.tie_embeddings or head is None
        self.lm_head = projection([embed if self.tied else head], None, weights)  # [k, H, V / k] (padded)
        # a tied table is read from the packed head: one copy of it in memory
        self.embed = None if self.tied else embedding(embed, weights)  # [V, H]
        self.rope = rotary_of(config, sd)
        self.act = activation(config.hidden_act)
        self.act_kernel = ACT_KERNEL.get(config.hidden_act)
        # the per-layer tensors as plain tuples: the decode loop skips nn.Module attribute lookups
        # (a Parameter keeps its identity through .to()/.float(), so these stay valid)
        self.plan = [
            (ly.qkv, ly.qkv_b, ly.qk_norm, ly.o, ly.o_b, ly.gate_up, ly.gate_up_b, ly.down, ly.down_b)
            for ly in self.layers
        ]
        # quantized weights: every layer in one native call a forward when the context allows it
        # NoPE layers (SmolLM3) take rotary table 1, the identity (cos 1, sin 0: q and k as they are)
        self.stack = LayerStack.of(
            [(qkv, qkv_b, qkn, o, o_b, None, gu, gu_b, dn, dn_b, None, int(not config.has_rope(i)))
             for i, (qkv, qkv_b, qkn, o, o_b, gu, gu_b, dn, dn_b) in enumerate(self.plan)],
            (config.num_heads, config.num_kv_heads, config.head_dim), self.act_kernel)
        self.nope = bool(config.rope_layers) and not all(config.rope_layers)

    def rotary_for_layer(self, layer: int) -> Rotary | None:
        return self.rope if self.config.has_rope(layer) else None

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R] int64
    ) -> torch.Tensor:  # [R or N, V] float32
        cfg = self.config
        hq, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
        scale, act, heads = cfg.scale, self.act, (hq, hkv, d)
        x = packed_rows(self.lm_head if self.embed is None else self.embed, input_ids)  # [N, H]
        cos, sin = self.rope.tables(positions)  # [N, 1, R] each
        tables = [(cos, sin), (torch.ones_like(cos), torch.zeros_like(sin))] if self.nope else [(cos, sin)]
        if self.stack is not None and self.stack.run(ctx, x, tables, eps, scale):
            return self.head(x, logits_rows)
        for i, (qkv_w, qkv_b, qk_norm, o_w, o_b, gu_w, gu_b, down_w, down_b) in enumerate(self.plan):
            c, s = tables[int(not cfg.has_rope(i))]
            attention_block(ctx, i, x, (qkv_w, qkv_b, o_w, o_b), heads, c, s, qk_norm, eps, scale)
            mlp(x, gu_w, gu_b, down_w, down_b, act, self.act_kernel, eps)
        return self.head(x, logits_rows)

