"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (tiny random-weight models as the oracle).

Weights are drawn larger than HF's init, so the router is far from uniform and rows choose
different experts: a wrong routing rule (softmax, top-k, renormalization) or a wrong combination
costs far more than the tolerance (test_routing_rules_are_visible). Quantized experts (q8 at load,
a GGUF's own Q8_0 / Q4_0 blocks under ``file``) are measured against fp32 and must be batch
invariant bitwise: a row's logits never depend on which other rows chose the same experts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import VOCAB, fresh_home, write_tiny_tokenizer
from kvcache import LLM
from kvcache.attention.recompute import RecomputeContext
from kvcache.errors import UnsupportedArchitecture
from kvcache.kernels.qweight import QWeight, kernels_available
from kvcache.models.config import ModelConfig
from kvcache.models.gguf_tensor import GGUFTensor
from kvcache.models.moe import Expert
from kvcache.models.registry import build_model

ATOL = 1e-4
PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 140, 66, 2, 91]
STEPS = 8
# norm: 8 experts, 2 a token, renormalized, untied head; plain: 6 experts, 3 a token, the softmax's
# own weights, tied head, attention biases
CASES: dict[str, dict[str, Any]] = {
    "norm": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
    "plain": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True,
                  attention_bias=True),
}
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="quantized weights need the native kernels")


def hf_model(case: str, **extra: Any) -> Any:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        initializer_range=0.15, bos_token_id=0, eos_token_id=1, pad_token_id=1, **{**CASES[case], **extra})
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: make every one matter
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return hf


_MADE: dict[str, tuple[Path, Any]] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(case) -> (a saved model folder with a tokenizer, the HF model), made once."""

    def get(case: str) -> tuple[Path, Any]:
        if case not in _MADE:
            hf = hf_model(case)
            path = tmp_path_factory.mktemp(f"qwen3moe-{case}")
            hf.save_pretrained(path, safe_serialization=True)
            write_tiny_tokenizer(path)
            _MADE[case] = (path, hf)
        return _MADE[case]

    return get


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 6, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_steps(hf: Any, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """HF's logits after the prompt and after each greedy token (its own DynamicCache)."""
    from transformers import DynamicCache

    cache, out, chosen, ids, pos = DynamicCache(config=hf.config), [], [], torch.tensor([prompt]), 0
    for _ in range(steps + 1):
        res = hf(input_ids=ids, cache=cache, use_cache=True,
                 position_ids=torch.arange(pos, pos + ids.shape[1])[None])
        pos += ids.shape[1]
        out.append(res.logits[0, -1].float())
        chosen.append(int(out[-1].argmax()))
        ids = torch.tensor([[chosen[-1]]])
    return out, chosen


@torch.inference_mode()
def flat_logits(model: Any, config: ModelConfig, seqs: list[list[int]]) -> torch.Tensor:
    """Our logits [sum n_i, V] for sequences fed together in one flat forward from position 0."""
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return model(ids, pos, RecomputeContext([len(s) for s in seqs], pos, config.layer_windows))


def feed(llm: LLM, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    """Per prompt, the logits after it and after each of ``steps`` greedy tokens, every prompt in
    one step, then the decodes of all of them together."""
    r = llm.runner
    seqs = [r.new_sequence() for _ in prompts]
    got = [[row] for row in r.step(seqs, prompts)]
    for _ in range(steps):
        for g, row in zip(got, r.step(seqs, [[int(g[-1].argmax())] for g in got])):
            g.append(row)
    for s in seqs:
        r.free(s)
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case: str) -> None:
    """Built from transformers' in-memory weights (experts stacked [E, 2I, H] / [E, H, I])."""
    hf = hf_model(case)
    config = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(config, hf.state_dict())
    ids = tokens(30, 1)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    assert ref.abs().max() > 1.0  # not all near zero: a real comparison
    err = (flat_logits(model, config, [ids]) - ref).abs().max().item()
    assert err < ATOL, f"max |ours - hf| = {err:.3g}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv", ["dynamic,page_size=4", "static,max_tokens=64,page_size=4", "none"])
def test_steps_through_the_cache_match_hf(folder, case: str, kv: str) -> None:
    """The saved folder (per-expert names, as on disk) through the engine's cache: prompt, then decodes."""
    path, hf = folder(case)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in set(f.keys())
    llm = LLM(str(path), weights="fp32", kv=kv, prefix=False)
    expected, chosen = hf_steps(hf, PROMPT, STEPS)
    r = llm.runner
    seq, feed_ = r.new_sequence(), list(PROMPT)
    for step in range(STEPS + 1):
        logits = r.step([seq], [feed_])[0]
        torch.testing.assert_close(logits, expected[step], atol=ATOL, rtol=ATOL,
                                   msg=lambda m: f"{case} {kv} step {step}: {m}")
        feed_ = [chosen[step]]
    r.free(seq)
    llm.check_integrity()


def test_rows_are_grouped_by_expert(folder, monkeypatch) -> None:
    """A step runs each chosen expert once per layer, over every row that chose it; the rows
    spread over several experts (the routing is not degenerate)."""
    path, _ = folder("norm")
    llm = LLM(str(path), weights="fp32", kv="none", prefix=False)
    calls: list[tuple[int, int]] = []
    forward = Expert.forward

    def counted(self: Expert, h: torch.Tensor, act: Any) -> torch.Tensor:
        calls.append((id(self), h.shape[0]))
        return forward(self, h, act)

    monkeypatch.setattr(Expert, "forward", counted)
    prompts = [tokens(9, 2), tokens(14, 3), tokens(5, 4)]
    feed(llm, prompts, steps=0)
    spec = llm.model.spec
    assert len(calls) == len({c[0] for c in calls})  # no expert twice in the step
    assert sum(n for _, n in calls) == 28 * spec.top_k * 3  # every row's k choices in each of 3 layers
    assert spec.top_k * 3 < len(calls) <= spec.num_experts * 3  # more experts than one row's in a layer


def test_a_decode_step_reads_only_its_experts(folder) -> None:
    """step_weight_bytes counts top_k of num_experts experts a layer (what a decode reads), the rest in
    full but the untied embedding table (a step looks up rows of it)."""
    path, _ = folder("norm")
    model = LLM(str(path), weights="fp32", prefix=False).model
    per_layer = sum(p.numel() * 4 for ex in model.layers[0].experts for p in ex.parameters())
    assert per_layer == 8 * 3 * 64 * 32 * 4  # 8 experts of gate, up and down [32, 64]
    skipped = 3 * per_layer * (8 - 2) // 8
    table = model.embed.numel() * 4
    assert model.step_weight_bytes() == model.weight_bytes() - table - skipped


def test_routing_rules_are_visible() -> None:
    """The tolerance is far below what a routing mistake costs: without renormalization, or with
    one expert fewer a token, the logits move by more than 100x ATOL."""
    hf = hf_model("norm")
    config = ModelConfig.from_hf(hf.config.to_dict())
    ids = tokens(30, 1)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    for change in ({"norm_topk_prob": False}, {"num_experts_per_tok": 1}):
        wrong = replace(config, raw={**config.raw, **change})
        err = (flat_logits(build_model(wrong, hf.state_dict()), wrong, [ids]) - ref).abs().max().item()
        assert err > 100 * ATOL, change


@pytest.mark.parametrize("weights", ["fp32", pytest.param("q8", marks=needs_kernels)])
def test_a_sequence_in_a_batch_gives_its_bits_alone(folder, weights: str) -> None:
    path, _ = folder("norm")
    llm = LLM(str(path), weights=weights, kv="dynamic,page_size=4", prefix=False)
    prompts = [tokens(n, 10 + n) for n in (16, 3, 27, 9, 1, 40)]
    alone = [feed(llm, [p], steps=3)[0] for p in prompts]
    together = feed(llm, prompts, steps=3)
    for i, (a, g) in enumerate(zip(alone, together)):
        for step, (x, y) in enumerate(zip(a, g)):
            assert torch.equal(x, y), f"{weights}: sequence {i} step {step}: {float((x - y).abs().max()):.3g}"
    llm.check_integrity()


@needs_kernels
def test_q8_experts_stay_close_to_fp32(folder) -> None:
    """Experts quantized at load to Q8_0 (int8 activations): each expert's output within 3% of its
    fp32 output's largest value (measured: 1.1-2.0%); the logits (magnitude ~5) within 0.05 on
    average (measured: 0.026), KL < 0.02 and 90% the same argmax. A row whose router picks
    another expert under q8 moves further (measured: 0.42 at most, against 0.13 with fp32's routes)."""
    path, _ = folder("norm")
    fp32 = LLM(str(path), weights="fp32", prefix=False)
    q8 = LLM(str(path), weights="q8", prefix=False)
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for lf, lq in zip(fp32.model.layers, q8.model.layers):
        for ef, eq in zip(lf.experts, lq.experts):
            assert isinstance(eq.gate_up, QWeight) and isinstance(eq.down, QWeight)
            yf, yq = ef(h, fp32.model.act), eq(h, q8.model.act)
            assert 0 < float((yf - yq).abs().max()) < 0.03 * float(yf.abs().max())
    ids = tokens(48, 5)
    a = fp32.runner.score(fp32.runner.new_sequence(), ids)
    b = q8.runner.score(q8.runner.new_sequence(), ids)
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    assert float((a - b).abs().mean()) < 0.05
    assert float((la.exp() * (la - lb)).sum(-1).mean()) < 0.02
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9


@needs_kernels
def test_a_quantized_expert_runs_in_one_native_call_with_each_rows_own_bits(folder) -> None:
    """kv_q_expert (gate_up, SiLU, down in one call): a row alone, among 16, or among 3 gives the
    same bits; and it computes what the two products with torch's SiLU between them compute, within
    the int8 rounding of the activations."""
    from kvcache.kernels.qweight import expert_mlp
    from kvcache.models.layers import linear

    path, _ = folder("norm")
    q8 = LLM(str(path), weights="q8", prefix=False)
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    for e in q8.model.layers[0].experts:
        y = expert_mlp(h, e.gate_up, e.down, 0)
        assert y is not None and y.shape == (16, 64)
        assert torch.equal(expert_mlp(h[5:6], e.gate_up, e.down, 0), y[5:6])
        assert torch.equal(expert_mlp(h[[9, 2, 14]].contiguous(), e.gate_up, e.down, 0), y[[9, 2, 14]])
        i = e.size
        gu = linear(h, e.gate_up)
        two_calls = linear(torch.nn.functional.silu(gu[:, :i]) * gu[:, i:2 * i], e.down)[:, :64]
        assert 0 < float((y - two_calls).abs().max()) < 0.02 * float(two_calls.abs().max())
        assert torch.equal(e(h, q8.model.act), y)  # the expert takes the native call
    assert expert_mlp(h, q8.model.layers[0].experts[0].gate_up, q8.model.layers[0].experts[0].down, None) is None


@needs_kernels
def test_a_rows_experts_in_one_native_call_give_the_loops_bits(folder) -> None:
    """kv_q_experts_row (a decode step's mixture in one call) == each expert's kv_q_expert output
    weighted and summed in the row's order by separate multiplies and adds, bitwise."""
    from kvcache.kernels.qmoe import expert_table, experts_row
    from kvcache.kernels.qweight import expert_mlp

    path, _ = folder("norm")
    q8 = LLM(str(path), weights="q8", prefix=False)
    experts = q8.model.layers[1].experts
    table = expert_table([(ex.gate_up, ex.down) for ex in experts])  # the layer's fields, made once
    assert table is not None and table[0].shape[0] == len(experts)
    h = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    for order in ([3, 0], [5, 1, 7, 2], [6]):
        w = torch.rand(len(order), generator=torch.Generator().manual_seed(len(order)))
        got = experts_row(h, table, torch.tensor(order), w, 0)
        want = expert_mlp(h, experts[order[0]].gate_up, experts[order[0]].down, 0) * w[0]
        for j, e in enumerate(order[1:], 1):
            want = want + expert_mlp(h, experts[e].gate_up, experts[e].down, 0) * w[j]
        assert got is not None and torch.equal(got, want), order
    assert experts_row(h.expand(2, 64).contiguous(), table, torch.tensor([0]), w[:1], 0) is None
    with pytest.raises(IndexError, match="outside the layer's"):
        experts_row(h, table, torch.tensor([0, len(experts)]), torch.ones(2), 0)
    fp32 = LLM(str(path), weights="fp32", prefix=False).model.layers[1].experts  # not quantized: no table
    assert expert_table([(ex.gate_up, ex.down) for ex in fp32]) is None


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_the_native_router_follows_the_routing_rules_and_a_decode_row_is_one_call(folder, case: str) -> None:
    """The native router (kernels/dmoe.c) against torch's steps on the same rows: the same experts
    in the same order (increasing ids), weights within 1e-6, the same normed rows within 1e-6; a decode row's whole
    block in one call (kv_q_moe_row) gives the bits of the router then the row's experts, and 40
    rows grouped by expert in one call (kv_q_moe_rows) each row's bits alone."""
    from kvcache.kernels.qmoe import expert_table, experts_row, moe_row, moe_rows
    from kvcache.models.layers import linear, pack, rms_norm

    path, _ = folder(case)
    q8 = LLM(str(path), weights="q8", prefix=False)
    spec = q8.model.spec
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(6)) * 3
    for ly in q8.model.layers:
        router = ly.router
        assert router.table is not None and router.weight is None  # the library is here: the native way
        h, w, e = router(x)
        want_h = rms_norm(x, router.norm, router.eps)
        probs = torch.softmax(linear(want_h, pack(router.table[:, : spec.num_experts].t()))[:, : spec.num_experts], -1)
        want_w, want_e = torch.topk(probs, spec.top_k, dim=-1)
        want_e, by_id = torch.sort(want_e, dim=-1)  # a row's experts in increasing id order
        want_w = want_w.gather(1, by_id)
        if spec.norm_topk:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert torch.equal(e, want_e)
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(h, want_h, atol=1e-6, rtol=1e-6)
        assert torch.allclose(w.sum(-1), torch.ones(40)) == spec.norm_topk
        table = expert_table([(ex.gate_up, ex.down) for ex in ly.experts])
        for r in (0, 17, 39):
            row = x[r : r + 1].clone()
            assert moe_row(row, router.norm, router.eps, router.table, spec.num_experts, spec.top_k, spec.norm_topk,
                           table, 0)
            want = x[r : r + 1] + experts_row(h[r : r + 1], table, e[r], w[r], 0)
            assert torch.equal(row, want), (case, r)
        rows = x.clone()  # every row at once, grouped by expert: each row's bits as alone
        assert moe_rows(rows, h, w, e, table, 0)
        for r in range(40):
            alone = x[r : r + 1].clone()
            moe_row(alone, router.norm, router.eps, router.table, spec.num_experts, spec.top_k, spec.norm_topk,
                    table, 0)
            assert torch.equal(rows[r : r + 1], alone), (case, r)
        with pytest.raises(IndexError, match="outside the layer's"):
            moe_rows(x.clone(), h, w, torch.where(e == e[3, 0], spec.num_experts, e), table, 0)
        with pytest.raises(IndexError, match="not in increasing order"):  # the order the sums are built in
            moe_rows(x.clone(), h, w, e.flip(-1), table, 0)


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_a_forward_runs_every_layer_in_one_call_with_the_layer_by_layer_bits(folder, case: str) -> None:
    """With quantized weights a forward runs every layer (attention half, norm, router and experts)
    in one native call (kernels/dattn.c kv_q_layers with a mixture: one row as kv_q_moe_row runs it,
    more grouped by expert); its logits are the bits of the layer-by-layer path (attention_block,
    then moe_block) for the prompt and at every step, alone and beside a second sequence (two rows a
    step, grouped); a mixture layer without its router is refused (the kernel's 1, in one line)."""
    from kvcache.kernels.qweight import LayerStack

    path, _ = folder(case)
    llm = LLM(str(path), weights="q8", prefix=False)
    stack = llm.model.stack
    assert isinstance(stack, LayerStack) and stack.mixture[0] == CASES[case]["num_experts"]
    taken, real_run = [], LayerStack.run

    def counted(self, ctx, x, *a):
        done = real_run(self, ctx, x, *a)
        taken.append((x.shape[0], done))
        return done

    other = tokens(9, 3)
    LayerStack.run = counted
    try:
        fused = feed(llm, [PROMPT], STEPS)[0]
        assert taken == [(len(PROMPT), True)] + [(1, True)] * STEPS, taken
        fused_pair = feed(llm, [PROMPT, other], STEPS)
        assert taken[STEPS + 1:] == [(len(PROMPT) + len(other), True)] + [(2, True)] * STEPS, taken
        llm.model.stack = None
        steps = feed(llm, [PROMPT], STEPS)[0]
        pair = feed(llm, [PROMPT, other], STEPS)
    finally:
        LayerStack.run, llm.model.stack = real_run, stack
    for a, b, c, d in zip(fused, steps, pair[0], fused_pair[0]):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    for a, b in zip(pair[1], fused_pair[1]):
        assert torch.equal(a, b)
    good = stack.table
    stack.table = good.clone()
    stack.table[-1, -3] = 0  # the last layer's router (KVL_ROUTER)
    runner = llm.runner
    seq = runner.new_sequence()
    try:
        with pytest.raises(RuntimeError, match=r"refused its inputs \(1\)"):
            runner.step([seq], [PROMPT])
    finally:
        runner.free(seq)
        stack.table = good


def _gguf_state(hf: Any, folder_: Path, ggml: int) -> dict[str, Any]:
    """The HF model's weights as the GGUF loader gives them under ``file``: every expert's
    matrices (and attention's) quantized to ``ggml`` blocks in a file, left there as GGUFTensors;
    norms and the router fp32."""
    from gguf.quants import quantize

    from kvcache.models.gguf_tensor import qtype
    from kvcache.models.layers import text_model_names

    sd, out = text_model_names(dict(hf.state_dict())), {}
    blob = folder_ / "weights.bin"
    with open(blob, "wb") as f:
        def put(w: torch.Tensor) -> GGUFTensor:
            raw = quantize(w.detach().float().numpy(), qtype(ggml))
            at = f.tell()
            f.write(np.ascontiguousarray(raw).tobytes())
            return GGUFTensor(str(blob), ggml, w.shape[0], w.shape[1], at)

        for name, t in sd.items():
            m = name.rsplit(".experts.", 1)
            if len(m) == 2 and m[1] == "gate_up_proj":
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{m[0]}.experts.{e}.gate_proj.weight"] = put(t[e, :half])
                    out[f"{m[0]}.experts.{e}.up_proj.weight"] = put(t[e, half:])
            elif len(m) == 2 and m[1] == "down_proj":
                for e in range(t.shape[0]):
                    out[f"{m[0]}.experts.{e}.down_proj.weight"] = put(t[e])
            elif name.endswith("_proj.weight"):
                out[name] = put(t)
            else:
                out[name] = t
    return out


@needs_kernels
@pytest.mark.parametrize("ggml", [8, 2])  # Q8_0, Q4_0
def test_file_experts_keep_their_type_and_batch_invariance(tmp_path, ggml: int) -> None:
    """Per-expert GGUF slices stay in their quantized type (the int8 kernels read them) and give
    what the same numbers give in fp32 up to the int8 activations' rounding: each expert within 3%
    of its output's largest value (measured: 1.8% for both types: the weights are the same
    numbers, only the activations are rounded), the logits within 0.06 on average (measured:
    0.035 / 0.032; a row the rounding routes to another expert moves by up to 1-2), KL < 0.02.
    A sequence gives its bits alone and in a flat batch with others."""
    hf = hf_model("norm")
    config = ModelConfig.from_hf(hf.config.to_dict())
    sd = _gguf_state(hf, tmp_path, ggml)
    model = build_model(config, sd, "file")
    expert = model.layers[1].experts[3]
    assert isinstance(expert.gate_up, QWeight) and expert.gate_up.format_name == ("s8_f16" if ggml == 8 else "q4o_f16")
    ref = build_model(config, {k: v.dequantize() if isinstance(v, GGUFTensor) else v for k, v in sd.items()})
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for lf, lq in zip(ref.layers, model.layers):
        for ef, eq in zip(lf.experts, lq.experts):
            yf, yq = ef(h, ref.act), eq(h, model.act)
            assert 0 < float((yf - yq).abs().max()) < 0.03 * float(yf.abs().max())
    seqs = [tokens(20, 6), tokens(7, 7), tokens(33, 8)]
    got, want = flat_logits(model, config, seqs), flat_logits(ref, config, seqs)
    lg, lw = torch.log_softmax(got, -1), torch.log_softmax(want, -1)
    assert float((got - want).abs().mean()) < 0.06
    assert float((lw.exp() * (lw - lg)).sum(-1).mean()) < 0.02
    at = 0
    for s in seqs:
        assert torch.equal(flat_logits(model, config, [s]), got[at : at + len(s)])
        at += len(s)


def test_a_prefix_hit_over_int8_pages_is_the_int8_caches_own_path(folder) -> None:
    """Prefix caching and an int8 cache compose. A request sharing a first request's prompt start
    reads its sealed pages and gives the bits that cache gives the prompt fed in the same two
    pieces without a prefix index (the pages hold the same codes); a third request through the
    same hit gives them again. The first request's own prompt read its K/V unquantized, so against
    it (and against recomputation) the hit is close, not exact: int8's bound of 0.05 (measured:
    0.0085 against recomputation, 0.0058 against the first request)."""
    path, _ = folder("plain")
    kv = "int8,page_size=8,group_size=8,residual=0"
    llm = LLM(str(path), weights="fp32", kv=kv, prefix=True)
    plain = LLM(str(path), weights="fp32", kv=kv, prefix=False)
    none = LLM(str(path), weights="fp32", kv="none", prefix=False)
    r = llm.runner
    shared = tokens(22, 9)
    first_prompt, prompt = shared + tokens(5, 10), shared + tokens(6, 11)
    seq = r.lookup(first_prompt)
    assert not seq.tokens
    first = r.step([seq], [first_prompt])[0]
    r.release(seq)
    got = []
    for _ in range(2):
        seq = r.lookup(prompt)
        hit = len(seq.tokens)
        assert hit == 16  # the two whole pages the prompts share
        got.append(r.step([seq], [prompt[hit:]])[0])
        r.free(seq)  # its own pages stay out of the index: the next request hits the same two
    assert torch.equal(got[0], got[1])
    p = plain.runner
    seq = p.new_sequence()
    p.step([seq], [prompt[:hit]], prompt_end=False)
    assert torch.equal(p.step([seq], [prompt[hit:]])[0], got[0])
    p.free(seq)
    want = none.runner.step([none.runner.new_sequence()], [prompt])[0]
    assert 0 < float((got[0] - want).abs().max()) < 0.05
    seq = r.lookup(first_prompt)
    again = r.step([seq], [first_prompt[len(seq.tokens):]])[0]
    r.release(seq)
    assert 0 < float((again - first).abs().max()) < 0.05
    llm.check_integrity()


REFUSED = [({"mlp_only_layers": [1]}, "mlp_only_layers"), ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
           ({"shared_expert_intermediate_size": 32}, "shared expert"),
           ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window")]


@pytest.mark.parametrize("change,words", REFUSED, ids=[w for _, w in REFUSED])
def test_configs_not_implemented_are_refused_in_one_line(folder, tmp_path, change: dict, words: str) -> None:
    path, _ = folder("norm")
    copy = tmp_path / "model"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UnsupportedArchitecture, match=words) as e:
        LLM(str(copy), weights="fp32", prefix=False)
    assert "\n" not in str(e.value)


def test_a_shared_expert_tensor_is_refused() -> None:
    hf = hf_model("norm")
    config = ModelConfig.from_hf(hf.config.to_dict())
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(UnsupportedArchitecture, match="shared expert"):
        build_model(config, sd)


def test_a_random_qwen3moe_benchmark_file_loads_and_generates(tmp_path, monkeypatch) -> None:
    """models/random_moe.py's writer gives a qwen3moe GGUF kvcache loads as Qwen3-MoE (3-D expert
    tensors as per-expert weights, q/k norms, the router) and generates from."""
    from kvcache.models.random_moe import MoeShape, write_f16
    from kvcache.engine.params import SamplingParams
    from kvcache.models.qwen3moe import Qwen3MoeForCausalLM

    monkeypatch.setenv("KVCACHE_HOME", str(fresh_home(tmp_path / "home")))  # the repacked weights' cache
    shape = MoeShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, used=2, expert_ffn=32)
    path = write_f16(shape, tmp_path / "moe.gguf", progress=False)
    llm = LLM(str(path), prefix=False)
    assert isinstance(llm.model, Qwen3MoeForCausalLM)
    spec = llm.model.spec
    assert (spec.num_experts, spec.top_k, spec.expert_size, spec.norm_topk) == (8, 2, 32, True)
    assert len(llm.model.layers) == 2 and len(llm.model.layers[0].experts) == 8
    out = llm.generate([[5, 17, 42]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@needs_kernels
@pytest.mark.parametrize("kv", ["dynamic,page_size=4", "dynamic,page_size=4,press=knorm,ratio=0.5,protect=4",
                                "dynamic,int8,group_size=16,page_size=16"])
def test_speculation_and_presses_compose_with_experts(folder, kv: str) -> None:
    """Prompt-lookup speculation verifies several tokens a step (the grouped path) where plain decoding
    runs one (the one-call row path): greedy text is the same, with a press and over int8 pages too,
    and the pages are all accounted for after."""
    from kvcache import SamplingParams

    path, _ = folder("norm")
    base = tokens(12, 8)
    prompts = [base * 3, tokens(20, 9) + base * 2]  # repeats: the lookup finds its proposals
    plain = LLM(str(path), weights="q8", kv=kv, prefix=False)
    spec = LLM(str(path), weights="q8", kv=kv, prefix=False)
    want = plain.generate(prompts, SamplingParams(max_tokens=24))
    got = spec.generate(prompts, SamplingParams(max_tokens=24, prompt_lookup=4))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.get("spec_accepted", 0) for o in got) > 0  # proposals were verified and kept
    spec.check_integrity()
