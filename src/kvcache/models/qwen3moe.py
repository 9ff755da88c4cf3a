"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): Qwen3's attention (per-head RMSNorm of q and k,
grouped-query heads) with a sparse mixture of experts in place of every layer's MLP; OLMoE
(OlmoeForCausalLM), the same block with q and k each RMS-normalized over all of its heads (the
attention halves then layer by layer: the one-call stack norms per head) and experts as wide as
intermediate_size, their weights not renormalised unless the config says so; and Mixtral
(MixtralForCausalLM), the same block with Mistral's attention (no q/k norm, a sliding window where
the config has one) and the chosen experts' weights always renormalised (models/moe.py MoeSpec).
Mixtral's checkpoints name the block ``block_sparse_moe`` and its experts' matrices w1 (gate), w3
(up) and w2 (down): read under Qwen3-MoE's names (``_mixtral_names``).

Attention is built as in models/llama.py: Q/K/V fused into one projection with the input RMSNorm
folded in, o apart, biases where the checkpoint has them. The feed-forward half (models/moe.py)
normalizes each row once with the post-attention RMSNorm (in the router's call); the router and the
chosen experts read that. With quantized weights, the native library and fp32 pages, a forward
runs every layer in one native call (kernels/qweight.py LayerStack with a Mixture: each layer's
attention half, then the rows' norm, router and experts, more than one row grouped by expert);
otherwise every layer runs through ``attention_block`` then ``moe_block``: the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.attention.interface import AttentionContext
from kvcache.errors import ModelLoadError, UnsupportedArchitecture
from kvcache.kernels.qmoe import expert_table
from kvcache.kernels.qweight import LayerStack, Mixture
from kvcache.kernels.rotary import Rotary
from kvcache.models.base import CausalLM
from kvcache.models.config import ModelConfig
from kvcache.models.layers import (
    ACT_KERNEL, activation, add_linear, attention_block, frozen, norm_linear, pack_bias, packed_rows, rms_norm,
    self_attention, text_model_names,
)
from kvcache.models.moe import Expert, MoeSpec, Router, expert_parts, moe_block
from kvcache.models.weights import embedding, projection


def _cat_bias(sd: dict, keys: list[str], sizes: list[int]) -> torch.Tensor | None:
    """Concatenated biases [sum(sizes)] of q, k, v; zeros for a part without one; None when none has one."""
    if not any(k in sd for k in keys):
        return None
    return torch.cat([sd[k].float() if k in sd else torch.zeros(n) for k, n in zip(keys, sizes)])


class Qwen3MoeLayer(nn.Module):
    def __init__(self, sd: dict, p: str, cfg: ModelConfig, spec: MoeSpec, weights: str) -> None:
        super().__init__()
        a, m = f"{p}.self_attn", f"{p}.mlp"
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = [sd[f"{a}.{n}_proj.weight"] for n in "qkv"]
        qkv_b = _cat_bias(sd, [f"{a}.{n}_proj.bias" for n in "qkv"], [hq * d, hkv * d, hkv * d])
        self.qkv = projection(qkv, sd[f"{p}.input_layernorm.weight"], weights)  # [k, H, (Hq + 2 Hkv) D / k]
        self.qkv_b = pack_bias(qkv_b, self.qkv)
        self.o = projection([sd[f"{a}.o_proj.weight"]], None, weights)  # [k, Hq D, H / k]
        self.o_b = pack_bias(sd.get(f"{a}.o_proj.bias"), self.o)
        self.qk_norm = None  # Mixtral's attention has none; Qwen3-MoE's requires it (KeyError names it)
        self.full_qk: tuple[torch.Tensor, torch.Tensor] | None = None  # OLMoE's norms over all of q, all of k
        if cfg.model_type == "olmoe":
            if cfg.raw.get("clip_qkv") is not None:
                raise UnsupportedArchitecture(f"olmoe: clip_qkv={cfg.raw['clip_qkv']} (q, k and v clamped) is not supported")
            q_w, k_w = sd[f"{a}.q_norm.weight"].float(), sd[f"{a}.k_norm.weight"].float()  # [Hq D], [Hkv D]
            if q_w.shape != (hq * d,) or k_w.shape != (hkv * d,):
                raise ModelLoadError(f"{a}.q_norm/k_norm are {tuple(q_w.shape)} and {tuple(k_w.shape)}; olmoe's "
                                     f"norms span all of q ({hq * d}) and all of k ({hkv * d})")
            self.full_qk = (frozen(q_w), frozen(k_w))
        elif cfg.model_type != "mixtral":
            q_w, k_w = sd[f"{a}.q_norm.weight"].float(), sd[f"{a}.k_norm.weight"].float()  # [D] each
            self.qk_norm = frozen(torch.cat((q_w.expand(hq, d), k_w.expand(hkv, d))))  # [Hq + Hkv, D]
        self.post_norm = frozen(sd[f"{p}.post_attention_layernorm.weight"])  # [H]
        self.router = Router(sd[f"{m}.gate.weight"], self.post_norm, cfg.norm_eps, spec)
        self.experts = nn.ModuleList(
            Expert(gate_up, down, weights, spec.expert_size, ACT_KERNEL.get(cfg.hidden_act))
            for gate_up, down in expert_parts(sd, m, spec))


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict, weights: str = "fp32") -> None:
        super().__init__()
        self.config = config
        self.spec = MoeSpec.of(config)
        self.act = activation(config.hidden_act)
        sd = _mixtral_names(text_model_names(sd))
        try:
            embed = sd["model.embed_tokens.weight"]  # [V, H]
            self.layers = nn.ModuleList(self._layer(sd, f"model.layers.{i}", weights) for i in range(config.num_layers))
            self.norm = frozen(sd["model.norm.weight"])  # [H]
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]!r} for a {config.model_type} model") from None
        head = sd.get("lm_head.weight")
        self.tied = config.tie_embeddings or head is None
        self.lm_head = projection([embed if self.tied else head], None, weights)  # [k, H, V / k] (padded)
        self.embed = None if self.tied else embedding(embed, weights)  # [V, H]
        self.rope = Rotary(int(config.head_dim * config.partial_rotary_factor), config.rope_theta,
                           config.rope_scaling, config.max_position)
        self.stack = self._stack()

    def _layer(self, sd: dict, p: str, weights: str) -> nn.Module:
        """Layer ``p`` (``model.layers.{i}``) of this family."""
        return Qwen3MoeLayer(sd, p, self.config, self.spec, weights)

    def _stack(self) -> LayerStack | None:
        """Every layer in one native call a forward, when every projection and expert is quantized
        and the native router is there; None otherwise (and for OLMoE, whose q/k norms span all
        the heads: the native attention halves norm per head)."""
        cfg, spec, tables = self.config, self.spec, []
        if any(ly.full_qk is not None for ly in self.layers):
            return None
        for ly in self.layers:
            experts = expert_table([(ex.gate_up, ex.down) for ex in ly.experts])
            if experts is None or ly.router.table is None:
                return None
            tables.append((ly.post_norm, ly.router.table, experts[0], experts[1]))
        mixture = Mixture(spec.num_experts, spec.top_k, spec.expert_size, spec.norm_topk, tables)
        return LayerStack.of(
            [(ly.qkv, ly.qkv_b, ly.qk_norm, ly.o, ly.o_b, None, None, None, None, None, None, 0) for ly in self.layers],
            (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), ACT_KERNEL.get(cfg.hidden_act), mixture)

    def rotary_for_layer(self, layer: int) -> Rotary:
        return self.rope

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R] int64
    ) -> torch.Tensor:  # [R or N, V] float32
        cfg = self.config
        heads, eps = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), cfg.norm_eps
        x = packed_rows(self.lm_head if self.embed is None else self.embed, input_ids)  # [N, H]
        cos, sin = self.rope.tables(positions)  # [N, 1, R] each
        if self.stack is not None and self.stack.run(ctx, x, [(cos, sin)], eps, cfg.scale):
            return self.head(x, logits_rows)
        for i, ly in enumerate(self.layers):
            if ly.full_qk is not None:
                _full_norm_attention(ctx, i, x, ly, heads, cos, sin, eps, cfg.scale)
            else:
                attention_block(ctx, i, x, (ly.qkv, ly.qkv_b, ly.o, ly.o_b), heads, cos, sin, ly.qk_norm, eps,
                                cfg.scale)
            moe_block(x, ly.router, ly.experts, self.act)
        return self.head(x, logits_rows)

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: a token reads only its top-k experts of each layer."""
        total = super().step_weight_bytes()
        n, k = self.spec.num_experts, self.spec.top_k
        for ly in self.layers:
            held = sum(_nbytes(w) for ex in ly.experts for w in (ex.gate_up, ex.down))
            total -= held * (n - k) // n
        return total


def _full_norm_attention(ctx: AttentionContext, layer: int, x: torch.Tensor, ly: Qwen3MoeLayer,
                         heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor, eps: float,
                         scale: float) -> None:
    """OLMoE's attention half, x [N, H] += o(attention(...)): the fused projection, q and k each
    RMS-normalized over all of its heads (transformers' OlmoeAttention), then RoPE and attention
    as every family's (self_attention, with no per-head norm)."""
    hq, hkv, d = heads
    qkv = norm_linear(x, ly.qkv, ly.qkv_b, eps)  # [N, (Hq + 2 Hkv) D]
    q_w, k_w = ly.full_qk  # type: ignore[misc]
    qkv[:, : hq * d] = rms_norm(qkv[:, : hq * d], q_w, eps)
    qkv[:, hq * d : (hq + hkv) * d] = rms_norm(qkv[:, hq * d : (hq + hkv) * d], k_w, eps)
    add_linear(x, self_attention(ctx, layer, qkv, heads, cos, sin, None, eps, scale), ly.o, ly.o_b)


_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_names(sd: dict) -> dict:
    """Mixtral's ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2`` under
    Qwen3-MoE's ``mlp.gate`` and ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; other names kept."""
    if not any(".block_sparse_moe." in k for k in sd):
        return sd
    out = {}
    for k, v in sd.items():
        if ".block_sparse_moe." in k:
            head, rest = k.split(".block_sparse_moe.", 1)
            parts = rest.split(".")
            if parts[0] == "experts" and len(parts) == 4 and parts[2] in _MIXTRAL_EXPERT:
                rest = f"experts.{parts[1]}.{_MIXTRAL_EXPERT[parts[2]]}.{parts[3]}"
            k = f"{head}.mlp.{rest}"
        out[k] = v
    return out


def _nbytes(w: object) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else int(w.nbytes)  # type: ignore[attr-defined]
