"""Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2 (QKV bias), Qwen3 (QK norm), Phi-3.

Q/K/V are fused into one matrix and gate/up into another at load time: one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.attention.context import AttentionContext
from kvcache.errors import ModelLoadError
from kvcache.models.base import CausalLM
from kvcache.models.config import ModelConfig
from kvcache.models.layers import (
    Rotary, activation, apply_rotary, fold_norm, frozen, frozen_t, linear, rms_norm, strip_prefix,
)


class LlamaLayer(nn.Module):
    def __init__(self, sd: dict[str, torch.Tensor], p: str, cfg: ModelConfig) -> None:
        super().__init__()
        a, m = f"{p}.self_attn", f"{p}.mlp"
        if f"{a}.qkv_proj.weight" in sd:  # Phi-3 ships it fused
            self.qkv = frozen_t(sd[f"{a}.qkv_proj.weight"])  # [H, (Hq + 2 Hkv) D]
        else:
            self.qkv = frozen_t(torch.cat([sd[f"{a}.{n}_proj.weight"] for n in "qkv"]))
        bias = [sd.get(f"{a}.{n}_proj.bias") for n in "qkv"]
        self.qkv_b = frozen(torch.cat(bias)) if all(b is not None for b in bias) else None  # type: ignore[arg-type]
        self.o = frozen_t(sd[f"{a}.o_proj.weight"])
        self.o_b = frozen(sd[f"{a}.o_proj.bias"]) if f"{a}.o_proj.bias" in sd else None
        self.q_norm = frozen(sd[f"{a}.q_norm.weight"]) if cfg.qk_norm else None
        self.k_norm = frozen(sd[f"{a}.k_norm.weight"]) if cfg.qk_norm else None
        if f"{m}.gate_up_proj.weight" in sd:
            self.gate_up = frozen_t(sd[f"{m}.gate_up_proj.weight"])  # [H, 2 I]
        else:
            self.gate_up = frozen_t(torch.cat([sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"]]))
        self.down = frozen_t(sd[f"{m}.down_proj.weight"])  # [I, H]
        # the norms before attention and MLP are folded into the projections they feed
        self.qkv = frozen(fold_norm(sd[f"{p}.input_layernorm.weight"], self.qkv))
        self.gate_up = frozen(fold_norm(sd[f"{p}.post_attention_layernorm.weight"], self.gate_up))


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        sd = strip_prefix(sd, ("model.language_model.", "language_model."))
        try:
            self.embed = frozen(sd["model.embed_tokens.weight"])  # [V, H]
            self.layers = nn.ModuleList(
                LlamaLayer(sd, f"model.layers.{i}", config) for i in range(config.num_layers)
            )
            final_norm = sd["model.norm.weight"]
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]!r} for a {config.model_type} model") from None
        head = sd.get("lm_head.weight")
        head_t = (self.embed if config.tie_embeddings or head is None else head).t()
        self.lm_head = frozen(fold_norm(final_norm, head_t))  # [H, V], final norm folded in
        partial = float(config.raw.get("partial_rotary_factor", 1.0))
        self.rope = Rotary(int(config.head_dim * partial), config.rope_theta, config.rope_scaling)
        self.act = activation(config.hidden_act)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R]
    ) -> torch.Tensor:  # [R or N, V]
        cfg = self.config
        n, hq, hkv, d, eps = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
        x = F.embedding(input_ids, self.embed)  # [N, H]
        cos, sin = self.rope.tables(positions)  # [N, 1, R]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, None, eps)
            qkv = linear(h, layer.qkv, layer.qkv_b).view(n, hq + 2 * hkv, d)
            qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
            if layer.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :hq], layer.q_norm, eps), rms_norm(qk[:, hq:], layer.k_norm, eps)), 1)
            qk = apply_rotary(qk, cos, sin)  # q and k heads in one pass
            o = ctx.attend(i, qk[:, :hq], qk[:, hq:], v, cfg.scale)  # [N, Hq, D]
            x.add_(linear(o.reshape(n, hq * d), layer.o, layer.o_b))
            h = rms_norm(x, None, eps)
            gate, up = linear(h, layer.gate_up).chunk(2, -1)
            x.add_(linear(self.act(gate).mul_(up), layer.down))
        if logits_rows is not None:
            x = x[logits_rows]
        return linear(rms_norm(x, None, eps), self.lm_head)
