"""GPT-2: learned position embeddings (indexed by the explicit positions), LayerNorm, fused c_attn.

HF's Conv1D stores weights as [in, out], the layout ``linear`` wants: they load as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.attention.context import AttentionContext
from kvcache.errors import ModelLoadError
from kvcache.models.base import CausalLM
from kvcache.models.config import ModelConfig
from kvcache.models.layers import activation, frozen, frozen_t, linear, strip_prefix


class GPT2Layer(nn.Module):
    def __init__(self, sd: dict[str, torch.Tensor], p: str) -> None:
        super().__init__()
        self.ln1_w, self.ln1_b = frozen(sd[f"{p}.ln_1.weight"]), frozen(sd[f"{p}.ln_1.bias"])
        self.ln2_w, self.ln2_b = frozen(sd[f"{p}.ln_2.weight"]), frozen(sd[f"{p}.ln_2.bias"])
        self.qkv, self.qkv_b = frozen(sd[f"{p}.attn.c_attn.weight"]), frozen(sd[f"{p}.attn.c_attn.bias"])
        self.o, self.o_b = frozen(sd[f"{p}.attn.c_proj.weight"]), frozen(sd[f"{p}.attn.c_proj.bias"])
        self.fc, self.fc_b = frozen(sd[f"{p}.mlp.c_fc.weight"]), frozen(sd[f"{p}.mlp.c_fc.bias"])
        self.proj, self.proj_b = frozen(sd[f"{p}.mlp.c_proj.weight"]), frozen(sd[f"{p}.mlp.c_proj.bias"])


class GPT2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        if not any(k.startswith("transformer.") for k in sd):
            sd = {f"transformer.{k}": v for k, v in sd.items()}
        sd = strip_prefix(sd, ("transformer.",))
        try:
            self.wte = frozen(sd["wte.weight"])  # [V, H]
            self.wpe = frozen(sd["wpe.weight"])  # [P, H]
            self.layers = nn.ModuleList(GPT2Layer(sd, f"h.{i}") for i in range(config.num_layers))
            self.lnf_w, self.lnf_b = frozen(sd["ln_f.weight"]), frozen(sd["ln_f.bias"])
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]!r} for a gpt2 model") from None
        self.lm_head = frozen_t(self.wte)  # [H, V]
        self.act = activation(config.hidden_act)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R]
    ) -> torch.Tensor:  # [R or N, V]
        cfg = self.config
        n, h_, d, eps = input_ids.shape[0], cfg.num_heads, cfg.head_dim, cfg.norm_eps
        x = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)  # [N, H]
        hid = cfg.hidden_size
        for i, layer in enumerate(self.layers):
            h = F.layer_norm(x, (hid,), layer.ln1_w, layer.ln1_b, eps)
            q, k, v = linear(h, layer.qkv, layer.qkv_b).view(n, 3, h_, d).unbind(1)
            o = ctx.attend(i, q, k, v, cfg.scale)  # [N, heads, D]
            x = x + linear(o.reshape(n, hid), layer.o, layer.o_b)
            h = F.layer_norm(x, (hid,), layer.ln2_w, layer.ln2_b, eps)
            x = x + linear(self.act(linear(h, layer.fc, layer.fc_b)), layer.proj, layer.proj_b)
        if logits_rows is not None:
            x = x[logits_rows]
        return linear(F.layer_norm(x, (hid,), self.lnf_w, self.lnf_b, eps), self.lm_head)
