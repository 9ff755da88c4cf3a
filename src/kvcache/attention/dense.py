"""Dense reference attention with grouped-query heads, explicit positions and sliding windows.

Owns the attention math on gathered K/V; the masks' forms (``Mask``) are the cache's
(cache/visibility.py). Knows nothing of pages, pools or kernels (attention/backends.py dispatches,
cache/plan.py plans).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.cache.visibility import Mask, build_mask

def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2): cap * tanh(scores / cap), in place, in the order
    transformers computes it; ``cap`` None leaves the scores as they are."""
    if cap is None:
        return scores
    return scores.div_(cap).tanh_().mul_(cap)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float,
           softcap: float | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, T, D]; k, v: [Hkv, L, D] (Hq a multiple of Hkv); mask from build_mask; ``softcap``:
    the scores soft-capped before the mask (soft_cap); ``sink_logits`` [Hq]: a learned logit per query
    head that joins every row's softmax with no value (gpt-oss). Returns [Hq, T, D]."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    if softcap is not None or sink_logits is not None:
        return _explicit(q, k, v, mask, scale, softcap, sink_logits)
    if mask is None and t == 1:
        # Decode: fold the query heads of one KV head into the query axis (no K/V repeat); three
        # plain ops are cheaper than SDPA's dispatch for one query row on a CPU.
        scores = torch.matmul(q.reshape(hkv, g, d), k.transpose(1, 2)) * scale  # [Hkv, g, L]
        out = torch.matmul(torch.softmax(scores, -1), v)  # [Hkv, g, D]
        return out.reshape(hq, 1, d)
    # a batch dimension of 1: with 4-d inputs torch's CPU SDPA takes its blocked (flash) kernel,
    # with 3-d ones it materializes every [T, L] score (6x slower at 4k tokens here)
    q4, k4, v4 = q[None], k[None], v[None]
    if mask is None:
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=g > 1)
    elif isinstance(mask, str):
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, is_causal=True, enable_gqa=g > 1)
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=g > 1)
    return out[0]


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float, cap: float | None,
              sink_logits: torch.Tensor | None, rows_per_block: int = 256) -> torch.Tensor:
    """``attend`` with soft-capped scores or learned sink logits (no fused kernel takes them): the
    scores of a block of query rows at a time, so a long prefill never holds a [Hq, T, L] tensor."""
    hq, t, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    g = hq // hkv
    if isinstance(mask, str):  # the plain causal mask of a prefill: the last t keys are the queries'
        mask = torch.ones(t, n, dtype=torch.bool).tril(n - t)
    outs = []
    for a in range(0, t, rows_per_block):
        b = min(t, a + rows_per_block)
        scores = torch.matmul(q[:, a:b].reshape(hkv, g * (b - a), d), k.transpose(1, 2)).mul_(scale)
        scores = soft_cap(scores, cap).view(hkv, g, b - a, n)
        if mask is not None:
            scores.masked_fill_(~mask[a:b], float("-inf"))
        p = sink_softmax(scores, sink_logits).view(hkv, g * (b - a), n)
        outs.append(torch.matmul(p, v).view(hq, b - a, d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def sink_softmax(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of scores [Hkv, g, T, L] (masked keys at -inf); with ``sink_logits``
    [Hkv g] one more logit per query head joins each row's sum and is dropped (transformers'
    GptOssAttention: the row's weights then sum to less than one)."""
    if sink_logits is None:
        return torch.softmax(scores, -1)
    hkv, g = scores.shape[:2]
    s = sink_logits.view(hkv, g, 1, 1).to(scores.dtype)
    top = torch.maximum(scores.amax(-1, keepdim=True), s)  # [Hkv, g, T, 1]
    p = (scores - top).exp_()
    return p.div_(p.sum(-1, keepdim=True).add_((s - top).exp_()))


def attend_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of T queries over L keys of one sequence: q [Hq, T, D], k/v [Hkv, L, D],
    q_pos [T], k_pos [L] -> [Hq, T, D]."""
    return attend(q, k, v, build_mask(q_pos, k_pos, window), scale, softcap, sink_logits)


def attend_with_sinks(
    q: torch.Tensor, q_sink: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, n_sink: int,
    scale: float, rows_per_block: int = 256, softcap: float | None = None, sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention where the first ``n_sink`` keys are scored against ``q_sink`` (the queries turned
    back to the sinks' cache positions) and the rest against ``q``.

    q, q_sink: [Hq, T, D]; k, v: [Hkv, L, D]; mask: None or bool [T, L] -> [Hq, T, D]. Queries go
    in blocks of ``rows_per_block`` so a long prefill never holds a [Hq, T, L] score tensor.
    """
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    if isinstance(mask, str):
        raise ValueError("a sink cache never uses the plain causal mask")
    outs = []
    for a in range(0, t, rows_per_block):
        b = min(t, a + rows_per_block)
        qq = q[:, a:b].reshape(hkv, g * (b - a), d)
        qs = q_sink[:, a:b].reshape(hkv, g * (b - a), d)
        scores = torch.matmul(qq, k.transpose(1, 2))  # [Hkv, g*T', L]
        scores[:, :, :n_sink] = torch.matmul(qs, k[:, :n_sink].transpose(1, 2))
        scores = soft_cap(scores.view(hkv, g, b - a, -1).mul_(scale), softcap)
        if mask is not None:
            scores.masked_fill_(~mask[a:b], float("-inf"))
        p = sink_softmax(scores, sink_logits).view(hkv, g * (b - a), -1)
        outs.append(torch.matmul(p, v).view(hq, b - a, d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
