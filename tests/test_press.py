"""Presses (kvcache/press/): each scoring rule against a reference written here from its paper,
on small tensors and on a tiny model; eviction composed with the cache's other axes against
recomputation with the same tokens masked; refused combinations; bytes held; compressed shared
prefixes."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.errors import InvalidParams
from kvcache.models.layers import Rotary
from kvcache.press import PRESSES, LayerView, make_press
from kvcache.press.observe import LayerObservation
from kvcache.press.select import candidates, decode_evictions, evict_mask, span_evictions

HKV, G, D = 2, 3, 16  # KV heads, query heads per KV head, head dim
HQ = HKV * G


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Reference RoPE (HF's rotate_half form): x [..., T, D] at positions pos [T]."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos.float()[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _prompt(n: int, seed: int = 0):
    """Pre-RoPE queries [HQ, n, D], keys and values [HKV, n, D] of an n-token prompt."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HQ, n, D, generator=g)
    k = torch.randn(HKV, n, D, generator=g) * (1 + torch.rand(HKV, n, 1, generator=g))
    v = torch.randn(HKV, n, D, generator=g)
    return q, k, v


def _view(press_name: str, q_pre: torch.Tensor, k_pre: torch.Tensor, v: torch.Tensor) -> LayerView:
    """What the cache would hand the press after recording the prompt in one forward."""
    n = k_pre.shape[1]
    pos = torch.arange(n)
    q, k = _rope(q_pre, pos), _rope(k_pre, pos)
    press, obs = make_press(press_name), LayerObservation()
    if press.queries:
        obs.record_queries(q.transpose(0, 1), pos, press.queries)
    if press.moments:
        first = getattr(press, "sinks", 0)
        obs.record_moments(q_pre[:, first:].transpose(0, 1))
    acc = None
    if press.attention:
        acc = _causal_probs(q, k).view(HKV, G, n, n).mean(1).sum(1)  # [HKV, n]
    return LayerView(k, v, pos.expand(HKV, n), n, 1 / math.sqrt(D), obs, acc=acc,
                     rotary=Rotary(D, 10000.0))


def _causal_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) with a causal mask: [HQ, n, n] (query heads of a KV head in order)."""
    n = q.shape[1]
    kk = k.repeat_interleave(G, 0)
    s = q @ kk.transpose(1, 2) / math.sqrt(D)
    s = s.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    return s.softmax(-1)


def _kept(view: LayerView, press_name: str, ratio: float, protect: int = 0) -> list[set[int]]:
    """The positions each KV head keeps when the cache compresses the prompt of ``view``."""
    press = make_press(press_name)
    allowed = candidates(view.pos, view.length, press, protect)
    n = span_evictions(view.pos, 0, ratio, None)
    ev = evict_mask(press.score(view), allowed, n)
    return [set(torch.nonzero(~ev[h]).flatten().tolist()) for h in range(HKV)]


def _top(scores: list[float], keep: int, forced: set[int]) -> set[int]:
    """Reference choice: the forced positions, then the highest scores until ``keep``."""
    order = sorted((i for i in range(len(scores)) if i not in forced), key=lambda i: -scores[i])
    return set(forced) | set(order[: max(0, keep - len(forced))])


# -- each press against its paper's definition ------------------------------------------------------
def test_knorm_keeps_the_lowest_key_norms() -> None:
    q, k, v = _prompt(40)
    view = _view("knorm", q, k, v)
    kept = _kept(view, "knorm", 0.5)
    for h in range(HKV):
        norms = [float(torch.linalg.vector_norm(_rope(k, torch.arange(40))[h, i])) for i in range(40)]
        assert kept[h] == _top([-x for x in norms], 20, set())
    assert kept[0] != kept[1]  # each KV head keeps its own tokens


def test_snapkv_keeps_what_the_last_window_attends_to() -> None:
    n, w, ker = 200, 64, 5
    q, k, v = _prompt(n, seed=1)
    view = _view("snapkv", q, k, v)
    kept = _kept(view, "snapkv", 0.5)
    pos = torch.arange(n)
    p = _causal_probs(_rope(q, pos), _rope(k, pos))[:, n - w :, : n - w]  # [HQ, w, n - w]
    obs = p.mean(1)  # [HQ, n - w]
    pooled = torch.stack([torch.stack([obs[h, max(0, i - 2) : i + 3].sum() / ker for i in range(n - w)])
                          for h in range(HQ)])
    per_kv = pooled.view(HKV, G, n - w).mean(1)
    for h in range(HKV):
        scores = per_kv[h].tolist() + [0.0] * w
        assert kept[h] == _top(scores, n // 2, set(range(n - w, n)))


def test_tova_keeps_what_the_last_token_attends_to_in_every_head() -> None:
    n = 30
    q, k, v = _prompt(n, seed=2)
    kept = _kept(_view("tova", q, k, v), "tova", 0.4)
    pos = torch.arange(n)
    last = _causal_probs(_rope(q, pos), _rope(k, pos))[:, -1]  # [HQ, n]
    scores = last.mean(0).tolist()
    ref = _top(scores, int(n * 0.6), {n - 1})
    assert kept[0] == kept[1] == ref


def test_h2o_keeps_the_heavy_hitters() -> None:
    n = 30
    q, k, v = _prompt(n, seed=3)
    kept = _kept(_view("h2o", q, k, v), "h2o", 0.5, protect=4)
    pos = torch.arange(n)
    p = _causal_probs(_rope(q, pos), _rope(k, pos))  # [HQ, n, n]
    for h in range(HKV):
        acc = [sum(float(p[h * G + j, t, i]) for j in range(G) for t in range(n)) / G for i in range(n)]
        assert kept[h] == _top(acc, n // 2, set(range(n - 4, n)))


def test_expected_attention_follows_its_definition() -> None:
    n, future, sinks = 48, 512, 4
    q, k, v = _prompt(n, seed=4)
    kept = _kept(_view("expected", q, k, v), "expected", 0.5)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    rot = torch.zeros(D, D)
    for p in range(n, n + future):  # the rotation matrix of each future position, averaged
        r = torch.zeros(D, D)
        for i in range(D // 2):
            c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
            r[i, i], r[i, i + D // 2], r[i + D // 2, i], r[i + D // 2, i + D // 2] = c, -s, s, c
        rot += r / future
    kr = _rope(k, torch.arange(n))
    for h in range(HKV):
        probs = []
        for j in range(G):
            qs = q[h * G + j, sinks:].double()
            mu, cov = qs.mean(0), torch.cov(qs.T, correction=0)
            mu_r, cov_r = rot.double() @ mu, rot.double() @ cov @ rot.double().T
            kk = kr[h, sinks:].double()
            logit = kk @ mu_r / math.sqrt(D) + ((kk @ cov_r) * kk).sum(-1) / D / 2
            probs.append(logit.softmax(0))
        score = torch.stack(probs).mean(0) * v[h, sinks:].double().norm(dim=-1)
        scores = [0.0] * sinks + score.tolist()
        assert kept[h] == _top(scores, n // 2, set(range(sinks)))


def test_presses_are_named_with_their_papers() -> None:
    import kvcache.press as pkg

    papers = {"knorm": "Devoto", "snapkv": "Li et al", "expected": "kvpress", "tova": "Oren", "h2o": "Zhang"}
    assert set(PRESSES) == set(papers)
    for name, cls in PRESSES.items():
        doc = __import__(cls.__module__, fromlist=["x"]).__doc__ or ""
        assert papers[name] in doc, name
    assert pkg.QUESTION_AGNOSTIC == ("knorm", "expected")


# -- how many go ------------------------------------------------------------------------------------
def test_counts_follow_ratio_keep_and_protection() -> None:
    pos = torch.arange(100).expand(HKV, 100)
    assert span_evictions(pos, 0, 0.3, None) == 100 - int(100 * (1 - 0.3))
    assert span_evictions(pos, 60, 0.5, None) == 20  # only the span since the last compression
    assert span_evictions(pos, 60, None, 70) == 30  # 60 before it stay: 10 of the span do
    assert decode_evictions(pos, 100, None, 90) == 10
    press = make_press("knorm")
    c = candidates(pos, 100, press, protect=10, sinks=4)
    assert int(c[0].sum()) == 86 and not bool(c[:, :4].any()) and not bool(c[:, 90:].any())
    gone = pos.clone()
    gone[:, 5] = -1
    assert not bool(candidates(gone, 100, press, 0)[:, 5].any())  # already evicted
