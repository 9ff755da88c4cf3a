"""Presses (kvcache/press/): each scoring rule against a reference written here from its paper,
on small tensors and on a tiny model; eviction composed with the cache's other axes against
recomputation with the same tokens masked; refused combinations; bytes held; compressed shared
prefixes."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.errors import InvalidParams
from kvcache.kernels.rotary import Rotary
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

    papers = {"knorm": "Devoto", "snapkv": "Li et al", "expected": "kvpress", "tova": "Oren", "h2o": "Zhang",
              "kvzip": "Kim et al"}
    assert set(PRESSES) == set(papers)
    for name, cls in PRESSES.items():
        doc = __import__(cls.__module__, fromlist=["x"]).__doc__ or ""
        assert papers[name] in doc, name
    assert pkg.QUESTION_AGNOSTIC == ("knorm", "expected", "kvzip")


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


# -- on a tiny model: the cache against recomputation with the same tokens masked ----------------------
PROMPT = [(7 * i + 3) % 150 + 2 for i in range(100)]
STEPS = 6


class MaskedRecompute:
    """The oracle: recompute every token from scratch; query i of layer l, KV head h sees key j when
    ``allowed[l][h, i, j]`` (sinks scored against the query turned back by ``delta[i]``)."""

    def __init__(self, allowed: list[torch.Tensor], sinks: int = 0, delta: torch.Tensor | None = None,
                 rotary=None) -> None:
        self.allowed, self.sinks, self.delta, self.rotary = allowed, sinks, delta, rotary

    def attend_packed(self, *args):
        return None

    def attend_block(self, *args):
        return False

    def attend(self, layer, q, k, v, scale):
        n, hq, d = q.shape
        hkv = k.shape[1]
        out = torch.empty_like(q)
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (q[:, h] @ k[:, kh].T) * scale  # [n, n]
            if self.sinks and self.delta is not None:
                qs = self.rotary.rotate(q[:, h : h + 1], -self.delta)[:, 0]
                s[:, : self.sinks] = (qs @ k[: self.sinks, kh].T) * scale
            s = s.masked_fill(~self.allowed[layer][kh], float("-inf"))
            out[:, h] = s.softmax(-1) @ v[:, kh]
        return out


def _kept_now(seq) -> list[list[set[int]]]:
    """[layer][head] -> the positions the cache holds for that layer and KV head."""
    st, out = seq.kv.press, []
    for g, pos in enumerate(st.pos):
        for j in range(pos.shape[0]):
            out.append([set(x for x in pos[j, h, : st.n[g]].tolist() if x >= 0) for h in range(pos.shape[1])])
    return out


def _run_press(llm, prompt, steps):
    """Prompt, then greedy decode steps: (logits per step, tokens, kept sets seen by each query)."""
    runner = llm.runner
    seq = runner.new_sequence()
    logits = runner.step([seq], [prompt])[0]
    outs, toks, seen = [logits], list(prompt), []
    for _ in range(steps):
        tok = int(outs[-1].argmax())
        toks.append(tok)
        outs.append(runner.step([seq], [[tok]])[0])
        seen.append(_kept_now(seq))
    return outs, toks, seen, seq


def _oracle(llm, toks, n_prompt, seen, window=None, sinks=0):
    """Logits of each decode step from MaskedRecompute (``window``: every layer's, else the
    model's own per layer)."""
    cfg = llm.config
    n = len(toks)
    allowed = []
    for layer in range(cfg.num_layers):
        own = cfg.layer_windows[layer] if cfg.layer_windows and window is None else None
        a = torch.ones(cfg.num_kv_heads, n, n).tril().bool()
        for i in range(n_prompt, n):
            for h in range(cfg.num_kv_heads):
                row = torch.zeros(n, dtype=torch.bool)
                row[list(seen[i - n_prompt][layer][h])] = True
                a[h, i] &= row
        if window is not None or own is not None:
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            a &= ((i - j) < (window or own) - sinks) | (j < sinks)
        allowed.append(a)
    pos = torch.arange(n)
    delta = (pos - (window - 1)).clamp(min=0) if window is not None else None
    ctx = MaskedRecompute(allowed, sinks, delta, llm.model.rotary_for_layer(0))
    with torch.inference_mode():
        return llm.model(torch.tensor(toks), pos, ctx)  # [n, V]


@pytest.mark.parametrize("press", ["knorm", "snapkv", "expected", "kvzip", "tova", "h2o"])
def test_press_decodes_as_recompute_with_the_evicted_tokens_masked(tiny_dir, press):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv=f"dynamic,page_size=4,press={press},ratio=0.5,protect=4", prefix=False)
    outs, toks, seen, seq = _run_press(llm, PROMPT, STEPS)
    ref = _oracle(llm, toks, len(PROMPT), seen)
    for s in range(1, STEPS + 1):
        torch.testing.assert_close(outs[s], ref[len(PROMPT) + s - 1], atol=1e-4, rtol=1e-4)
    held = [len(x) for x in seen[-1][0]]
    assert held[0] < len(toks) - 1 and len(set(held)) == 1
    llm.check_integrity()
    llm.runner.free(seq)


def test_prefill_press_keeps_what_its_reference_keeps_on_a_tiny_model(tiny_dir):
    """The model's own keys, recorded by a capture of the same prompt, give the reference's choice."""
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="dynamic,page_size=4,press=knorm,ratio=0.5,protect=4", prefix=False)
    keys = {}

    class Capture(MaskedRecompute):
        def attend(self, layer, q, k, v, scale):
            keys[layer] = k.detach().clone()
            return super().attend(layer, q, k, v, scale)

    n = len(PROMPT)
    allowed = [torch.ones(llm.config.num_kv_heads, n, n).tril().bool()] * llm.config.num_layers
    with torch.inference_mode():
        llm.model(torch.tensor(PROMPT), torch.arange(n), Capture(allowed))
    seq = llm.runner.new_sequence()
    llm.runner.step([seq], [PROMPT])
    kept = _kept_now(seq)
    for layer, k in keys.items():
        for h in range(k.shape[1]):
            scores = (-k[:, h].norm(dim=-1)).tolist()
            assert kept[layer][h] == _top(scores, int(n * 0.5), set(range(n - 4, n))), (layer, h)
    llm.runner.free(seq)


@pytest.mark.parametrize("kv", ["dynamic,page_size=4", "int8,group_size=8,residual=16"])
@pytest.mark.parametrize("chunk", [2048, 24])
def test_kvzip_keeps_what_the_replayed_prompt_attends_to(tiny_dir, monkeypatch, kv, chunk):
    """KVzip's reference: each chunk replayed after the prompt (its request, the template's answer
    opening, the chunk) in a from-scratch forward; a slot scores the largest softmax weight any
    replayed token of its KV head's group gives it, the softmax over the sinks, the chunk and the
    replayed tokens. The replay leaves the sequence as it was, less what the press evicted."""
    from kvcache import LLM
    from kvcache.press.kvzip import KVzipPress

    monkeypatch.setattr(KVzipPress, "chunk", chunk)
    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv=f"{kv},press=kvzip,ratio=0.5,protect=4", prefix=False)
    cfg, n = llm.config, len(PROMPT)
    replay = llm.model.replay_prompt
    assert replay is not None and len(replay.first) > 3
    scores = torch.zeros(cfg.num_layers, cfg.num_kv_heads, n)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        toks = PROMPT + replay.ids(PROMPT, a, b)
        qs: dict[int, torch.Tensor] = {}
        ks: dict[int, torch.Tensor] = {}

        class Capture(MaskedRecompute):
            def attend(self, layer, q, k, v, scale):
                qs[layer], ks[layer] = q.detach().clone(), k.detach().clone()
                return super().attend(layer, q, k, v, scale)

        m = len(toks)
        allowed = [torch.ones(cfg.num_kv_heads, m, m).tril().bool()] * cfg.num_layers
        with torch.inference_mode():
            llm.model(torch.tensor(toks), torch.arange(m), Capture(allowed))
        j = torch.arange(m)
        for layer in range(cfg.num_layers):
            q, k = qs[layer][n:], ks[layer]  # the replayed queries; every key
            g = q.shape[1] // k.shape[1]
            for h in range(cfg.num_kv_heads):
                s = torch.einsum("tgd,sd->gts", q[:, h * g : (h + 1) * g], k[:, h]) / math.sqrt(q.shape[-1])
                seen = (j < min(4, a)) | ((j >= a) & (j < b)) | ((j >= n) & (j[None, :] <= torch.arange(n, m)[:, None]))
                p = s.masked_fill(~seen, float("-inf")).softmax(-1)  # [g, T, m]
                scores[layer, h, a:b] = torch.maximum(scores[layer, h, a:b], p[:, :, a:b].amax(dim=(0, 1)))
    seq = llm.runner.new_sequence()
    llm.runner.step([seq], [PROMPT])
    assert seq.tokens == PROMPT and seq.kv.length == n  # the replay is gone
    kept = _kept_now(seq)
    forced = set(range(4)) | set(range(n - 4, n))
    for layer in range(cfg.num_layers):
        for h in range(cfg.num_kv_heads):
            want = _top(scores[layer, h].tolist(), int(n * 0.5), forced)
            assert kept[layer][h] == want, (layer, h)
    assert all(a is None for a in seq.kv.press.acc)  # the replay's scores are not kept
    llm.check_integrity()
    llm.runner.free(seq)


def test_kvzip_needs_the_tokenizer_and_room_to_replay(tiny_dir):
    from kvcache import LLM
    from kvcache.engine.runner import ModelRunner

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="press=kvzip,ratio=0.5", prefix=False)
    room = llm.config.max_position
    seq = llm.runner.new_sequence()
    with pytest.raises(InvalidParams, match="room after the prompt to replay"):
        llm.runner.step([seq], [[5] * (room - 2)])
    llm.runner.free(seq)
    llm.model.replay_prompt = None
    bare = ModelRunner(llm.model, llm.cache_config)
    seq = bare.new_sequence()
    with pytest.raises(InvalidParams, match="needs the model's tokenizer"):
        bare.step([seq], [PROMPT])
    bare.free(seq)
    ok = llm.runner.new_sequence()  # the runner that failed still serves
    llm.model.replay_prompt = __import__("kvcache.press.kvzip", fromlist=["x"]).replay_prompt(llm.tokenizer)
    llm.runner.replay = llm.model.replay_prompt
    llm.runner.step([ok], [PROMPT])
    llm.check_integrity()
    llm.runner.free(ok)


@pytest.mark.parametrize("kv", ["window=24,page_size=4", "sinks=4,window=24,page_size=4"])
def test_press_composes_with_windows_and_sinks_exactly(tiny_dir, kv):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv=f"{kv},press=knorm,ratio=0.5,protect=4", prefix=False)
    outs, toks, seen, seq = _run_press(llm, PROMPT, STEPS)
    window = 24
    sinks = 4 if "sinks" in kv else 0
    ref = _oracle(llm, toks, len(PROMPT), seen, window, sinks)
    for s in range(1, STEPS + 1):
        torch.testing.assert_close(outs[s], ref[len(PROMPT) + s - 1], atol=1e-4, rtol=1e-4)
    llm.check_integrity()


def test_quantized_press_evicts_then_quantizes(tiny_dir):
    """int4: the prompt waits in fp32 until the press has chosen, so the same tokens go as with
    fp32; what stays is sealed into pages afterwards and decoding reads it."""
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    spec = "page_size=8,group_size=8,residual=16,press=snapkv,ratio=0.5,protect=4"
    full = LLM(str(path), kv=spec, prefix=False)
    quant = LLM(str(path), kv="int4," + spec, prefix=False)
    a, _, seen_a, sa = _run_press(full, PROMPT, 4)
    b, _, seen_b, sb = _run_press(quant, PROMPT, 4)
    assert seen_a[0] == seen_b[0]  # the same tokens kept in every layer and head
    assert len(sb.kv.tables[0]) >= 4 and sb.kv.tail_len(0) <= 16 + 8  # sealed after the press
    for x, y in zip(a, b):
        assert float((x - y).abs().max()) < 0.05 * float(x.abs().max())  # int4's noise, not other tokens
        assert int(x.argmax()) == int(y.argmax())
    quant.check_integrity()


def test_quantized_decode_press_evicts_only_full_precision_tokens(tiny_dir):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="int8,page_size=8,group_size=8,residual=24,press=tova,keep=40,protect=4", prefix=False)
    _, toks, seen, seq = _run_press(llm, PROMPT, 12)
    kv = seq.kv
    assert kv.held(0) <= 40 + 1 and [len(x) for x in seen[-1][0]] == [kv.held(0)] * 2
    sealed = len(kv.tables[0]) * 8
    first = [set(x) for x in seen[0][0]]
    for h in range(2):  # sealed slots keep their tokens from step to step
        s0 = sorted(first[h])[:sealed]
        assert set(s0) <= set(seen[-1][0][h])
    llm.check_integrity()


def test_bytes_held_drop_with_the_ratio(tiny_dir):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    sizes = {}
    for spec in ("dynamic,page_size=4", "dynamic,page_size=4,press=knorm,ratio=0.5,protect=4",
                 "dynamic,page_size=4,press=knorm,ratio=0.75,protect=4"):
        llm = LLM(str(path), kv=spec, prefix=False)
        seq = llm.runner.new_sequence()
        llm.runner.step([seq], [PROMPT])
        st = llm.kv_stats()
        cap = seq.kv.press.pos[0].shape[2] if seq.kv.press is not None else 0
        sizes[spec] = (st.bytes_used, st.pages_used, seq.kv.held(0), cap)
        llm.check_integrity()
    full, half, quarter = sizes.values()
    assert (half[2], quarter[2]) == (50, 25)
    assert half[1] == 13 and quarter[1] == 7 and full[1] == 25  # pages past the kept slots went back
    per_token = full[0] / len(PROMPT)
    slot_bytes = 3 * 2 * half[3] * 4  # the positions: int32 per layer, KV head and slot
    assert abs(half[0] - 50 * per_token - slot_bytes) < 1
    assert quarter[0] < half[0] < full[0]


def test_refused_combinations():
    from kvcache.cache.config import parse_kv_spec
    from kvcache.hf import make_cache

    bad = {"ratio=0.5": "press options without a press", "press=knorm": "exactly one of them",
           "press=knorm,ratio=0.5,keep=100": "exactly one of them", "press=lru,ratio=0.5": "unknown press",
           "press=knorm,ratio=1.5": "between 0 and 1", "press=knorm,keep=50,protect=64": "must exceed",
           "window=60,press=knorm,ratio=0.5": "shows no token", "none,press=knorm,ratio=0.5": "keeps no cache",
           "int4,press=tova,ratio=0.5,residual=64": "evicts tokens before they are quantized",
           "press=knorm,ratio=x": "needs a number"}
    for spec, words in bad.items():
        with pytest.raises(InvalidParams, match=words):
            parse_kv_spec(spec)
    assert parse_kv_spec("int4,press=tova,ratio=0.5,protect=32").spec() == "dynamic,int4,press=tova,ratio=0.5,protect=32"
    with pytest.raises(InvalidParams, match="transformers bridge"):
        make_cache(_llama_config(), "press=knorm,ratio=0.5")


def _llama_config():
    from conftest import tiny_hf_config

    return tiny_hf_config("llama")


def test_generate_through_the_public_api(tiny_dir):
    from kvcache import LLM, SamplingParams

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="page_size=4,press=snapkv,ratio=0.5,protect=4")
    out = llm.generate([PROMPT, PROMPT[:80]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    ref = LLM(str(path), kv="page_size=4,press=snapkv,ratio=0.5,protect=4", prefix=False)
    alone = ref.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert alone.outputs[0].token_ids == out[0].outputs[0].token_ids
    llm.check_integrity()


# -- compressed shared prefixes ---------------------------------------------------------------------
def test_compressed_system_prompt_is_shared_and_keyed_apart(tiny_dir):
    from kvcache import LLM
    from kvcache.prefix.restore import layout_text

    path, _ = tiny_dir("llama")
    spec = "page_size=4,press=knorm,ratio=0.5,protect=4"
    llm = LLM(str(path), kv=spec)
    runner, system = llm.runner, PROMPT[:60]
    first = runner.lookup(system + [5])
    assert first.tokens == []
    runner.step([first], [system])  # compressed once, at the end of the prompt
    runner.release(first)
    entry = next(iter(runner.prefix.spans.entries.values()))
    assert entry.tokens == tuple(system) and entry.slots == [30]
    assert runner.prefix.index.num_nodes == 0  # no uncompressed page was indexed

    outs = {}
    for q in ([9, 8, 7, 6, 5, 4, 3, 2], [11, 12, 13]):
        seq = runner.lookup(system + q)
        assert seq.tokens == system and seq.kv.held(0) == 30
        assert seq.kv.tables[0][:7] == entry.pages[0][:7]  # the same pages, not copies
        logits = runner.step([seq], [q])[0]
        fresh = LLM(str(path), kv=spec, prefix=False).runner
        alone = fresh.new_sequence()
        fresh.step([alone], [system])
        expect = fresh.step([alone], [q])[0]
        torch.testing.assert_close(logits, expect, atol=1e-5, rtol=1e-5)
        outs[tuple(q)] = logits
        runner.release(seq)
    assert runner.prefix.stats().hit_tokens == 2 * len(system)
    llm.check_integrity()

    # a question-aware press shares nothing; keys for tiers name the press
    snap = LLM(str(path), kv="page_size=4,press=snapkv,ratio=0.5,protect=4")
    s = snap.runner.lookup(system + [5])
    snap.runner.step([s], [system])
    snap.runner.release(s)
    assert snap.runner.prefix.spans is None and snap.runner.lookup(system + [5]).tokens == []
    texts = {layout_text(LLM(str(path), kv=k, prefix=False).runner.cache) for k in
             ("page_size=4", spec, "page_size=4,press=knorm,ratio=0.25,protect=4", "page_size=4,press=expected,ratio=0.5,protect=4")}
    assert len(texts) == 4

    # the public way: cache the system prompt once, then every request that starts with it reuses it
    llm2 = LLM(str(path), kv=spec)
    assert llm2.cache_prefix(system) == len(system)
    from kvcache import SamplingParams

    outs = llm2.generate([system + [9, 8], system + [11, 12]], SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    assert [o.cached_tokens for o in outs] == [len(system)] * 2 and all(len(o.outputs) == 2 for o in outs)
    llm2.check_integrity()


def test_compressed_sequence_saves_and_loads(tiny_dir, tmp_path):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    spec = "page_size=4,press=expected,ratio=0.5,protect=4"
    llm = LLM(str(path), kv=spec, prefix=False)
    runner = llm.runner
    seq = runner.new_sequence()
    runner.step([seq], [PROMPT])
    runner.save(seq, str(tmp_path / "p.kv"), llm.fingerprint)
    expect = runner.step([seq], [[5]])[0]
    other = LLM(str(path), kv=spec, prefix=False)
    loaded = other.runner.load(str(tmp_path / "p.kv"), other.fingerprint)
    assert loaded.kv.held(0) == 50 and torch.equal(loaded.kv.press.pos[0][:, :, :50], seq.kv.press.pos[0][:, :, :50])
    torch.testing.assert_close(other.runner.step([loaded], [[5]])[0], expect, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="does not fit this cache"):
        LLM(str(path), kv="page_size=4", prefix=False).runner.load(str(tmp_path / "p.kv"), llm.fingerprint)


def test_compressed_prompt_goes_through_the_disk_tier(tiny_dir, tmp_path):
    """Another process (a fresh LLM on the same folder) starts from the compressed prompt; another
    press, or a corrupt entry, is a miss."""
    from kvcache import LLM
    from kvcache.prefix.config import PrefixConfig

    path, _ = tiny_dir("llama")
    spec, system, q = "page_size=4,press=knorm,ratio=0.5,protect=4", PROMPT[:60], [9, 8, 7]
    tier = PrefixConfig(disk=str(tmp_path / "tier"))
    a = LLM(str(path), kv=spec, prefix=tier)
    s = a.runner.lookup(system + q)
    a.runner.step([s], [system])
    a.runner.release(s)
    a.flush()

    b = LLM(str(path), kv=spec, prefix=tier)
    seq = b.runner.lookup(system + q)
    assert seq.tokens == system and seq.kv.held(0) == 30
    assert b.prefix_stats().tier_tokens == len(system)
    fresh = LLM(str(path), kv=spec, prefix=False).runner
    alone = fresh.new_sequence()
    fresh.step([alone], [system])
    torch.testing.assert_close(b.runner.step([seq], [q])[0], fresh.step([alone], [q])[0], atol=1e-5, rtol=1e-5)
    b.check_integrity()

    other = LLM(str(path), kv="page_size=4,press=knorm,ratio=0.25,protect=4", prefix=tier)
    assert other.runner.lookup(system + q).tokens == []  # keyed by the press and its ratio
    for f in (tmp_path / "tier").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            data = bytearray(f.read_bytes())
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
    c = LLM(str(path), kv=spec, prefix=tier)
    assert c.runner.lookup(system + q).tokens == []  # a corrupt entry is a miss


_REFS: dict[str, tuple] = {}


@pytest.mark.parametrize("kv", ["static,max_tokens=128", "disk", "host", "bf16"])
def test_press_composes_with_capacity_placement_and_float_encodings(tiny_dir, kv):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    press = "page_size=4,press=h2o,ratio=0.5,protect=4"
    if press not in _REFS:  # over dynamic fp32 pages, once for every variant
        ref_llm = LLM(str(path), kv=press, prefix=False)
        _REFS[press] = _run_press(ref_llm, PROMPT, 8)[::2]
    ref, seen_ref = _REFS[press]
    llm = LLM(str(path), kv=f"{kv},{press}", prefix=False)
    outs, _, seen, seq = _run_press(llm, PROMPT, 8)
    tol = 2e-2 if kv == "bf16" else 1e-5
    for a, b in zip(ref, outs):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    if kv != "bf16":
        assert seen == seen_ref
    assert seq.kv.held(0) < len(PROMPT)
    llm.check_integrity()


def test_press_on_a_model_with_sliding_layers(tiny_dir):
    """Gemma 3: sliding layers (window 8) and full ones in separate groups, each packed on its own."""
    from kvcache import LLM

    path, _ = tiny_dir("gemma3")
    llm = LLM(str(path), kv="page_size=4,press=knorm,ratio=0.5,protect=4", prefix=False)
    outs, toks, seen, seq = _run_press(llm, PROMPT, 4)
    ref = _oracle(llm, toks, len(PROMPT), seen)
    for s in range(1, 5):
        torch.testing.assert_close(outs[s], ref[len(PROMPT) + s - 1], atol=1e-4, rtol=1e-4)
    assert len(seq.kv.tables) == 2 and seq.kv.held(1) < len(PROMPT)
    llm.check_integrity()


def test_a_prompt_in_chunks_is_compressed_once_at_its_end(tiny_dir):
    from kvcache import LLM, SamplingParams
    from kvcache.engine.scheduler import SchedulerConfig

    path, _ = tiny_dir("llama")
    spec = "page_size=4,press=snapkv,ratio=0.5,protect=4"
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    whole = LLM(str(path), kv=spec, prefix=False).generate(PROMPT, p)[0]
    llm = LLM(str(path), kv=spec, prefix=False)
    chunked = llm.generate_batch([PROMPT], p, scheduler=SchedulerConfig(max_batch_tokens=16))[0]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    runner = llm.runner
    seq = runner.new_sequence()
    for a in range(0, len(PROMPT), 16):  # what the scheduler does: only the last chunk ends the prompt
        runner.step([seq], [PROMPT[a : a + 16]], prompt_end=a + 16 >= len(PROMPT))
    assert seq.kv.press.points == [len(PROMPT)] and seq.kv.held(0) == 64  # SnapKV keeps its 64-query window


@pytest.mark.parametrize("press", ["expected", "snapkv", "tova", "h2o", "knorm"])
def test_short_prompts_evict_only_what_may_go(tiny_dir, press):
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv=f"page_size=4,press={press},ratio=0.5,protect=2", prefix=False)
    _, toks, seen, seq = _run_press(llm, PROMPT[:3], 3)
    if press in ("expected", "snapkv"):  # its own protection (4 first tokens, 64-query window) covers all
        assert seen[0][0][0] == {0, 1, 2, 3}
    else:  # only the token before the protected two could go
        assert {1, 2, 3} <= seen[0][0][0] and 0 not in seen[-1][0][0]
    llm.check_integrity()


@pytest.mark.parametrize("press", ["knorm", "kvzip"])
def test_compressed_prompt_is_never_a_whole_prompt_hit(tiny_dir, press):
    """The same prompt again must compute at least its last token: a compressed span is reused only
    when the prompt goes past it, and generating from that prompt matches a fresh cache; a prompt
    that goes past it starts from the compressed span (KVzip's replay included) and generates what
    a fresh cache does."""
    from kvcache import LLM, SamplingParams

    path, _ = tiny_dir("llama")
    spec = f"page_size=4,press={press},ratio=0.5,protect=4"
    llm = LLM(str(path), kv=spec)
    system = PROMPT[:60]
    assert llm.cache_prefix(system) == len(system)
    assert llm.runner.lookup(system).tokens == []  # no hit that would leave nothing to compute
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([system], params)
    (fresh,) = LLM(str(path), kv=spec, prefix=False).generate([system], params)
    assert out.cached_tokens == 0 and out.outputs[0].token_ids == fresh.outputs[0].token_ids
    (longer,) = llm.generate([system + [9, 8, 7]], params)
    fresh_llm = LLM(str(path), kv=spec, prefix=False)
    seq = fresh_llm.runner.new_sequence()
    fresh_llm.runner.step([seq], [system])  # the span compressed alone, as cache_prefix does
    want = [int(fresh_llm.runner.step([seq], [[9, 8, 7]])[0].argmax())]
    assert longer.cached_tokens == len(system) and longer.outputs[0].token_ids[0] == want[0]
    llm.check_integrity()


@pytest.mark.parametrize("press", ["tova", "h2o"])
def test_decode_press_generates_after_scored_text(tiny_dir, press):
    """Scored text (runner.score) is kept whole; generating after it works, and a decode-time press
    starts evicting once a generated token's attention is known (TOVA has no prompt query then)."""
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv=f"dynamic,page_size=4,press={press},ratio=0.5,protect=4", prefix=False)
    seq = llm.runner.new_sequence()
    llm.runner.score(seq, PROMPT)
    assert seq.kv.length - seq.kv.dropped[0] == len(PROMPT)  # nothing evicted from scored text
    for tok in (5, 6, 7):
        assert llm.runner.step([seq], [[tok]]).shape[0] == 1
    held = [len(h) for h in _kept_now(seq)[0]]
    assert max(held) <= int((len(PROMPT) + 3) * 0.5) + 1
    llm.check_integrity()
    llm.runner.free(seq)


@pytest.mark.parametrize("press", ["tova", "h2o"])
def test_decode_press_evicts_while_the_engine_generates(tiny_dir, press):
    """Through the scheduler, which asks for each step's pages outside any forward: the press's
    evictions between tokens run there too, and the text is the runner's own greedy decode."""
    from kvcache import LLM, SamplingParams

    path, _ = tiny_dir("llama")
    kv = f"dynamic,page_size=4,press={press},ratio=0.5,protect=4"
    llm = LLM(str(path), kv=kv, prefix=False)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0]
    _, toks, seen, seq = _run_press(LLM(str(path), kv=kv, prefix=False), PROMPT, 12)
    assert out.token_ids == toks[len(PROMPT):len(PROMPT) + 12]
    assert max(len(h) for h in seen[-1][0]) < len(PROMPT)  # it did evict
    llm.check_integrity()


def test_a_refused_proposals_attention_never_counts(tiny_dir):
    """H2O's sums after a verifying forward of four tokens cut back to two are the sums after a
    verifying forward of those two alone; counting the refused ones would give other sums."""
    from kvcache import LLM

    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="dynamic,page_size=4,press=h2o,ratio=0.5,protect=4", prefix=False)
    r = llm.runner

    def acc_after(feed: list[int], keep: int | None) -> torch.Tensor:
        seq = r.new_sequence()
        r.step([seq], [PROMPT])
        r.reserve([seq], [len(feed)], [len(feed)])
        r.step([seq], [feed], want=[len(feed)])
        if keep is not None:
            r.truncate(seq, len(PROMPT) + keep)
        st = seq.kv.press
        st.commit(seq.kv.length)
        acc = st.acc[0][:, :, : st.n[0]].clone()
        assert not st.observing  # the proposals were read as decodes, not scored as a prompt
        r.free(seq)
        return acc

    two = acc_after([5, 6], None)
    cut = acc_after([5, 6, 7, 8], 2)
    whole = acc_after([5, 6, 7, 8], None)
    torch.testing.assert_close(cut, two, atol=1e-5, rtol=1e-5)
    assert float((whole[:, :, : two.shape[2]] - two).abs().max()) > 1e-3
    llm.check_integrity()
