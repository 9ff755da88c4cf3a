"""Gemma 3 (text) and Gemma 2: scaled embeddings, four norms per layer, hybrid sliding/full layers;
Gemma 3's QK norm, Gemma 2's soft-capped attention logits (attention/dense.py soft_cap: no native
kernel takes them, so a Gemma 2 forward goes layer by layer, its attention dense).

Gemma's RMSNorm multiplies by (1 + w); the +1 is folded into the stored weights at load time, and
the two norms that feed a projection (input, pre-feedforward) are folded into its matrix.
Sliding layers use their own RoPE base (rope_local_theta, no scaling); windows live in
config.layer_windows and are applied by the attention context.
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


def _w(sd: dict, key: str) -> torch.Tensor:
    """A Gemma norm weight [H] as the factor it multiplies by: 1 + w, in fp32."""
    return sd[key].float() + 1.0


class Gemma3Layer(nn.Module):
    def __init__(self, sd: dict, p: str, cfg: ModelConfig, weights: str) -> None:
        super().__init__()
        a, m = f"{p}.self_attn", f"{p}.mlp"
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = [sd[f"{a}.{n}_proj.weight"] for n in "qkv"]  # [(Hq + 2 Hkv) D, H] together
        self.qkv = projection(qkv, _w(sd, f"{p}.input_layernorm.weight"), weights)  # [k, H, (Hq+2Hkv) D / k]
        qkv_b = torch.cat([sd[f"{a}.{n}_proj.bias"] for n in "qkv"]) if f"{a}.q_proj.bias" in sd else None
        self.qkv_b = pack_bias(qkv_b, self.qkv)  # [k, 1, (Hq+2Hkv) D / k] or None
        self.o = projection([sd[f"{a}.o_proj.weight"]], None, weights)  # [k, Hq D, H / k]
        gate_up = [sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"]]  # [2I, H] together
        self.gate_up = projection(gate_up, _w(sd, f"{p}.pre_feedforward_layernorm.weight"), weights)  # [k, H, 2I / k]
        self.down = projection([sd[f"{m}.down_proj.weight"]], None, weights)  # [k, I, H / k]
        self.ln_post_attn = frozen(_w(sd, f"{p}.post_attention_layernorm.weight"))  # [H]
        self.ln_post_ff = frozen(_w(sd, f"{p}.post_feedforward_layernorm.weight"))  # [H]
        # per-head norms of q and k as one weight [Hq + Hkv, D]: one norm call for both (Gemma 3)
        self.qk_norm = None
        if cfg.qk_norm:
            q_w, k_w = _w(sd, f"{a}.q_norm.weight"), _w(sd, f"{a}.k_norm.weight")  # [D] each
            self.qk_norm = frozen(torch.cat((q_w.expand(hq, d), k_w.expand(hkv, d))))


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict, weights: str = "fp32") -> None:
        super().__init__()
        self.config = config
        sd = text_model_names(sd)
        try:
            embed = sd["model.embed_tokens.weight"]  # [V, H]
            self.layers = nn.ModuleList(
                Gemma3Layer(sd, f"model.layers.{i}", config, weights) for i in range(config.num_layers)
            )
            self.norm = frozen(_w(sd, "model.norm.weight"))  # [H]
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]!r} for a {config.model_type} model") from None
        head = sd.get("lm_head.weight")
        tied = config.tie_embeddings or head is None
        self.lm_head = projection([embed if tied else head], None, weights)  # [k, H, V / k] (padded)
        self.embed = None if tied else embedding(embed, weights)  # [V, H]; tied: read from the packed head
        # HF multiplies by sqrt(hidden) rounded to the weight dtype (fp32 here)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.rope_global = Rotary(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position)
        self.rope_local = Rotary(config.head_dim, config.rope_local_theta or config.rope_theta)
        self.act = activation(config.hidden_act)
        self.act_kernel = ACT_KERNEL.get(config.hidden_act)
        softcap = config.raw.get("final_logit_softcapping")
        self.softcap = float(softcap) if softcap else None
        # the per-layer tensors as plain tuples: the loop skips nn.Module attribute lookups
        self.plan = [
            (ly.qkv, ly.qkv_b, ly.qk_norm, ly.o, ly.ln_post_attn, ly.gate_up, ly.down, ly.ln_post_ff)
            for ly in self.layers
        ]
        # quantized weights: every layer in one native call a forward when the context allows it
        # (rotary table 0 the global one, 1 the local one of the sliding layers)
        self.stack = None if config.attn_softcap is not None else LayerStack.of(
            [(qkv, qkv_b, qkn, o, None, post_attn, gu, None, dn, None, post_ff, int(window is not None))
             for (qkv, qkv_b, qkn, o, post_attn, gu, dn, post_ff), window in zip(self.plan, config.layer_windows)],
            (config.num_heads, config.num_kv_heads, config.head_dim), self.act_kernel)

    def rotary_for_layer(self, layer: int) -> Rotary:
        return self.rope_local if self.config.layer_windows[layer] is not None else self.rope_global

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R] int64
    ) -> torch.Tensor:  # [R or N, V] float32
        cfg = self.config
        if getattr(ctx, "softcap", None) != cfg.attn_softcap:  # every context made for this model carries it
            raise ValueError(f"this attention context caps attention logits at {getattr(ctx, 'softcap', None)}, "
                             f"the model at {cfg.attn_softcap}")
        hq, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
        scale, act, heads = cfg.scale, self.act, (hq, hkv, d)
        x = packed_rows(self.lm_head if self.embed is None else self.embed, input_ids)  # [N, H]
        x.mul_(self.embed_scale)
        local = self.rope_local.tables(positions)  # (cos, sin): [N, 1, D] each
        full = self.rope_global.tables(positions)
        if self.stack is not None and self.stack.run(ctx, x, [full, local], eps, scale):
            return self.head(x, logits_rows)
        for i, (qkv_w, qkv_b, qk_norm, o_w, post_attn, gu_w, down_w, post_ff) in enumerate(self.plan):
            cos, sin = local if cfg.layer_windows[i] is not None else full
            attention_block(ctx, i, x, (qkv_w, qkv_b, o_w, None), heads, cos, sin, qk_norm, eps, scale, post_attn)
            mlp(x, gu_w, None, down_w, None, act, self.act_kernel, eps, post_ff)
        return self.head(x, logits_rows)

    def head(self, x: torch.Tensor, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """The final norm, the output head and the soft cap over rows ``logits_rows`` of x (None:
        all) -> [R, V]."""
        logits = super().head(x, logits_rows)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
