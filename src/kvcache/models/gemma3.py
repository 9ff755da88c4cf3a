"""Gemma 3 (text): scaled embeddings, four norms per layer, QK norm, hybrid sliding/full layers.

Gemma's RMSNorm multiplies by (1 + w); the +1 is folded into the stored weights at load time.
Sliding layers use their own RoPE base (rope_local_theta); windows live in config.layer_windows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.attention.context import AttentionContext
from kvcache.errors import ModelLoadError
from kvcache.models.base import CausalLM
from kvcache.models.config import ModelConfig
from kvcache.models.layers import Rotary, activation, apply_rotary, frozen, frozen_t, linear, rms_norm, strip_prefix


def _norm(sd: dict[str, torch.Tensor], key: str) -> nn.Parameter:
    return frozen(sd[key].float() + 1.0)


class Gemma3Layer(nn.Module):
    def __init__(self, sd: dict[str, torch.Tensor], p: str) -> None:
        super().__init__()
        a, m = f"{p}.self_attn", f"{p}.mlp"
        self.ln_in = _norm(sd, f"{p}.input_layernorm.weight")
        self.ln_post_attn = _norm(sd, f"{p}.post_attention_layernorm.weight")
        self.ln_pre_ff = _norm(sd, f"{p}.pre_feedforward_layernorm.weight")
        self.ln_post_ff = _norm(sd, f"{p}.post_feedforward_layernorm.weight")
        self.q_norm = _norm(sd, f"{a}.q_norm.weight")
        self.k_norm = _norm(sd, f"{a}.k_norm.weight")
        self.qkv = frozen_t(torch.cat([sd[f"{a}.{n}_proj.weight"] for n in "qkv"]))  # [H, (Hq+2Hkv) D]
        bias = [sd.get(f"{a}.{n}_proj.bias") for n in "qkv"]
        self.qkv_b = frozen(torch.cat(bias)) if all(b is not None for b in bias) else None  # type: ignore[arg-type]
        self.o = frozen_t(sd[f"{a}.o_proj.weight"])
        self.gate_up = frozen_t(torch.cat([sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"]]))  # [H, 2I]
        self.down = frozen_t(sd[f"{m}.down_proj.weight"])


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        sd = strip_prefix(sd, ("model.language_model.", "language_model."))
        try:
            self.embed = frozen(sd["model.embed_tokens.weight"])  # [V, H]
            self.layers = nn.ModuleList(Gemma3Layer(sd, f"model.layers.{i}") for i in range(config.num_layers))
            self.norm = _norm(sd, "model.norm.weight")
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]!r} for a gemma3 model") from None
        head = sd.get("lm_head.weight")
        self.lm_head = frozen_t(self.embed if config.tie_embeddings or head is None else head)  # [H, V]
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.rope_global = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        self.rope_local = Rotary(config.head_dim, config.rope_local_theta or config.rope_theta)
        self.act = activation(config.hidden_act)
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.split = (hq * d, hkv * d, hkv * d)
        softcap = config.raw.get("final_logit_softcapping")
        self.softcap = float(softcap) if softcap else None

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R]
    ) -> torch.Tensor:  # [R or N, V]
        cfg = self.config
        n, hq, hkv, d, eps = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
        x = F.embedding(input_ids, self.embed) * self.embed_scale  # [N, H]
        tables = {
            "global": self.rope_global.tables(positions),
            "local": self.rope_local.tables(positions),
        }  # each (cos, sin): [N, 1, D]
        for i, layer in enumerate(self.layers):
            cos, sin = tables["local" if cfg.layer_windows[i] is not None else "global"]
            h = rms_norm(x, layer.ln_in, eps)
            q, k, v = linear(h, layer.qkv, layer.qkv_b).split(self.split, -1)
            q = rms_norm(q.view(n, hq, d), layer.q_norm, eps)
            k = rms_norm(k.view(n, hkv, d), layer.k_norm, eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            o = ctx.attend(i, q, k, v.view(n, hkv, d), cfg.scale)  # [N, Hq, D]
            x = x + rms_norm(linear(o.reshape(n, hq * d), layer.o), layer.ln_post_attn, eps)
            h = rms_norm(x, layer.ln_pre_ff, eps)
            gate, up = linear(h, layer.gate_up).chunk(2, -1)
            x = x + rms_norm(linear(self.act(gate) * up, layer.down), layer.ln_post_ff, eps)
        if logits_rows is not None:
            x = x[logits_rows]
        logits = linear(rms_norm(x, self.norm, eps), self.lm_head)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
