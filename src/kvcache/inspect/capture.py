"""Look inside one forward: the cache's anatomy, Q/K/V and attention weights per layer, and the
prefix-reuse check (attention over a reused prefix's K/V equals recomputation).

A CaptureContext wraps any attention context and records, for chosen layers, what the model
passes to ``ctx.attend`` (q [N, Hq, D], k and v [N, Hkv, D], after RoPE) and the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcache.attention import AttentionContext, RecomputeContext
from kvcache.attention.dense import sink_softmax, soft_cap
from kvcache.cache.visibility import visibility_mask
from kvcache.errors import InvalidParams
from kvcache.models.base import CausalLM


@dataclass
class Captured:
    q: torch.Tensor  # [N, Hq, D]
    k: torch.Tensor  # [N, Hkv, D]
    v: torch.Tensor  # [N, Hkv, D]
    out: torch.Tensor  # [N, Hq, D]
    scale: float
    sink_logits: torch.Tensor | None = None  # [Hq]: the layer's learned sinks (gpt-oss), or None


@dataclass
class CaptureContext:
    inner: AttentionContext
    layers: set[int] | None = None  # None: every layer
    seen: dict[int, Captured] = field(default_factory=dict)

    @property
    def softcap(self) -> float | None:
        return getattr(self.inner, "softcap", None)

    def attend_packed(self, *args: object, **kwargs: object) -> None:
        return None  # no fused path: q, k and v must pass through attend to be recorded

    def attend_block(self, *args: object) -> bool:
        return False

    def layer_pages(self) -> None:
        return None  # layer by layer, through attend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        out = self.inner.attend(layer, q, k, v, scale, sink_logits)
        if self.layers is None or layer in self.layers:
            self.seen[layer] = Captured(q.clone(), k.clone(), v.clone(), out.clone(), scale, sink_logits)
        return out


def check_indices(model: CausalLM, layers: Sequence[int], heads: Sequence[int]) -> None:
    cfg = model.config
    for i in layers:
        if not 0 <= i < cfg.num_layers:
            raise InvalidParams(f"layer {i} does not exist: the model has layers 0..{cfg.num_layers - 1}")
    for h in heads:
        if not 0 <= h < cfg.num_heads:
            raise InvalidParams(f"head {h} is out of range: the model has query heads 0..{cfg.num_heads - 1}")


@torch.inference_mode()
def capture(model: CausalLM, ids: list[int], layers: Sequence[int]) -> dict[int, Captured]:
    """One recompute forward over ``ids``, recording the chosen layers."""
    pos = torch.arange(len(ids))
    ctx = CaptureContext(RecomputeContext([len(ids)], pos, model.config.layer_windows, model.config.attn_softcap),
                         set(layers))
    model(torch.tensor(ids), pos, ctx, logits_rows=torch.tensor([len(ids) - 1]))
    return ctx.seen


def attention_weights(model: CausalLM, c: Captured, layer: int, head: int) -> torch.Tensor:
    """Softmax weights [N, N] of one query head over the keys it may see (GQA: its KV head); with
    learned sinks a row's weights sum to less than one (the sink's share is held by no key)."""
    group = model.config.num_heads // model.config.num_kv_heads
    pos = torch.arange(c.q.shape[0])
    scores = soft_cap((c.q[:, head] @ c.k[:, head // group].T) * c.scale, model.config.attn_softcap)  # [N, N]
    mask = visibility_mask(pos, pos, model.config.layer_windows[layer])
    sink = None if c.sink_logits is None else c.sink_logits[head : head + 1]
    return sink_softmax(scores.masked_fill(~mask, float("-inf"))[None, None], sink)[0, 0]


def gqa_groups(model: CausalLM) -> list[list[int]]:
    """For each KV head, the query heads that share it."""
    g = model.config.num_heads // model.config.num_kv_heads
    return [list(range(h * g, (h + 1) * g)) for h in range(model.config.num_kv_heads)]


@dataclass(frozen=True)
class ReuseCheck:
    prefix: int  # tokens shared by the two prompts
    total: int  # tokens of the second prompt
    max_diff: float  # largest |attention output (reused prefix) - attention output (recomputed)|
    kv_saved: float  # share of the second prompt's K/V projections not recomputed
    attention_saved: float  # share of its attention score computations not redone


@torch.inference_mode()
def prefix_reuse(runner, first: list[int], second: list[int]) -> ReuseCheck:  # runner: ModelRunner
    """Prefill ``first``, keep the common prefix's K/V, feed the rest of ``second``; compare the
    attention outputs of those tokens, every layer, with a recompute of ``second``."""
    p = 0
    while p < min(len(first), len(second)) - 1 and first[p] == second[p]:
        p += 1
    if p == 0:
        raise InvalidParams("the two prompts share no prefix: nothing to reuse")
    model = runner.model
    seq = runner.new_sequence()
    try:
        runner.step([seq], [first])
        runner.truncate(seq, p)
        from kvcache.attention.backends import PagedContext

        rest = second[p:]
        pos = torch.arange(p, len(second))
        ctx = CaptureContext(PagedContext(runner.cache, [seq.kv], [len(rest)], pos, runner.rotaries))
        model(torch.tensor(rest), pos, ctx, logits_rows=torch.tensor([len(rest) - 1]))
    finally:
        runner.free(seq)
    full = capture(model, second, range(model.config.num_layers))
    diff = max(float((ctx.seen[i].out - full[i].out[p:]).abs().max()) for i in full)
    n = len(second)
    attn_all = n * (n + 1) / 2  # causal score computations
    attn_new = attn_all - p * (p + 1) / 2
    return ReuseCheck(p, n, diff, p / n, 1 - attn_new / attn_all)
