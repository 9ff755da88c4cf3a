"""Native models against HF transformers as the oracle: tiny random-weight models of every family.

Weights are drawn larger than HF's init (and norms/biases are randomized) so that attention is far
from uniform and every weight changes the logits: a wrong window, RoPE base, scaling or norm shows
up as an error of order 1e-1, against a tolerance of 1e-4 (see test_setup_is_sensitive).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from kvcache.attention.recompute import RecomputeContext  # noqa: E402
from kvcache.errors import UnsupportedArchitecture  # noqa: E402
from kvcache.models.base import CausalLM  # noqa: E402
from kvcache.models.config import ModelConfig  # noqa: E402
from kvcache.models.layers import linear, pack, pack_bias, packed_rows  # noqa: E402
from kvcache.models.registry import build_model  # noqa: E402

ATOL = 1e-4
VOCAB = 203  # odd: the packed output head needs padding whatever the thread count
N = 30  # tokens per test sequence: longer than the sliding windows (8)
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.15, bos_token_id=0,
    eos_token_id=1, pad_token_id=1,
)
GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def hf_config(case: str) -> Any:
    """The transformers config of one test case (family plus the feature it exercises)."""
    import transformers as tf

    c = dict(COMMON)
    if case == "llama":
        return tf.LlamaConfig(**c, tie_word_embeddings=True)
    if case == "llama_bias":  # attention_bias (q/k/v/o) and mlp_bias, untied head, head_dim != H / heads
        return tf.LlamaConfig(**c, attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=False)
    if case == "llama_linear":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    if case == "llama_llama3":
        return tf.LlamaConfig(**c, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0})
    if case == "llama_yarn":
        return tf.LlamaConfig(**c, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0})
    if case == "mistral":
        return tf.MistralConfig(**c, sliding_window=8, head_dim=16)
    if case == "qwen2":
        return tf.Qwen2Config(**c, tie_word_embeddings=False)
    if case == "qwen2_swa":  # sliding window on the layers from max_window_layers on
        return tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if case == "qwen3":
        return tf.Qwen3Config(**c, head_dim=16, tie_word_embeddings=True)
    if case == "phi3":
        return tf.Phi3Config(**c)
    if case == "phi3_partial":
        return tf.Phi3Config(**c, partial_rotary_factor=0.5, sliding_window=8)
    if case == "gemma3":
        return tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                   layer_types=GEMMA_TYPES)
    if case == "gemma3_linear":  # Gemma 3 4B style: linear scaling on the global layers only
        return tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=GEMMA_TYPES, rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if case == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                             initializer_range=0.15, bos_token_id=0, eos_token_id=1)
    if case == "gpt2_layer_scale":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                             initializer_range=0.15, scale_attn_by_inverse_layer_idx=True)
    raise ValueError(case)


CASES = ["llama", "llama_bias", "llama_linear", "llama_llama3", "llama_yarn", "mistral", "qwen2", "qwen2_swa",
         "qwen3", "phi3", "phi3_partial", "gemma3", "gemma3_linear", "gpt2", "gpt2_layer_scale"]
FAMILY_CASES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gpt2"]
_MADE: dict[str, tuple[Any, ModelConfig, CausalLM]] = {}


def models(case: str) -> tuple[Any, ModelConfig, CausalLM]:
    """(HF model, our parsed config, our model) for a case, built once per test session."""
    if case not in _MADE:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(hf_config(case), attn_implementation="eager").float().eval()
        with torch.no_grad():  # HF inits norms to 1 (Gemma: 0) and biases to 0: make every one matter
            for name, p in hf.named_parameters():
                if "norm" in name or "ln_" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.2)
        config = ModelConfig.from_hf(hf.config.to_dict())
        _MADE[case] = (hf, config, build_model(config, hf.state_dict()))
    return _MADE[case]


def tokens(n: int, seed: int) -> torch.Tensor:  # [n] int64
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def hf_logits(hf: Any, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """HF's logits [n, V] for one sequence ids [n] at positions start.."""
    pos = torch.arange(start, start + ids.shape[0])
    return hf(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0].float()


@torch.inference_mode()
def our_logits(model: CausalLM, config: ModelConfig, seqs: list[torch.Tensor], starts: list[int] | None = None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """Our logits for sequences seqs (each [n_i]) in ONE flat forward -> [sum n_i or R, V]."""
    starts = starts or [0] * len(seqs)
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, seqs)])
    ctx = RecomputeContext([len(t) for t in seqs], pos, config.layer_windows)
    return model(ids, pos, ctx, rows)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |ours - hf| = {err:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case: str) -> None:
    hf, config, model = models(case)
    ids = tokens(N, 1)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0  # the logits are not all near zero: a real comparison
    assert_close(our_logits(model, config, [ids]), ref)


@pytest.mark.parametrize("case", ["llama", "llama_yarn", "mistral", "phi3_partial", "gemma3_linear", "gpt2"])
def test_explicit_positions_match_hf(case: str) -> None:
    """A sequence placed at positions 37.. (RoPE tables / learned positions indexed, not counted)."""
    hf, config, model = models(case)
    ids = tokens(20, 2)
    assert_close(our_logits(model, config, [ids], starts=[37]), hf_logits(hf, ids, start=37))


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_flat_batch_equals_separate_forwards(case: str) -> None:
    hf, config, model = models(case)
    a, b = tokens(13, 3), tokens(N, 4)
    both = our_logits(model, config, [a, b], starts=[0, 5])
    sep_a, sep_b = our_logits(model, config, [a]), our_logits(model, config, [b], starts=[5])
    assert both.shape == (13 + N, VOCAB)
    assert_close(both[:13], sep_a)
    assert_close(both[13:], sep_b)
    assert_close(both[:13], hf_logits(hf, a))
    assert_close(both[13:], hf_logits(hf, b, start=5))


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_logits_rows_select_rows(case: str) -> None:
    _, config, model = models(case)
    a, b = tokens(9, 5), tokens(14, 6)
    full = our_logits(model, config, [a, b])
    rows = torch.tensor([8, 22, 0])  # the last token of each sequence, then another
    picked = our_logits(model, config, [a, b], rows=rows)
    assert picked.shape == (3, VOCAB)
    assert_close(picked, full[rows])


def test_setup_is_sensitive() -> None:
    """The tolerance is far below what a plausible bug costs: windows, RoPE bases, scaling."""

    def err(case: str, config: ModelConfig) -> float:
        hf, _, model = models(case)
        ids = tokens(N, 1)
        out = our_logits(model, config, [ids])
        return (out - hf_logits(hf, ids)).abs().max().item()

    def altered(case: str, **changes: Any) -> ModelConfig:
        from dataclasses import replace

        return replace(models(case)[1], **changes)

    # attention without the sliding window (the context reads config.layer_windows)
    for case in ("mistral", "gemma3", "qwen2_swa"):
        assert err(case, altered(case, layer_windows=(None,) * 3)) > 100 * ATOL, case
    # the window one token off
    assert err("mistral", altered("mistral", layer_windows=(9, 9, 9))) > 100 * ATOL
    # RoPE: a model rebuilt with another base or without its scaling is visibly wrong
    wrongs = [("llama_llama3", dict(rope_scaling=None)), ("llama_llama3", dict(rope_theta=10000.0)),
              ("llama_linear", dict(rope_scaling=None)), ("llama_yarn", dict(rope_scaling=None)),
              ("phi3_partial", dict(partial_rotary_factor=1.0)),
              ("gemma3_linear", dict(rope_local_theta=1e6)), ("gemma3_linear", dict(rope_scaling=None))]
    for case, changes in wrongs:
        wrong = altered(case, **changes)
        hf = models(case)[0]
        ids = tokens(N, 1)
        out = our_logits(build_model(wrong, hf.state_dict()), wrong, [ids])
        assert (out - hf_logits(hf, ids)).abs().max() > 100 * ATOL, (case, changes)


def test_config_parsing() -> None:
    mistral, qwen2_swa, gemma = models("mistral")[1], models("qwen2_swa")[1], models("gemma3_linear")[1]
    assert mistral.layer_windows == (8, 8, 8)
    assert qwen2_swa.layer_windows == (None, 8, 8)
    assert gemma.layer_windows == (8, None, 8)
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4)
    assert gemma.rope_scaling is not None and gemma.rope_scaling["factor"] == 8.0
    assert gemma.scale == 16**-0.5 and models("gemma3")[1].scale == 24**-0.5
    assert models("phi3_partial")[1].partial_rotary_factor == 0.5
    assert models("llama_llama3")[1].rope_scaling["rope_type"] == "llama3"  # type: ignore[index]
    # a transformers-4 style Gemma 3 dict (as GGUF conversion writes) parses to the same config
    raw = models("gemma3_linear")[0].config.to_dict()
    raw.pop("rope_parameters")
    raw.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    v4 = ModelConfig.from_hf(raw)
    assert (v4.rope_theta, v4.rope_local_theta, v4.layer_windows) == (1e6, 1e4, (8, None, 8))
    assert v4.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_models_are_frozen_fp32() -> None:
    for case in FAMILY_CASES:
        model = models(case)[2]
        assert not model.training
        assert all(p.dtype == torch.float32 and not p.requires_grad for p in model.parameters())


def test_unsupported() -> None:
    with pytest.raises(UnsupportedArchitecture):
        ModelConfig.from_hf({"model_type": "mamba", "vocab_size": 10})
    _, config, _ = models("llama")
    from dataclasses import replace

    with pytest.raises(UnsupportedArchitecture):
        build_model(replace(config, model_type="falcon"), {})
    hf = models("llama")[0]
    with pytest.raises(UnsupportedArchitecture, match="rope scaling"):
        build_model(replace(config, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), hf.state_dict())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_packed_linear(k: int) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(11, 7, generator=g), torch.randn(11, generator=g)  # nn.Linear [out, in], odd out
    wp = pack(w, k)
    assert wp.shape == (k, 7, -(-11 // k))
    for n in (1, 5):
        x = torch.randn(n, 7, generator=g)
        ref = torch.nn.functional.linear(x, w, b)
        out = linear(x, wp, pack_bias(b, wp))[:, :11]
        assert torch.allclose(out, ref, atol=1e-5)
        assert torch.allclose(linear(x, wp)[:, :11], x @ w.t(), atol=1e-5)
    ids = torch.tensor([10, 0, 3, 10])
    assert torch.equal(packed_rows(wp, ids), w[ids])


@pytest.mark.parametrize("out,inn,k", [(11, 7, 3), (1, 5, 4), (257, 9, 2), (1000, 3, 3), (300, 130, 1), (2049, 16, 8)])
def test_pack_lays_out_each_part_as_its_rows_transposed(out, inn, k):
    """pack copies blocks of rows: across block and part edges, part j holds rows j * part .. as
    columns, the columns past the last row zeros, in memory of its own."""
    w = torch.randn(out, inn, dtype=torch.float64).to(torch.float16 if out == 257 else torch.float32)
    part = -(-out // k)
    ref = torch.zeros(k * part, inn)
    ref[:out] = w.float()
    got = pack(w, k)
    assert got.shape == (k, inn, part) and got.dtype == torch.float32 and got.is_contiguous()
    assert not got.requires_grad and got.data_ptr() != w.data_ptr()
    assert torch.equal(got, ref.view(k, part, inn).transpose(1, 2))


@pytest.mark.parametrize("style", ["model.language_model.", "language_model.model."])
def test_multimodal_checkpoint_names(style: str) -> None:
    """A Gemma 3 image-text checkpoint's text weights (transformers 5 / 4 naming) load as the text model."""
    hf, config, model = models("gemma3")
    sd = {}
    for name, t in hf.state_dict().items():
        if name.startswith("model."):
            name = style + name[len("model."):]
        elif style.startswith("language_model."):  # transformers 4 kept lm_head in the text model
            name = "language_model." + name
        sd[name] = t
    sd["vision_tower.some.weight"] = torch.zeros(3)
    ids = tokens(N, 7)
    assert_close(our_logits(build_model(config, sd), config, [ids]), our_logits(model, config, [ids]))
