"""gpt-oss (transformers' GptOssForCausalLM; GGUF architecture ``gpt-oss``): a mixture of experts
whose attention adds a learned logit per query head to every softmax, with no value behind it
(the "sinks": a row may give part of its weight to nothing), and whose experts are biased and
gated by a clamped SwiGLU.

A layer: x += o(attention(rope(qkv(rms_norm(x))))) with biases on q, k, v and o, sliding windows
on the layers ``layer_types`` names (every other one from the first, 128 tokens in the released
models); then x += the weighted sum of the row's top-k experts of rms_norm(x). The router is
biased and takes the softmax over the k largest logits only (transformers' GptOssTopKRouter,
llama.cpp's SOFTMAX_WEIGHT gating). Each expert: [gate | up] = W h + b, gate clamped above at
``swiglu_limit`` and up to +/- the limit, then (up + 1) * gate * sigmoid(alpha * gate), then the
biased down projection.

transformers holds the experts stacked ([E, H, 2I] with gate and up interleaved along the last
axis, [E, I, H] for down); a GGUF file holds them per expert as llama.cpp's converter splits them.
Both land as one (gate, up, down) per expert here. No native kernel takes the sink logits or the
clamped gate: attention goes through each context's dense path (``sink_logits``) and the experts
through the projections one by one (quantized weights through their int8 products).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from kvcache.attention.interface import AttentionContext
from kvcache.errors import ModelLoadError, UnsupportedArchitecture
from kvcache.kernels.qmoe import expert_table, experts_row, moe_rows
from kvcache.kernels.qweight import ACT_SWIGLU_OAI, expert_mlp
from kvcache.models.config import ModelConfig
from kvcache.models.layers import (
    add_linear, frozen, linear, norm_linear, pack, pack_bias, packed_rows, rms_norm, self_attention,
)
from kvcache.models.moe import Expert, MoeSpec, moe_block
from kvcache.models.qwen3moe import Qwen3MoeForCausalLM, _cat_bias
from kvcache.models.weights import Part, as_fp32, projection


class SinkRouter(nn.Module):
    """gpt-oss's router: logits = W h + b over the post-attention norm's rows h, the k largest,
    their softmax (the chosen experts in increasing id order, as every sum over them runs)."""

    def __init__(self, weight: Part, bias: torch.Tensor, norm: torch.Tensor, eps: float, spec: MoeSpec) -> None:
        super().__init__()
        w = as_fp32(weight)  # [E, H]
        if w.shape[0] != spec.num_experts or bias.shape != (spec.num_experts,):
            raise ModelLoadError(f"a router of {w.shape[0]} experts (bias {list(bias.shape)}) where the config has "
                                 f"{spec.num_experts}")
        self.norm, self.eps, self.spec = norm, eps, spec
        self.weight = pack(w)  # [k, H, E / k]
        self.bias = pack_bias(bias, self.weight)
        self.table = None  # no native router: moe_block takes the experts one by one

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """x [N, H] -> (h [N, H] normed, weights [N, K] fp32, experts [N, K] int64)."""
        spec = self.spec
        h = rms_norm(x, self.norm, self.eps)
        logits = linear(h, self.weight, self.bias)[:, : spec.num_experts]  # [N, E]
        top, experts = torch.topk(logits, spec.top_k, dim=-1)  # [N, K] each
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        experts, order = torch.sort(experts, dim=-1)
        return h, weights.gather(1, order), experts


class ClampedExpert(Expert):
    """One gpt-oss expert: down((up + 1) * g * sigmoid(alpha g)) + b_down with g = min(gate, limit)
    and up clamped to +/- limit, [gate | up] = gate_up(h) + b."""

    def __init__(self, gate_up: list[Part], gate_up_bias: torch.Tensor, down: Part, down_bias: torch.Tensor,
                 mode: str, size: int, alpha: float, limit: float) -> None:
        super().__init__(gate_up, down, mode, size, None)  # no native activation: the torch path
        self.gate_up_b = pack_bias(gate_up_bias, self.gate_up)
        self.down_b = pack_bias(down_bias, self.down)
        self.alpha, self.limit = alpha, limit
        self.native = (alpha, limit) == (1.702, 7.0)  # the gate kernels/qgemm.c computes (ACT_SWIGLU_OAI)

    def forward(self, h: torch.Tensor,  # type: ignore[override]
                act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """h [n, H] -> [n, H] (``act`` unused: the gate is the architecture's own). Quantized weights
        at the released models' alpha and limit: one native call (kv_q_expert with its biases)."""
        if self.native:
            y = expert_mlp(h, self.gate_up, self.down, ACT_SWIGLU_OAI, self.gate_up_b, self.down_b)
            if y is not None:
                return y
        return self.torch_forward(h)

    def torch_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The same through torch's element-wise steps between the two projections."""
        i, lim = self.size, self.limit
        gu = linear(h, self.gate_up, self.gate_up_b)  # [n, 2I (padded)]
        gate = gu[:, :i].clamp(max=lim)
        up = gu[:, i : 2 * i].clamp(min=-lim, max=lim)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return linear((up + 1) * glu, self.down, self.down_b)[:, : h.shape[1]]


def expert_weights(sd: dict[str, Any], m: str, spec: MoeSpec) -> list[tuple[list[Part], torch.Tensor, Part, torch.Tensor]]:
    """Per expert ([gate, up], [gate_b | up_b], down, down_b) of the block under ``m``
    (``model.layers.{i}.mlp``): from transformers' stacked tensors (gate and up interleaved in
    ``experts.gate_up_proj`` [E, H, 2I], ``experts.down_proj`` [E, I, H], their ``_bias``) or from
    per-expert ones as a GGUF file holds them (``experts.{e}.gate_proj.weight`` [I, H] ...)."""
    n, i = spec.num_experts, spec.expert_size
    out = []
    if f"{m}.experts.gate_up_proj" in sd:
        gu, gub = sd[f"{m}.experts.gate_up_proj"], sd[f"{m}.experts.gate_up_proj_bias"]  # [E, H, 2I], [E, 2I]
        dn, dnb = sd[f"{m}.experts.down_proj"], sd[f"{m}.experts.down_proj_bias"]  # [E, I, H], [E, H]
        if gu.shape[0] != n or gu.shape[2] != 2 * i or dn.shape[:2] != (n, i) or gub.shape != (n, 2 * i):
            raise ModelLoadError(f"{m}: stacked experts of shape {list(gu.shape)} / {list(dn.shape)} do not fit {n} "
                                 f"experts of size {i}")
        for e in range(n):
            w = gu[e].float()
            out.append(([w[:, 0::2].t().contiguous(), w[:, 1::2].t().contiguous()],
                        torch.cat((gub[e, 0::2], gub[e, 1::2])).float(), dn[e].float().t().contiguous(),
                        dnb[e].float()))
        return out
    if f"{m}.experts.{n}.gate_proj.weight" in sd:
        raise ModelLoadError(f"{m}: the weights hold more experts than the config's {n}")
    for e in range(n):
        p = f"{m}.experts.{e}"
        gate, up, down = sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"], sd[f"{p}.down_proj.weight"]
        if gate.shape[0] != i or up.shape[0] != i or down.shape[1] != i:
            raise ModelLoadError(f"{p}: expert matrices of {gate.shape[0]} rows where the config has {i}")
        bias = torch.cat((sd[f"{p}.gate_proj.bias"].float(), sd[f"{p}.up_proj.bias"].float()))
        out.append(([gate, up], bias, down, sd[f"{p}.down_proj.bias"].float()))
    return out


class GptOssLayer(nn.Module):
    def __init__(self, sd: dict, p: str, cfg: ModelConfig, spec: MoeSpec, weights: str) -> None:
        super().__init__()
        a, m = f"{p}.self_attn", f"{p}.mlp"
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = projection([sd[f"{a}.{n}_proj.weight"] for n in "qkv"], sd[f"{p}.input_layernorm.weight"], weights)
        self.qkv_b = pack_bias(_cat_bias(sd, [f"{a}.{n}_proj.bias" for n in "qkv"], [hq * d, hkv * d, hkv * d]),
                               self.qkv)
        self.o = projection([sd[f"{a}.o_proj.weight"]], None, weights)
        self.o_b = pack_bias(sd.get(f"{a}.o_proj.bias"), self.o)
        sinks = sd[f"{a}.sinks"] if f"{a}.sinks" in sd else sd[f"{a}.sinks.weight"]
        if tuple(sinks.shape) != (hq,):
            raise ModelLoadError(f"{a}.sinks has shape {list(sinks.shape)}; it needs one logit per query head ({hq})")
        self.sinks = frozen(sinks)  # [Hq]
        self.post_norm = frozen(sd[f"{p}.post_attention_layernorm.weight"])  # [H]
        router = f"{m}.router" if f"{m}.router.weight" in sd else f"{m}.gate"
        self.router = SinkRouter(sd[f"{router}.weight"], sd[f"{router}.bias"].float(), self.post_norm, cfg.norm_eps,
                                 spec)
        alpha, limit = float(cfg.raw.get("swiglu_alpha", 1.702)), float(cfg.raw.get("swiglu_limit", 7.0))
        self.experts = nn.ModuleList(
            ClampedExpert(gu, gub, dn, dnb, weights, spec.expert_size, alpha, limit)
            for gu, gub, dn, dnb in expert_weights(sd, m, spec))
        # every expert's native fields with its biases (None: some expert is not quantized, or the gate is
        # not the one the native activation computes): a step's experts in one native call
        self.table = None if not self.experts[0].native else expert_table(
            [(ex.gate_up, ex.down) for ex in self.experts], [(ex.gate_up_b, ex.down_b) for ex in self.experts])

    def mixture(self, x: torch.Tensor) -> None:
        """x [N, H] += the weighted sum of each row's top-k experts of the post-attention norm's rows:
        with quantized experts one native call (a decode row's experts, or a step's rows grouped by
        expert: the same bits a row), else moe_block's experts one by one."""
        if self.table is not None:
            h, weights, chosen = self.router(x)
            if x.shape[0] == 1:
                y = experts_row(h, self.table, chosen[0], weights[0], ACT_SWIGLU_OAI)
                if y is not None:
                    x += y
                    return
            elif moe_rows(x, h, weights, chosen, self.table, ACT_SWIGLU_OAI):
                return
        moe_block(x, self.router, self.experts, None)  # type: ignore[arg-type]


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's model with gpt-oss's layers (its loading, decode-step accounting and rotary are
    shared)."""

    def __init__(self, config: ModelConfig, sd: dict, weights: str = "fp32") -> None:  # noqa: D107
        if config.hidden_act not in ("silu", "swish"):
            raise UnsupportedArchitecture(f"gpt_oss with hidden_act {config.hidden_act!r}: its experts' gate is the "
                                          "clamped SwiGLU")
        super().__init__(config, sd, weights)

    def _layer(self, sd: dict, p: str, weights: str) -> nn.Module:
        return GptOssLayer(sd, p, self.config, self.spec, weights)

    def _stack(self) -> None:
        return None  # no native layer stack takes the sink logits

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
        for i, ly in enumerate(self.layers):
            qkv = norm_linear(x, ly.qkv, ly.qkv_b, eps)  # [N, (Hq + 2 Hkv) D]
            o = self_attention(ctx, i, qkv, heads, cos, sin, None, eps, cfg.scale, ly.sinks)
            add_linear(x, o, ly.o, ly.o_b)
            ly.mixture(x)
        return self.head(x, logits_rows)
