"""Window and attention-sink visibility against a small reference: for every query, the kept
tokens with StreamingLLM's cache positions, attended directly (pre-RoPE q/k rotated here)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.attention.backends import PagedContext
from kvcache.cache import PagedKVCache
from kvcache.cache.sequence import HOLE
from kvcache.cache.config import CacheConfig
from kvcache.models.config import ModelConfig
from kvcache.kernels.rotary import Rotary, apply_rotary

ONE = ModelConfig(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=16, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position=64, layer_windows=(None,))


def rope(rot: Rotary, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = rot.tables(pos)
    return apply_rotary(x, cos, sin)


def reference(q_raw, k_raw, v, t: int, window: int | None, sinks: int, rot: Rotary,
              softcap: float | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Output [Hq, D] of the query at position t: keys kept by the policy, at cache positions."""
    if window is None:
        kept = list(range(t + 1))
    else:
        recent = list(range(max(0, t - (window - sinks) + 1), t + 1))
        kept = sorted(set(range(min(sinks, t + 1))) | set(recent))
    cache_pos = torch.arange(len(kept))  # StreamingLLM: positions assigned inside the cache
    q_pos = torch.tensor([len(kept) - 1])
    if window is None or sinks == 0:  # plain windows keep absolute positions (same distances)
        cache_pos, q_pos = torch.tensor(kept), torch.tensor([t])
    q = rope(rot, q_raw[t : t + 1], q_pos)[0]  # [Hq, D]
    k = rope(rot, k_raw[kept], cache_pos)  # [L, Hkv, D]
    g = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    vv = v[kept].repeat_interleave(g, 1)
    scores = torch.einsum("hd,lhd->hl", q, k) / math.sqrt(q.shape[-1])
    if softcap is not None:  # Gemma 2's soft cap on the logits
        scores = softcap * torch.tanh(scores / softcap)
    if sink_logits is not None:  # gpt-oss: one more logit a head, with no value, as transformers appends it
        return torch.einsum("hl,lhd->hd", torch.cat((scores, sink_logits[:, None]), 1).softmax(-1)[:, :-1], vv)
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), vv)


@pytest.mark.parametrize("window,sinks,encoding", [(12, 0, "fp32"), (12, 3, "fp32"), (9, 4, "fp32"),
                                                   (12, 3, "fp16"), (None, 0, "fp32")])
@pytest.mark.parametrize("chunks", [[1] * 40, [10, 1, 1, 7, 1, 20], [40]])
def test_window_and_sinks_match_reference(window, sinks, encoding, chunks):
    torch.manual_seed(0)
    n = sum(chunks)
    rot = Rotary(8, 10000.0)
    q_raw, k_raw, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    cfg = CacheConfig(page_size=4, initial_tokens=8, window=window, sinks=sinks, encoding=encoding)
    cache = PagedKVCache(ONE, cfg)
    seq = cache.new_sequence()
    start = 0
    for c in chunks:
        pos = torch.arange(start, start + c)
        ctx = PagedContext(cache, [seq], [c], pos, [rot])
        out = ctx.attend(0, rope(rot, q_raw[pos], pos), rope(rot, k_raw[pos], pos), v[pos], 1 / math.sqrt(8))
        for i, t in enumerate(range(start, start + c)):
            ref = reference(q_raw, k_raw, v, t, window, sinks, rot)
            tol = 2e-3 if encoding == "fp16" else 2e-5
            torch.testing.assert_close(out[i], ref, atol=tol, rtol=tol)
        start += c
        cache.check_integrity()
        live = [p for p in seq.tables[0] if p != HOLE]
        if window is not None:  # out-of-window pages went back to the pool
            assert len(live) <= -(-sinks // 4) + -(-window // 4) + 1 + -(-c // 4)
            assert cache.pages.used(0) == len(live)
    cache.free(seq)
    cache.check_integrity()
    assert cache.pages.used(0) == 0


class NoRope:
    """A NoPE layer's (SmolLM3's every fourth) rotation: none; its keys carry no position."""

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(len(pos), 1, 8), torch.zeros(len(pos), 1, 8)


@pytest.mark.parametrize("window,sinks", [(12, 3), (9, 4)])
def test_sinks_leave_a_nope_layers_keys_as_they_are(window, sinks):
    """A layer without RoPE (its rotary None, as models.llama gives SmolLM3's NoPE layers): sinks keep
    their keys and the window's as computed, and attend to them like the reference with no rotation."""
    torch.manual_seed(1)
    n = 40
    q_raw, k_raw, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    cache = PagedKVCache(ONE, CacheConfig(page_size=4, initial_tokens=8, window=window, sinks=sinks))
    seq = cache.new_sequence()
    for t in range(n):
        pos = torch.tensor([t])
        out = PagedContext(cache, [seq], [1], pos, [None]).attend(0, q_raw[pos], k_raw[pos], v[pos], 1 / math.sqrt(8))
        torch.testing.assert_close(out[0], reference(q_raw, k_raw, v, t, window, sinks, NoRope()), atol=2e-5, rtol=2e-5)
    cache.free(seq)
    cache.check_integrity()


@pytest.mark.parametrize("window,sinks,encoding", [(12, 3, "fp32"), (None, 0, "fp32"), (12, 0, "fp16")])
def test_soft_capped_logits_through_windows_and_sinks_match_reference(window, sinks, encoding):
    """A model whose attention logits are soft-capped (Gemma 2): every read goes to dense attention,
    the sinks' scores capped too, one token at a time and in chunks."""
    import dataclasses

    torch.manual_seed(2)
    n, cap = 40, 1.5
    rot = Rotary(8, 10000.0)
    q_raw, k_raw, v = torch.randn(n, 4, 8) * 2, torch.randn(n, 2, 8) * 2, torch.randn(n, 2, 8)
    cache = PagedKVCache(dataclasses.replace(ONE, attn_softcap=cap),
                         CacheConfig(page_size=4, initial_tokens=8, window=window, sinks=sinks, encoding=encoding))
    seq = cache.new_sequence()
    start = 0
    for c in [1] * 10 + [7, 1, 22]:
        pos = torch.arange(start, start + c)
        ctx = PagedContext(cache, [seq], [c], pos, [rot])
        assert ctx.layer_pages() is None  # no fused path takes the cap
        out = ctx.attend(0, rope(rot, q_raw[pos], pos), rope(rot, k_raw[pos], pos), v[pos], 1 / math.sqrt(8))
        for i, t in enumerate(range(start, start + c)):
            ref = reference(q_raw, k_raw, v, t, window, sinks, rot, cap)
            tol = 2e-3 if encoding == "fp16" else 2e-5
            torch.testing.assert_close(out[i], ref, atol=tol, rtol=tol)
            assert (out[i] - reference(q_raw, k_raw, v, t, window, sinks, rot)).abs().max() > 10 * tol or t == 0
        start += c
    cache.free(seq)
    cache.check_integrity()


@pytest.mark.parametrize("window,sinks,encoding", [(12, 3, "fp32"), (None, 0, "fp32"), (12, 0, "fp16"),
                                                   (12, 3, "int8")])
def test_learned_sink_logits_through_windows_and_sinks_match_reference(window, sinks, encoding):
    """gpt-oss's learned sink logits, one a query head: every read goes to dense attention with them
    (past a window, beside the kept sink tokens re-rotated), one token at a time and in chunks, on
    fp32, fp16 and int8 pages; without them the outputs differ."""
    torch.manual_seed(3)
    n = 40
    rot = Rotary(8, 10000.0)
    q_raw, k_raw, v = torch.randn(n, 4, 8) * 2, torch.randn(n, 2, 8) * 2, torch.randn(n, 2, 8)
    sink_logits = torch.tensor([2.5, -1.0, 0.5, 4.0])
    quant = dict(residual=0, group_size=8) if encoding == "int8" else dict(page_size=4)
    cache = PagedKVCache(ONE, CacheConfig(initial_tokens=8, window=window, sinks=sinks,
                                          encoding=encoding, **quant))
    seq = cache.new_sequence()
    start, moved = 0, 0.0
    tol = {"fp32": 2e-5, "fp16": 5e-3}.get(encoding, 0.05)
    for c in [1] * 10 + [7, 1, 22]:
        pos = torch.arange(start, start + c)
        ctx = PagedContext(cache, [seq], [c], pos, [rot])
        out = ctx.attend(0, rope(rot, q_raw[pos], pos), rope(rot, k_raw[pos], pos), v[pos], 1 / math.sqrt(8),
                         sink_logits)
        for i, t in enumerate(range(start, start + c)):
            ref = reference(q_raw, k_raw, v, t, window, sinks, rot, sink_logits=sink_logits)
            torch.testing.assert_close(out[i], ref, atol=tol, rtol=tol)
            moved = max(moved, (ref - reference(q_raw, k_raw, v, t, window, sinks, rot)).abs().max().item())
        start += c
    assert moved > 0.1  # the sinks take a real share of the weights
    cache.free(seq)
    cache.check_integrity()


def test_hybrid_model_windows_get_their_own_groups():
    cfg = ModelConfig(model_type="gemma3", vocab_size=8, hidden_size=16, intermediate_size=16, num_layers=6,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position=256,
                      layer_windows=(4, 4, None, 4, 4, None))
    cache = PagedKVCache(cfg, CacheConfig(page_size=2))
    assert [(g.layers, g.window) for g in cache.groups] == [((0, 1, 3, 4), 4), ((2, 5), None)]
    seq = cache.new_sequence()
    for t in range(30):
        PagedContext(cache, [seq], [1], torch.tensor([t]))
    assert cache.pages.used(1) == 15  # the full layers: every token kept
    assert cache.pages.used(0) <= 4  # the sliding layers: only the window's pages
    stats = cache.stats()
    assert [s.window for s in stats.per_layer] == [4, 4, None, 4, 4, None]
    assert stats.per_layer[0].bytes_used < stats.per_layer[2].bytes_used
    # a user window narrower than the model's applies to every layer, with its sinks on all
    narrow = PagedKVCache(cfg, CacheConfig(page_size=2, window=3, sinks=1))
    assert [(g.window, g.sinks) for g in narrow.groups] == [(3, 1)]
