"""Building blocks shared by the model families: packed projections, norms, rotary embeddings,
activations.

Projection weights are stored *packed*: an nn.Linear weight [out, in] becomes [k, in, out/k]
(columns split into k contiguous blocks, zero-padded to a multiple of k) and ``linear`` runs one
``bmm`` over the k blocks. A one-row product against a plain matrix runs on one core here (MKL's
gemv); the k blocks of a bmm run on k cores, which streams the weights ~1.4x faster at decode
(measured on the 2-core dev box: 29 vs 41 ms of matmuls per SmolLM2-135M step) and is no slower
for prefill. k is the torch thread count when the model is loaded (capped at 8).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvcache import kernels
from kvcache.errors import UnsupportedArchitecture

_MULTI_ROW = True  # route products of several rows to kernels/pgemm.c when it can be built


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A contiguous fp32 parameter that needs no gradient, in memory of its own (never a view of
    the loaded file, which would keep the whole file mapped and resident)."""
    return nn.Parameter(t.detach().to(torch.float32).clone(memory_format=torch.contiguous_format),
                        requires_grad=False)


def pack(w: torch.Tensor, k: int | None = None) -> nn.Parameter:
    """nn.Linear weight [out, in] -> packed [k, in, ceil(out / k)] (zero-padded columns)."""
    out, inn = w.shape
    k = k or max(1, min(torch.get_num_threads(), 8))
    part = -(-out // k)
    wt = w.detach().to(torch.float32).t()  # [in, out]
    if part * k != out:
        wt = F.pad(wt, (0, part * k - out))
    return frozen(wt.reshape(inn, k, part).permute(1, 0, 2))


def pack_bias(b: torch.Tensor | None, packed: Any) -> nn.Parameter | None:
    """bias [out] -> [k, 1, part], laid out like ``packed`` [k, in, part]; None stays None. A
    quantized weight takes its bias as it is: [out]."""
    if b is None:
        return None
    if not isinstance(packed, torch.Tensor):
        return frozen(b)
    k, _, part = packed.shape
    return frozen(F.pad(b.detach().float(), (0, k * part - b.shape[0])).view(k, 1, part))


def linear(x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, in] @ packed w: [k, in, part] (+ b: [k, 1, part]) -> [N, k * part]; or, for a
    quantized weight (models/qweight.py, bias [out]), its int8 product -> [N, out].

    Rows go to the native kernel (kernels/pgemm.c: every weight loaded once serves several rows;
    1.4-2.8x MKL's sgemm at 2-2048 rows on the reference machine) when it is there, one row too:
    each output element is one multiply-add chain over the inputs whatever the number of rows, so a
    row's product is the same bits alone or in a batch. Without the kernel, a batched product over
    the k blocks."""
    if not isinstance(w, torch.Tensor):
        return w.forward(x, b)
    n = x.shape[0]
    if _MULTI_ROW:
        y = kernels.packed_matmul(x, w, b)
        if y is not None:
            return y
    k, inn, part = w.shape
    xs = x.expand(k, n, inn)
    y = torch.bmm(xs, w) if b is None else torch.baddbmm(b, xs, w)  # [k, N, part]
    if n == 1 or k == 1:
        return y.view(n, k * part)
    return y.transpose(0, 1).reshape(n, k * part)


def norm_linear(x: torch.Tensor, w: Any, b: torch.Tensor | None, eps: float,
                norm: torch.Tensor | None = None) -> torch.Tensor:
    """linear(rms_norm(x, norm, eps), w, b): x [N, in] -> [N, out]. A quantized weight takes the
    norm inside its kernel (the norm weight, folded in at load or given here, scales the input)."""
    if not isinstance(w, torch.Tensor):
        return w.forward(x, b, eps, norm)
    return linear(rms_norm(x, norm, eps), w, b)


def add_linear(x: torch.Tensor, h: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> None:
    """x += linear(h, w, b) in place (a residual); a quantized weight adds straight into x."""
    if not isinstance(w, torch.Tensor):
        w.forward(h, b, out=x, accumulate=True)
    else:
        x.add_(linear(h, w, b))


def self_attention(ctx: Any, layer: int, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor,
                   sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float) -> torch.Tensor:
    """Attention from the fused projection's rows qkv [N, (Hq + 2 Hkv) D]: the per-head norm of
    q and k (when the model has one), RoPE (cos, signed sin: [N, 1, R]), then ``ctx.attend`` ->
    [N, Hq D]. A context with a fused kernel for this step (decodes over fp32 pages) does all of it
    in one call."""
    n = qkv.shape[0]
    hq, hkv, d = heads
    o = ctx.attend_packed(layer, qkv, heads, cos.view(n, -1), sin.view(n, -1), qk_norm, eps, scale)
    if o is not None:
        return o
    qk, v = qkv.view(n, hq + 2 * hkv, d).split((hq + hkv, hkv), 1)  # [N, Hq + Hkv, D]: norm and RoPE together
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, eps)
    q, k = apply_rotary(qk, cos, sin).split((hq, hkv), 1)
    return ctx.attend(layer, q, k, v, scale).reshape(n, hq * d)  # [N, Hq D]


def attention_block(ctx: Any, layer: int, x: torch.Tensor, weights: tuple, heads: tuple[int, int, int],
                    cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                    post_norm: torch.Tensor | None = None) -> None:
    """x [N, H] += o(self_attention(qkv(rms_norm(x)))), the o output through ``post_norm`` first
    when given; ``weights``: (qkv, qkv bias, o, o bias). A context with a fused kernel for the
    step (decodes over fp32 pages, quantized weights) does it in one call."""
    n = x.shape[0]
    if ctx.attend_block(layer, x, weights, heads, cos.view(n, -1), sin.view(n, -1), qk_norm, eps, scale, post_norm):
        return
    qkv_w, qkv_b, o_w, o_b = weights
    o = self_attention(ctx, layer, norm_linear(x, qkv_w, qkv_b, eps), heads, cos, sin, qk_norm, eps, scale)
    if post_norm is None:
        add_linear(x, o, o_w, o_b)
    else:
        x.add_(rms_norm(linear(o, o_w, o_b), post_norm, eps))


def packed_rows(w: Any, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [N] of the [out, in] matrix that ``w`` [k, in, part] packs -> [N, in]: a tied
    embedding read straight from the packed output head (one copy of the table, not two). A
    quantized table dequantizes just those rows; a plain [V, H] table is indexed."""
    if not isinstance(w, torch.Tensor):
        return w.rows(ids)
    if w.dim() == 2:
        return w[ids]
    part = w.shape[2]
    return w[torch.div(ids, part, rounding_mode="floor"), :, ids % part]


_EPS: dict[float, torch.Tensor] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., H] -> x * rsqrt(mean(x^2) + eps) * weight (weight broadcasts over x's trailing
    dims, e.g. [heads, D] for per-head norms); weight None when it was folded into the next
    projection (see fold_norm). Four small ops, no Python-float operands (each costs a
    scalar-tensor conversion, several microseconds on this CPU): mean(x^2) is |x|^2 / H."""
    e = _EPS.get(eps)
    if e is None:
        e = _EPS[eps] = torch.tensor(eps, dtype=torch.float32)
    s = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [..., 1]
    normed = x * torch.addcmul(e, s, s, value=1.0 / x.shape[-1]).rsqrt_()
    return normed if weight is None else normed.mul_(weight)


def fold_norm(norm_weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A norm's weight [in] folded into the nn.Linear weight [out, in] that follows it:
    (x_hat * g) @ W.T == x_hat @ (W * g).T, one multiply fewer per norm and token."""
    return w.float() * norm_weight.float()[None, :]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu_fast": gelu_tanh,
}


# activations the quantized MLP kernel computes itself (kernels/qgemm.c glu_row)
ACT_KERNEL = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_fast": 1}


def mlp(x: torch.Tensor, gu_w: Any, gu_b: torch.Tensor | None, down_w: Any, down_b: torch.Tensor | None,
        act: Callable[[torch.Tensor], torch.Tensor], act_kernel: int | None, eps: float,
        post_norm: torch.Tensor | None = None) -> None:
    """x [N, H] += post_norm(down(act(gate) * up)), [gate | up] = gate_up(rms_norm(x)) (the norm's
    weight folded into gate_up), in place. Quantized weights do it in one native call."""
    from kvcache.models.qweight import fused_mlp

    if fused_mlp(x, gu_w, down_w, act_kernel, eps, gu_b, down_b, post_norm, eps):
        return
    gate, up = norm_linear(x, gu_w, gu_b, eps).chunk(2, 1)  # [N, I] each
    if post_norm is None:
        add_linear(x, act(gate).mul_(up), down_w, down_b)
    else:
        x.add_(rms_norm(linear(act(gate).mul_(up), down_w, down_b), post_norm, eps))


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedArchitecture(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Rotary:
    """RoPE with explicit positions: HF's rotate_half convention, optional partial rotary dims,
    HF's 'linear', 'llama3' and 'yarn' scaling. Tables of cos/sin over positions are built once
    and grown on demand; a forward gathers the rows of its positions."""

    SUPPORTED = ("default", "linear", "llama3", "yarn")

    def __init__(
        self, rot_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position: int = 2048
    ) -> None:
        self.rot_dim = rot_dim
        self.theta = theta
        self.attention_factor = 1.0
        inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))  # [rot/2]
        if scaling is not None:
            inv = self._scale(inv, scaling, max_position)
        self.inv_freq = inv  # [rot_dim / 2]
        self.cos = torch.empty(0, rot_dim)  # [P, rot_dim]
        self.sin = torch.empty(0, rot_dim)  # [P, rot_dim], rotate_half's sign folded in

    def _scale(self, inv: torch.Tensor, s: dict[str, Any], max_position: int) -> torch.Tensor:
        kind = s.get("rope_type", s.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / float(s["factor"])
        if kind == "llama3":
            factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            low_wl, high_wl = old / low, old / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wl, inv / factor, inv)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return torch.where(medium, smoothed, scaled)
        if kind == "yarn":
            return self._yarn(s, max_position)
        raise UnsupportedArchitecture(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(self.SUPPORTED)}"
        )

    def _yarn(self, s: dict[str, Any], max_position: int) -> torch.Tensor:
        """HF's _compute_yarn_parameters: inverse frequencies [rot/2]; sets attention_factor."""
        dim, base = self.rot_dim, self.theta
        old = float(s["original_max_position_embeddings"])
        factor = float(s.get("factor") or max_position / old)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = s.get("attention_factor")
        if att is None:
            m, m_all = s.get("mscale"), s.get("mscale_all_dim")
            att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        self.attention_factor = float(att)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(float(s.get("beta_fast") or 32)), corr_dim(float(s.get("beta_slow") or 1))
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extra = 1 - ramp  # share of the unscaled (extrapolated) frequency
        return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra

    def _grow(self, upto: int) -> None:
        n = max(upto, 2 * self.cos.shape[0], 256)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [n, rot/2]
        emb = torch.cat((freqs, freqs), -1)  # [n, rot]
        self.cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): the sign lives in the table
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), -1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [N]: each [N, 1, rot_dim] (broadcast over heads)."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.cos.shape[0]:
            self._grow(top)
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


    def rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Turn already-rotated x: [N, H, D] by a further ``delta`` positions: [N] int64 (may be
        negative). RoPE rotations compose, so R(delta) R(p) x = R(p + delta) x."""
        cos, sin = self.tables(delta.abs())  # [N, 1, R] each
        sign = torch.where(delta < 0, -1.0, 1.0)[:, None, None]
        if self.attention_factor != 1.0:
            cos, sin = cos / self.attention_factor, sin / self.attention_factor
        return apply_rotary(x, cos, sin * sign)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos, signed sin from Rotary.tables: [N, 1, R] with R <= D (partial rotary
    leaves the last D - R dims alone) -> [N, H, D]. HF's x * cos + rotate_half(x) * sin, where
    rotate_half's halves swap is a roll by R/2 (its sign is in the sin table)."""
    r = cos.shape[-1]
    rot = x if r == x.shape[-1] else x[..., :r]
    out = (rot * cos).addcmul_(rot.roll(r // 2, -1), sin)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), -1)


def strip_prefix(state_dict: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Drop the first matching wrapper prefix from every key (e.g. GPT-2's ``transformer.``)."""
    for pre in prefixes:
        if any(k.startswith(pre) for k in state_dict):
            return {k[len(pre):] if k.startswith(pre) else k: v for k, v in state_dict.items()}
    return state_dict


def text_model_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors of a multimodal checkpoint under plain causal-LM names:
    ``language_model.model.X`` (transformers 4) and ``model.language_model.X`` (5) -> ``model.X``,
    ``language_model.lm_head.weight`` -> ``lm_head.weight``. Other names are kept as they are."""
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in state_dict):
        return state_dict
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        out[k] = v
    return out
