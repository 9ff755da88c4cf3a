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

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvcache import kernels
from kvcache.kernels.rotary import apply_rotary
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
    w = w.detach()
    dst = torch.empty(k, inn, part, dtype=torch.float32)
    # column c of part j is row j * part + c of w, copied 128 rows at a time: each block's transpose
    # a cache-sized copy (one strided copy of the whole matrix took 3.1 s for Gemma 3's 262k-row
    # head, blocks 0.25 s); the columns past the last row are zeros
    for j in range(k):
        rows = max(0, min(part, out - j * part))  # the rows of w part j holds
        for c in range(0, rows, _PACK_ROWS):
            e = min(c + _PACK_ROWS, rows)
            dst[j, :, c:e].copy_(w[j * part + c : j * part + e].t())
        dst[j, :, rows:].zero_()
    return nn.Parameter(dst, requires_grad=False)


_PACK_ROWS = 128


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
    quantized weight (kernels/qweight.py, bias [out]), its int8 product -> [N, out].

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
                   sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                   sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention from the fused projection's rows qkv [N, (Hq + 2 Hkv) D]: the per-head norm of
    q and k (when the model has one), RoPE (cos, signed sin: [N, 1, R]), then ``ctx.attend`` ->
    [N, Hq D]. A context with a fused kernel for this step (decodes over fp32 pages) does all of it
    in one call (gpt-oss's learned sink logits [Hq] too)."""
    n = qkv.shape[0]
    hq, hkv, d = heads
    o = ctx.attend_packed(layer, qkv, heads, cos.view(n, -1), sin.view(n, -1), qk_norm, eps, scale, sink_logits)
    if o is not None:
        return o
    qk, v = qkv.view(n, hq + 2 * hkv, d).split((hq + hkv, hkv), 1)  # [N, Hq + Hkv, D]: norm and RoPE together
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, eps)
    q, k = apply_rotary(qk, cos, sin).split((hq, hkv), 1)
    if sink_logits is not None:
        return ctx.attend(layer, q, k, v, scale, sink_logits).reshape(n, hq * d)
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
    from kvcache.kernels.qweight import fused_mlp

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
