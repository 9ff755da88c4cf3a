"""GPT-2: learned position embeddings (indexed by the explicit positions), LayerNorm, fused c_attn,
gelu_new, output head tied to the token embeddings (or the file's own output head).

HF's Conv1D stores weights as [in, out] (transposed relative to nn.Linear); they are packed from
their transpose. HF's scale_attn_weights / scale_attn_by_inverse_layer_idx options are honoured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.attention.interface import AttentionContext
from kvcache.errors import ModelLoadError
from kvcache.models.base import CausalLM
from kvcache.models.config import ModelConfig
from kvcache.models.gguf_tensor import GGUFTensor
from kvcache.models.layers import activation, frozen, linear, pack_bias, packed_rows, strip_prefix
from kvcache.models.weights import embedding, projection


def _conv1d(sd: dict, key: str, weights: str) -> tuple:
    """A Conv1D's weight [in, out] and bias [out] -> packed [k, in, out / k] and [k, 1, out / k]
    (a quantized GGUF tensor is already [out, in]: llama.cpp stores it as nn.Linear does)."""
    w = sd[f"{key}.weight"]
    w = projection([w if isinstance(w, GGUFTensor) else w.t()], None, weights)
    return w, pack_bias(sd.get(f"{key}.bias"), w)


class GPT2Layer(nn.Module):
    def __init__(self, sd: dict, p: str, weights: str) -> None:
        super().__init__()
        self.ln1_w, self.ln1_b = frozen(sd[f"{p}.ln_1.weight"]), frozen(sd[f"{p}.ln_1.bias"])  # [H]
        self.ln2_w, self.ln2_b = frozen(sd[f"{p}.ln_2.weight"]), frozen(sd[f"{p}.ln_2.bias"])  # [H]
        self.qkv, self.qkv_b = _conv1d(sd, f"{p}.attn.c_attn", weights)  # [k, H, 3H / k]
        self.o, self.o_b = _conv1d(sd, f"{p}.attn.c_proj", weights)  # [k, H, H / k]
        self.fc, self.fc_b = _conv1d(sd, f"{p}.mlp.c_fc", weights)  # [k, H, I / k]
        self.proj, self.proj_b = _conv1d(sd, f"{p}.mlp.c_proj", weights)  # [k, I, H / k]


class GPT2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, sd: dict, weights: str = "fp32") -> None:
        super().__init__()
        self.config = config
        if not any(k.startswith("transformer.") for k in sd):
            sd = {f"transformer.{k}": v for k, v in sd.items()}
        sd = strip_prefix(sd, ("transformer.",))
        try:
            # [k, H, V / k]: the tied table, read for embeddings too; a separate head (a GGUF's
            # output.weight) with its own table for the embeddings
            head = sd.get("lm_head.weight")
            self.lm_head = projection([sd["wte.weight"] if head is None else head], None, weights)
            self.embed = None if head is None else embedding(sd["wte.weight"], weights)  # [V, H]
            self.wpe = frozen(sd["wpe.weight"])  # [P, H]
            self.layers = nn.ModuleList(GPT2Layer(sd, f"h.{i}", weights) for i in range(config.num_layers))
            self.lnf_w, self.lnf_b = frozen(sd["ln_f.weight"]), frozen(sd["ln_f.bias"])  # [H]
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]!r} for a gpt2 model") from None
        self.act = activation(config.hidden_act)
        raw = config.raw
        base = config.scale if raw.get("scale_attn_weights", True) else 1.0
        by_layer = bool(raw.get("scale_attn_by_inverse_layer_idx", False))
        self.scales = [base / (i + 1) if by_layer else base for i in range(config.num_layers)]
        # the per-layer tensors as plain tuples: the loop skips nn.Module attribute lookups
        names = ("ln1_w", "ln1_b", "qkv", "qkv_b", "o", "o_b", "ln2_w", "ln2_b", "fc", "fc_b", "proj", "proj_b")
        self.plan = [tuple(getattr(ly, a) for a in names) for ly in self.layers]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        ctx: AttentionContext,
        logits_rows: torch.Tensor | None = None,  # [R] int64
    ) -> torch.Tensor:  # [R or N, V] float32
        cfg = self.config
        n, heads, d, eps, hid = input_ids.shape[0], cfg.num_heads, cfg.head_dim, cfg.norm_eps, cfg.hidden_size
        x = packed_rows(self.lm_head if self.embed is None else self.embed, input_ids).add_(self.wpe[positions])  # [N, H]
        for i, weights in enumerate(self.plan):
            ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, fc_w, fc_b, proj_w, proj_b = weights
            h = F.layer_norm(x, (hid,), ln1_w, ln1_b, eps)
            qkv = linear(h, qkv_w, qkv_b).view(n, 3, heads, d)
            q, k, v = qkv.unbind(1)  # [N, heads, D] each
            o = ctx.attend(i, q, k, v, self.scales[i])  # [N, heads, D]
            x.add_(linear(o.reshape(n, hid), o_w, o_b))
            h = F.layer_norm(x, (hid,), ln2_w, ln2_b, eps)
            x.add_(linear(self.act(linear(h, fc_w, fc_b)), proj_w, proj_b))
        if logits_rows is not None:
            x = x[logits_rows]
        logits = linear(F.layer_norm(x, (hid,), self.lnf_w, self.lnf_b, eps), self.lm_head)  # [R, k * V / k]
        return logits if logits.shape[1] == cfg.vocab_size else logits[:, : cfg.vocab_size].contiguous()
