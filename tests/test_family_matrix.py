"""The family matrix: each family x feature as users' files are made.

A tiny random HF model per row (tests/convert_matrix.py) is saved by transformers and converted by
llama.cpp's own convert_hf_to_gguf.py to F32 and Q8_0. Then, at positions past 1,000 (so that a
wrong rotary frequency shows):

  kvcache on the F32 GGUF == kvcache on the HF folder == transformers   (fp32, atol 1e-4)
  kvcache on the Q8_0 GGUF, its own int8 kernels == transformers on the same Q8_0 weights (dequantized)
                                                   within the int8 activations' error

Conversions run once per test session, in one child process. Without the unpacked converter
(`make llama-src`) the module is skipped with that reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType

from conftest import fresh_home
from convert_matrix import BPE_ROWS, ROWS, convert_all, converter, make_model
from kvcache.attention.recompute import RecomputeContext
from kvcache.models.config import ModelConfig
from kvcache.models.loading import load_weights, model_weights, read_config, resolve_model
from kvcache.models.registry import build_model

pytestmark = pytest.mark.skipif(converter() is None, reason="llama.cpp's converter is not unpacked: run `make llama-src`")
START, N = 1200, 24  # positions START .. START + N - 1
ATOL = 1e-4


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, monkeypatch_module):
    """row -> (HF model, folder, F32 GGUF, Q8_0 GGUF), converted once."""
    bpe = resolve_model(None).path  # the bundled SmolLM2's byte-level BPE tokenizer, converted once for every test
    monkeypatch_module.setenv("KVCACHE_HOME", str(fresh_home(tmp_path_factory.mktemp("home"))))
    root = tmp_path_factory.mktemp("matrix")
    made, jobs = {}, []
    for row in ROWS:
        folder = root / row
        hf = make_model(row, folder, bpe)
        f32, q8 = root / f"{row}-f32.gguf", root / f"{row}-q8_0.gguf"
        jobs += [(folder, "f32", f32), (folder, "q8_0", q8)]
        made[row] = (hf, folder, f32, q8)
    convert_all(jobs)
    return made


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def ids_for(hf) -> torch.Tensor:  # [N] int64
    top = min(int(hf.config.vocab_size), 300)
    return torch.randint(3, top, (N,), generator=torch.Generator().manual_seed(7))


@torch.inference_mode()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:  # [N, V]
    pos = torch.arange(START, START + N)[None]
    return hf(input_ids=ids[None], position_ids=pos, use_cache=False).logits[0].float()


@torch.inference_mode()
def ours(spec: Path, weights: str, ids: torch.Tensor) -> torch.Tensor:  # [N, V]
    resolved = resolve_model(spec)
    config = ModelConfig.from_hf(read_config(resolved.path))
    sd = model_weights(resolved, weights) if resolved.gguf is not None else load_weights(resolved.path)[1]
    model = build_model(config, sd, weights)
    pos = torch.arange(START, START + N)
    return model(ids, pos, RecomputeContext([N], pos, config.layer_windows, config.attn_softcap))


def fused_experts(sd: dict, gpt_oss: bool = False) -> dict:
    """Per-expert weights (as files and kvcache name them) as transformers holds them in memory:
    experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]; RoPE factor tensors left out.
    gpt-oss: gate_up_proj [E, H, 2I] with gate and up interleaved, down_proj [E, I, H], their biases
    beside them, the sinks under transformers' name."""
    out, experts = {}, {}
    for k, v in sd.items():
        if ".mlp.experts." in k:
            layer, rest = k.split(".mlp.experts.")
            e, proj, kind = rest.split(".")[:3]
            experts.setdefault(layer, {}).setdefault(proj + ("_bias" if kind == "bias" else ""), {})[int(e)] = v
        elif k.endswith(".sinks.weight"):
            out[k[: -len(".weight")]] = v
        elif not k.startswith("model.rope_"):
            out[k] = v
    for layer, p in experts.items():
        n = len(p["gate_proj"])
        if gpt_oss:
            gu = torch.stack([torch.stack((p["gate_proj"][e].t(), p["up_proj"][e].t()), -1).flatten(1) for e in range(n)])
            gub = torch.stack([torch.stack((p["gate_proj_bias"][e], p["up_proj_bias"][e]), -1).flatten() for e in range(n)])
            out[f"{layer}.mlp.experts.gate_up_proj"], out[f"{layer}.mlp.experts.gate_up_proj_bias"] = gu, gub
            out[f"{layer}.mlp.experts.down_proj"] = torch.stack([p["down_proj"][e].t() for e in range(n)])
            out[f"{layer}.mlp.experts.down_proj_bias"] = torch.stack([p["down_proj_bias"][e] for e in range(n)])
            continue
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((p["gate_proj"][e], p["up_proj"][e])) for e in range(n)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([p["down_proj"][e] for e in range(n)])
    return out


MOE_ROWS = ("qwen3moe", "mixtral", "olmoe", "gpt_oss")


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("row", ROWS)
def test_f32_gguf_equals_folder_equals_transformers(matrix, row):
    hf, folder, f32, _ = matrix[row]
    ids = ids_for(hf)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0  # logits far from zero: a real comparison
    from_folder = ours(folder, "fp32", ids)
    from_gguf = ours(f32, "fp32", ids)
    assert gap(from_folder, ref) < ATOL, f"{row}: folder vs transformers {gap(from_folder, ref):.3g}"
    assert gap(from_gguf, ref) < ATOL, f"{row}: GGUF vs transformers {gap(from_gguf, ref):.3g}"


@pytest.mark.parametrize("row", ROWS)
def test_q8_gguf_with_its_int8_kernels_tracks_transformers_on_the_same_weights(matrix, row):
    hf, _, _, q8 = matrix[row]
    ids = ids_for(hf)
    sd = model_weights(resolve_model(q8), "fp32")  # the Q8_0 file's weights, dequantized, HF names
    hf_q8 = type(hf)(hf.config).float().eval()
    missing, _ = hf_q8.load_state_dict(fused_experts(sd, row == "gpt_oss"), strict=False)
    assert not [m for m in missing if "rotary" not in m and m != "lm_head.weight"], missing
    if "lm_head.weight" in missing:
        hf_q8.tie_weights()
    ref = hf_logits(hf_q8, ids)
    assert gap(ref, hf_logits(hf, ids)) > 1e-3  # the Q8_0 weights really differ from the originals
    assert gap(ours(q8, "fp32", ids), ref) < ATOL  # the file's weights, dequantized: transformers' logits
    got = ours(q8, "file", ids)
    scale = ref.abs().max().item()
    # int8 activations on a tiny random model: 2-6% of the largest logit at most, 1-3% on average.
    # In a mixture a row whose top-k experts sit on a near tie may be routed to another expert by
    # the activations' rounding (as in llama.cpp, whose activations are rounded too): one such row
    # of the 24 is allowed past the bound
    errs = sorted((got - ref).abs().max(-1).values.tolist())
    beyond = 1 if row in MOE_ROWS else 0
    assert errs[-1 - beyond] < 0.08 * scale, f"{row}: {errs[-1 - beyond]:.3g}"
    # the smollm3 row has twice the others' two layers (its NoPE layer is the fourth), so its
    # activations are rounded twice as often: 3.0-4.4% of the mean logit over three seeds
    mean_bound = 0.05 if row == "smollm3" else 0.04
    assert (got - ref).abs().mean() < mean_bound * ref.abs().mean()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_the_matrix_covers_each_feature(matrix):
    """The rows carry what they are meant to: the converter wrote llama3 scaling as rope_freqs,
    longrope as factor tensors, yarn and linear as keys, Qwen2's biases, Gemma 3's window; a smollm3
    file's every fourth layer is a NoPE one (llama.cpp's rule: no key says so)."""
    from kvcache.models.gguf_convert import check_file, read_gguf

    def has(row: str, what: str) -> bool:
        rep = check_file(matrix[row][2])
        assert rep.ok, rep.refused
        return any(what in h for h in rep.honoured)

    assert has("llama3", "rope_freqs") and not has("llama", "rope_freqs")
    assert has("phi3_longrope", "rope_factors_long") and has("llama_yarn", "rope.scaling.type")
    assert has("llama_linear", "rope.scaling.factor") and has("qwen2", "attn_q.bias")
    assert has("gemma3", "sliding_window") and has("qwen3", "attn_q_norm") and has("llama_gqa8", "attn_q.bias")
    assert has("qwen3moe", "ffn_gate_exps") and has("qwen3moe", "expert_used_count")
    assert has("mixtral", "ffn_gate_exps") and has("mixtral", "llama.expert_count") and not has("mixtral", "q_norm")
    assert has("smollm3", "smollm3.rope.freq_base") and read_gguf(matrix["smollm3"][2])[2]["no_rope_layers"] == [1, 1, 1, 0]
    assert "every fourth layer without RoPE" in check_file(matrix["smollm3"][2]).lines("f")[0]
    assert has("olmoe", "ffn_gate_exps") and has("olmoe", "attn_q_norm") and has("gemma2", "attn_logit_softcapping")
    assert has("gpt_oss", "attn_sinks") and has("gpt_oss", "ffn_gate_exps.bias") and has("gpt_oss", "sliding_window")
    assert read_gguf(matrix["gpt_oss"][2])[2]["layer_types"] == ["sliding_attention", "full_attention"]
    assert "learned sink logit" in check_file(matrix["gpt_oss"][2]).lines("f")[0]
    assert BPE_ROWS <= set(ROWS)


# hostile or damaged files: each refused at load with one line naming the key or tensor
REFUSALS = [
    ("qwen2", dict(drop=("blk.0.attn_q.bias",)), "tensor blk.0.attn_q.bias is missing"),
    ("qwen2", dict(add={"qwen2.logit_scale": 2.0}), "key qwen2.logit_scale is not honoured"),
    ("llama", dict(add={"llama.attention.head_count": [4, 8]}), "key llama.attention.head_count gives per-layer values"),
    ("llama", dict(add={"llama.expert_count": 8, "llama.expert_used_count": 2}),
     "key llama.expert_count is 8 but the file has no expert tensors"),
    ("mixtral", dict(drop=("llama.expert_used_count",)), "key llama.expert_count is 8 but llama.expert_used_count"),
    ("llama", dict(add={"llama.rope.scaling.type": "su-weird"}), "key llama.rope.scaling.type is 'su-weird'"),
    ("qwen3", dict(add_tensors={"blk.1.ffn_gate_inp.weight": "zeros"}), "tensor blk.1.ffn_gate_inp.weight is not honoured"),
    ("qwen3", dict(drop=("tokenizer.ggml.eos_token_id",), add={"tokenizer.ggml.eos_token_id": 99999}),
     "key tokenizer.ggml.eos_token_id is 99999, not a token id"),
    ("llama3", dict(drop=("llama.block_count",), add={"llama.block_count": (4_000_000_000, GGUFValueType.UINT32)}),
     "key llama.block_count is 4000000000 but the file has tensors for 2 layers"),
    ("gemma2", dict(drop=("gemma2.attn_logit_softcapping",), add={"gemma2.attn_logit_softcapping": 0.0}),
     "key gemma2.attn_logit_softcapping is 0.0: a gemma2 soft cap must be positive"),
    ("gemma3", dict(add={"gemma3.attn_logit_softcapping": 50.0}),
     "key gemma3.attn_logit_softcapping is set: llama.cpp's gemma3 never caps attention logits"),
]


@pytest.mark.parametrize("row,change,message", REFUSALS, ids=[m.split(" is")[0] for _, _, m in REFUSALS])
def test_a_file_with_what_kvcache_does_not_honour_is_refused_naming_it(matrix, tmp_path, row, change, message):
    import numpy as np

    from convert_matrix import rewrite_gguf
    from kvcache import LLM
    from kvcache.errors import ModelLoadError

    tensors = {k: np.zeros((4, 64), np.float32) for k in change.get("add_tensors", {})}
    bad = rewrite_gguf(matrix[row][2], tmp_path / "bad.gguf", **{**change, "add_tensors": tensors})
    with pytest.raises(ModelLoadError) as e:
        LLM(str(bad), prefix=False)
    text = str(e.value)
    assert message in text and "bad.gguf" in text and "\n" not in text, text
    assert not list((Path(resolve_home()) / "models").glob(".converting-*"))  # nothing half-written left


def resolve_home() -> str:
    from kvcache.paths import cache_home

    return str(cache_home())


def test_an_unchanged_copy_loads(matrix, tmp_path):
    """The rewriting itself keeps a file whole: the same weights, the same logits."""
    from convert_matrix import rewrite_gguf

    hf, _, f32, _ = matrix["qwen2"]
    copy = rewrite_gguf(f32, tmp_path / "copy.gguf")
    ids = ids_for(hf)
    assert gap(ours(copy, "fp32", ids), ours(f32, "fp32", ids)) == 0.0


def test_models_check_reports_what_is_honoured_and_why_a_file_is_refused(matrix, tmp_path):
    from conftest import run_kvcache
    from convert_matrix import rewrite_gguf

    good = run_kvcache("models", "--check", str(matrix["llama3"][2]))
    assert good.returncode == 0, good.stderr
    assert "rope_freqs.weight" in good.stdout and "kvcache runs this file" in good.stdout
    assert "tensor types (1), as the default weights mode holds them: F32 x" in good.stdout
    bad = rewrite_gguf(matrix["qwen2"][2], tmp_path / "bad.gguf", drop=("blk.1.attn_v.bias",),
                       add={"qwen2.embedding_scale": 3.0})
    out = run_kvcache("models", "--check", str(bad))
    assert out.returncode == 2
    assert "tensor blk.1.attn_v.bias is missing" in out.stdout and "key qwen2.embedding_scale" in out.stdout


def llama_cpp_bin() -> Path | None:
    import os

    from convert_matrix import ROOT

    for d in (os.environ.get("KVCACHE_LLAMA_CPP_BIN"), ROOT / ".venv" / "llama.cpp" / "bin"):
        if d and (Path(d) / "llama-perplexity").is_file():
            return Path(d)
    return None


# llama.cpp cannot read the tiny SentencePiece vocabulary as a phi3 one (it looks up Phi-3's own
# special tokens), so the phi3 rows have no peer here
PPL_ROWS = [r for r in ROWS if not r.startswith("phi3")]


@pytest.mark.slow
@pytest.mark.skipif(llama_cpp_bin() is None, reason="llama-perplexity is not built (make llamacpp, then "
                    "cmake --build .venv/llama.cpp/build --target llama-perplexity)")
@pytest.mark.parametrize("row", PPL_ROWS)
def test_q8_perplexity_beside_llama_cpp_on_the_same_file(matrix, row):
    """The Q8_0 file through kvcache's own tokenizer and int8 kernels against llama-perplexity on the
    same file and text (llama.cpp's chunks: 4 x 128 tokens, the second half of each scored)."""
    import inspect
    import textwrap

    from kvcache import LLM
    from kvcache.peers.llama_cpp import llama_perplexity
    from kvcache.eval.weights import chunks, perplexity

    q8 = str(matrix[row][3])
    text = inspect.getsource(textwrap)  # a text no row was trained or tuned on
    llm = LLM(q8, prefix=False)
    probe = llm.tokenizer.encode("a")
    bos = llm.tokenizer.bos_token_id if probe and probe[0] == llm.tokenizer.bos_token_id else None
    parts = chunks(llm.encode(text), 128, 4, bos)
    ours_ppl = perplexity(llm, parts)
    peer, note = llama_perplexity(str(llama_cpp_bin()), q8, text, 128, len(parts), 2)
    assert peer is not None, note
    # a tiny random router sits near ties often, and each side's activation rounding routes a few
    # tokens elsewhere: on the mixtral row the exact computation (fp32 weights) is itself 1.8% from
    # llama.cpp, kvcache's int8 path 0.5%; the mixtures get 1%, the dense rows 0.5%
    bound = 0.01 if row in MOE_ROWS else 0.005
    print(f"{row}: kvcache {ours_ppl:.4f}, llama.cpp {peer:.4f}")
    assert abs(ours_ppl / peer - 1) < bound, f"{row}: kvcache {ours_ppl:.4f}, llama.cpp {peer:.4f}"


def test_older_converters_keys_are_honoured_or_known_to_change_nothing(matrix, tmp_path):
    """expert_count 0 (no experts), tensor_data_layout (a note), rope.scale_linear (linear scaling's
    older key, read as llama.cpp reads it)."""
    from convert_matrix import rewrite_gguf
    from kvcache.models.gguf_convert import check_file, read_gguf

    old = rewrite_gguf(matrix["llama"][2], tmp_path / "old.gguf",
                       add={"llama.expert_count": 0, "llama.tensor_data_layout": "Meta AI original pth",
                            "llama.rope.scale_linear": 4.0})
    rep = check_file(old)
    assert rep.ok, rep.refused
    assert {"llama.expert_count", "llama.tensor_data_layout"} <= set(rep.no_effect)
    assert read_gguf(old)[2]["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_a_gemma2_file_without_its_soft_caps_reads_llama_cpps_defaults(matrix, tmp_path):
    """llama.cpp's gemma2 caps attention at 50 and the output at 30 where the file names no cap;
    a gemma3 file's final cap is only the one it gives."""
    from convert_matrix import rewrite_gguf
    from kvcache.models.gguf_convert import read_gguf

    bare = rewrite_gguf(matrix["gemma2"][2], tmp_path / "bare.gguf",
                        drop=("gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping"))
    config = read_gguf(bare)[2]
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert (read_gguf(matrix["gemma2"][2])[2]["attn_logit_softcapping"], ModelConfig.from_hf(
        read_gguf(matrix["gemma2"][2])[2]).attn_softcap) == (5.0, 5.0)
    assert "attn_logit_softcapping" not in read_gguf(matrix["gemma3"][2])[2]


@pytest.mark.parametrize("row", ["llama", "phi3", "gemma3", "gpt2"])  # each builder once
def test_a_converted_tokenizer_is_the_one_autotokenizer_makes_of_the_file(matrix, tmp_path, row):
    """The conversion builds the tokenizer from transformers' GGUF reader and converter directly
    (models/gguf_tokenizer.py); AutoTokenizer's own load of the file gives the same tokenizer.json,
    for sentencepiece (Llama's, Phi-3's, Gemma's builders) and byte-level BPE alike."""
    import json

    from transformers import AutoTokenizer

    from conftest import gguf_parsed_fast
    from kvcache.models.gguf_convert import metadata, open_gguf
    from kvcache.models.gguf_tokenizer import write_tokenizer

    gguf = matrix[row][2]
    write_tokenizer(gguf, metadata(open_gguf(gguf)), tmp_path)
    with gguf_parsed_fast():
        theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).backend_tokenizer.to_str()
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads(theirs)


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_the_bundled_files_are_honoured_whole(name):
    """Files someone else made (SmolLM2's Q4_1, Gemma 3 270M's Q4_K_M): every key and tensor honoured or
    on the no-effect list."""
    from kvcache.models.bundled import bundled_path, is_installed
    from kvcache.models.gguf_convert import check_file

    if not is_installed(name):
        pytest.skip(f"{name} is not installed")
    rep = check_file(bundled_path(name))
    assert rep.ok, rep.refused
    assert "tensor token_embd.weight" in rep.honoured and rep.no_effect


def test_a_mixture_missing_its_qk_norm_is_refused_and_mixtral_needs_none(matrix):
    """Qwen3-MoE's q/k norms are required (a folder without one is refused naming it); Mixtral's
    attention has none, so its folder loads without them."""
    from kvcache.errors import ModelLoadError

    for row in ("qwen3moe", "mixtral"):
        folder = matrix[row][1]
        config = ModelConfig.from_hf(read_config(folder))
        sd = dict(load_weights(folder)[1])
        assert any("q_norm" in k for k in sd) == (row == "qwen3moe")
        if row == "qwen3moe":
            sd.pop("model.layers.1.self_attn.q_norm.weight")
            with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.q_norm.weight"):
                build_model(config, sd, "fp32")
        else:
            assert all(ly.qk_norm is None for ly in build_model(config, sd, "fp32").layers)


def _steps(llm, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The logits after ``prompt`` and after each of ``steps`` greedy tokens, through the engine."""
    r = llm.runner
    seq = r.new_sequence()
    got = [r.step([seq], [prompt])[0]]
    for _ in range(steps):
        got.append(r.step([seq], [[int(got[-1].argmax())]])[0])
    r.free(seq)
    return got


def _beside_transformers(llm, hf, n: int, seed: int, tol=None) -> list[torch.Tensor]:
    """A random prompt of ``n`` tokens and 4 greedy steps through ``llm``'s engine, each logits row
    within ``tol`` (default ATOL; a callable of the reference: its bound) of transformers' forward
    over the same tokens; returns the engine's rows."""
    prompt = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    got = _steps(llm, prompt, 4)
    ids = prompt + [int(g.argmax()) for g in got[:-1]]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    bound = ATOL if tol is None else tol(ref)
    for i, g in enumerate(got):
        assert gap(g, ref[n - 1 + i]) < bound, i
    return got


def test_nope_layers_run_through_the_engine_as_transformers_runs_them(matrix):
    """SmolLM3's NoPE layer (the fourth of four): through the paged cache the F32 file gives
    transformers' logits for a 1,100-token prompt and each greedy step after it; the Q8_0 file's
    one native call a forward (the NoPE layer on the identity rotary table) gives the bits of the
    layer-by-layer path."""
    from kvcache import LLM
    from kvcache.kernels.qweight import LayerStack

    hf, _, f32, q8 = matrix["smollm3"]
    llm = LLM(str(f32), weights="fp32", prefix=False)
    assert [llm.model.rotary_for_layer(i) is None for i in range(4)] == [False, False, False, True]
    _beside_transformers(llm, hf, 1100, 3)
    prompt = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    quant = LLM(str(q8), prefix=False)
    stack = quant.model.stack
    assert isinstance(stack, LayerStack) and stack.table[:, -4].tolist() == [0, 0, 0, 1]  # KVL_ROPE
    fused = _steps(quant, prompt, 4)
    quant.model.stack = None
    try:
        plain = _steps(quant, prompt, 4)
    finally:
        quant.model.stack = stack
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


@pytest.mark.parametrize("kv", ["dynamic", "static,max_tokens=512", "fp16", "int8,residual=0,group_size=16"])
def test_soft_capped_attention_runs_through_the_engine_as_transformers_runs_it(matrix, kv):
    """Gemma 2's soft-capped attention logits (no native kernel takes them: every read goes to dense
    attention, capped): through the paged cache, past the sliding layers' 32-token window, the F32
    file gives transformers' logits for the prompt and each greedy step (fp16 and int8 pages: within
    their rounding); a second run over the cached prefix gives the same; a press, which scores attention
    without the cap, is refused in one line."""
    from kvcache import LLM
    from kvcache.errors import InvalidParams

    hf, _, f32, _ = matrix["gemma2"]
    assert hf.config.attn_logit_softcapping and hf.config.final_logit_softcapping
    llm = LLM(str(f32), weights="fp32", kv=kv)
    assert llm.model.stack is None and llm.config.attn_softcap == hf.config.attn_logit_softcapping
    tol = {"fp16": lambda ref: 2e-3, "int8,residual=0,group_size=16": lambda ref: 0.02 * ref.abs().max().item()}
    got = _beside_transformers(llm, hf, 100, 5, tol.get(kv))
    prompt = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    again = _steps(llm, prompt, 4)  # the same prompt, its pages from the prefix cache
    assert all(gap(a, b) < (2e-3 if kv in tol else ATOL) for a, b in zip(again, got))
    with pytest.raises(InvalidParams, match="press=snapkv scores attention without the soft cap") as e:
        LLM(str(f32), weights="fp32", kv="press=snapkv,ratio=0.5")
    assert "\n" not in str(e.value)


def test_olmoes_whole_width_qk_norms_run_through_the_engine_as_transformers_runs_them(matrix):
    """OLMoE: q and k each RMS-normalized over all of their heads (not per head, as Qwen3-MoE), then
    RoPE and the native attention; the top-k weights not renormalised. Through the paged cache the
    F32 file gives transformers' logits for a 1,100-token prompt and greedy steps; the Q8_0 file's
    experts in their own type give, through the cache, the bits of a recompute."""
    from kvcache import LLM

    hf, _, f32, q8 = matrix["olmoe"]
    assert not hf.config.norm_topk_prob and hf.model.layers[0].self_attn.q_norm.weight.shape == (64,)
    llm = LLM(str(f32), weights="fp32", prefix=False)
    assert llm.model.stack is None and all(ly.full_qk is not None and ly.qk_norm is None for ly in llm.model.layers)
    _beside_transformers(llm, hf, 1100, 4)
    prompt = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    quant = LLM(str(q8), prefix=False)
    cached = _steps(quant, prompt, 0)[0]
    config = quant.config
    with torch.inference_mode():
        recomputed = quant.model(torch.tensor(prompt), torch.arange(64),
                                 RecomputeContext([64], torch.arange(64), config.layer_windows), torch.tensor([63]))[0]
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("kv", ["dynamic", "static,max_tokens=512", "fp16", "int8,residual=0,group_size=16"])
def test_learned_sinks_run_through_the_engine_as_transformers_runs_them(matrix, kv, monkeypatch):
    """gpt-oss's learned sink logits (over fp32 pages the fused native attention takes them; fp16
    and int8 pages go to dense attention with them): through the paged cache, past the first
    layer's 32-token window, the F32 file gives transformers' logits for the prompt and each greedy
    step (fp16 and int8 pages: within their rounding), and again over the cached prefix; a press,
    which scores attention without the sinks, is refused in one line."""
    from kvcache import LLM, kernels
    from kvcache.errors import InvalidParams

    fused = []
    native = kernels.decode_attend

    def counted(*args, **kwargs):
        out = native(*args, **kwargs)
        fused.append(out is not None and (len(args) > 12 and args[12] is not None))
        return out

    monkeypatch.setattr(kernels, "decode_attend", counted)
    hf, _, f32, _ = matrix["gpt_oss"]
    llm = LLM(str(f32), weights="fp32", kv=kv)
    assert llm.config.attn_sink_logits and llm.config.layer_windows == (32, None)
    assert all(ly.sinks.abs().max() > 0.05 for ly in llm.model.layers)  # sinks far from zero: they matter
    # fp16 pages: K and V rounded to 11 bits, up to 0.1% of the largest logit here (bf16's 8 bits: 0.6%)
    tol = {"fp16": lambda ref: 2e-3 * ref.abs().max().item(),
           "int8,residual=0,group_size=16": lambda ref: 0.02 * ref.abs().max().item()}
    got = _beside_transformers(llm, hf, 100, 6, tol.get(kv))
    prompt = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    again = _steps(llm, prompt, 4)  # the same prompt, its pages from the prefix cache
    assert all(gap(a, b) < (2e-3 if kv in tol else ATOL) for a, b in zip(again, got))
    if kv == "dynamic":  # over fp32 pages the cache gives a recompute's bits, the sinks' included
        with torch.inference_mode():
            recomputed = llm.model(torch.tensor(prompt), torch.arange(100),
                                   RecomputeContext([100], torch.arange(100), llm.config.layer_windows),
                                   torch.tensor([99]))[0]
        assert torch.equal(got[0], recomputed)
    # fp32 pages: every layer of every step through the fused kernel with the sinks; others: none
    assert (len(fused) >= 2 * 5 * 2 and all(fused)) if kv in ("dynamic", "static,max_tokens=512") else not fused
    with pytest.raises(InvalidParams, match="press=snapkv scores attention without the learned sink logits") as e:
        LLM(str(f32), weights="fp32", kv="press=snapkv,ratio=0.5")
    assert "\n" not in str(e.value)


def test_gpt_oss_folder_and_quantized_file_beside_their_oracles(matrix, tmp_path):
    """The released gpt-oss configs turn RoPE by yarn without truncating its correction range: a
    folder saying so gives transformers' logits (the GGUF cannot say it, and llama.cpp truncates).
    Without the sinks the logits move: they are really applied. The Q8_0 file's experts, in the
    file's type, give through the cache the bits of a recompute (windows with kept sink tokens:
    test_cache_visibility)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from kvcache import LLM
    from kvcache.kernels.qweight import ACT_SWIGLU_OAI, expert_mlp
    from kvcache.models.layers import linear

    hf, folder, _, q8 = matrix["gpt_oss"]
    plain = tmp_path / "untruncated"
    shutil.copytree(folder, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"]["truncate"] = False
    (plain / "config.json").write_text(json.dumps(cfg))
    hf2 = AutoModelForCausalLM.from_pretrained(plain, attn_implementation="eager").float().eval()
    ids = ids_for(hf2)
    ref = hf_logits(hf2, ids)
    assert gap(ref, hf_logits(hf, ids)) > 1e-3  # the truncation matters at these positions
    assert gap(ours(plain, "fp32", ids), ref) < ATOL
    config = ModelConfig.from_hf(read_config(plain))
    model = build_model(config, load_weights(plain)[1], "fp32")
    for ly in model.layers:
        ly.sinks.data.fill_(-1e4)  # a sink no row weighs: plain softmax
    pos = torch.arange(START, START + N)
    with torch.inference_mode():
        unsunk = model(ids, pos, RecomputeContext([N], pos, config.layer_windows))
    assert gap(unsunk, ref) > 1e-2
    prompt = torch.randint(3, 300, (80,), generator=torch.Generator().manual_seed(8)).tolist()
    quant = LLM(str(q8), prefix=False)
    expert = quant.model.layers[0].experts[3]  # the native clamped SwiGLU against torch's, on the same products
    for scale in (3.0, 40.0):  # gates and ups inside the clamp, and far past it
        h = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)) * scale
        native, plain = expert(h), expert.torch_forward(h)
        assert torch.equal(native, expert_mlp(h, expert.gate_up, expert.down, ACT_SWIGLU_OAI, expert.gate_up_b,
                                              expert.down_b))  # the native call, not torch's fallback
        assert gap(native, plain) < 1e-3 * plain.abs().max()
        assert torch.equal(expert(h[2:3]), native[2:3])  # a row's bits alone or among others
    gu = linear(h, expert.gate_up, expert.gate_up_b)
    assert gu[:, :96].max() > 7 and gu[:, 96:].min() < -7  # the clamps were reached
    cached = _steps(quant, prompt, 0)[0]
    with torch.inference_mode():
        recomputed = quant.model(torch.tensor(prompt), torch.arange(80),
                                 RecomputeContext([80], torch.arange(80), quant.config.layer_windows),
                                 torch.tensor([79]))[0]
    assert torch.equal(cached, recomputed)
    assert all(ly.table is not None for ly in quant.model.layers)  # the layers' experts in one native call
    seq = quant.runner.new_sequence()  # the last token decoded after the others: its prefill row's bits
    quant.runner.step([seq], [prompt[:-1]])
    assert torch.equal(quant.runner.step([seq], [prompt[-1:]])[0], cached)


@pytest.fixture(scope="module")
def mxfp4(matrix, tmp_path_factory) -> Path:
    """A copy of the F32 gpt-oss file whose expert matrices are MXFP4, as llama.cpp's converter writes
    the released gpt-oss checkpoints (gguf-py's own MXFP4 quantizer)."""
    import gguf

    from convert_matrix import rewrite_gguf

    return rewrite_gguf(matrix["gpt_oss"][2], tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4.gguf",
                        retype=("_exps.weight", gguf.GGMLQuantizationType.MXFP4))


def test_mxfp4_experts_are_held_in_their_own_codes(matrix, mxfp4):
    """MXFP4 (the released gpt-oss files' expert type: 4-bit codes of 0..6 on a power-of-two scale
    per 32) is held as its codes with an fp16 scale (2^(e-128): each code stands for an integer of
    -12..12), the same weights bit for bit in 4.5 bits a weight; the file's experts stay quantized
    and run through the int8 products, within their rounding of the same weights dequantized by
    gguf-py."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from kvcache.kernels.qweight import QWeight

    from kvcache.models.gguf_convert import check_file

    from kvcache.models.gguf_reader import gguf_reader

    reader = gguf_reader(mxfp4)
    exps = [t for t in reader.tensors if t.name.endswith("_exps.weight")]
    assert exps and all(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in exps)
    held = check_file(mxfp4).types  # `kvcache models --check` says how the file's MXFP4 is held
    assert f"MXFP4 x{len(exps)} (kept in the file's type: its codes" in "; ".join(held), held
    sd = model_weights(resolve_model(mxfp4), "file")
    for t in exps:
        ref = dequantize(t.data, t.tensor_type)  # [E, rows, K]
        layer, kind = t.name.split(".")[1], t.name.split(".")[2].split("_")[1]
        for e in range(ref.shape[0]):
            got = sd[f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"].dequantize().numpy()
            assert np.array_equal(got, ref[e]), (t.name, e)
    hf = matrix["gpt_oss"][0]
    ids = ids_for(hf)
    exact = ours(mxfp4, "fp32", ids)  # the file's weights dequantized, in fp32
    config = ModelConfig.from_hf(read_config(resolve_model(mxfp4).path))
    model = build_model(config, sd, "file")
    assert all(isinstance(ex.gate_up, QWeight) and ex.gate_up.format_name == "mx4_f16"
               and ex.gate_up.nbytes == 0.5625 * ex.gate_up.out * ex.gate_up.k  # rows a multiple of 16 here
               for ly in model.layers for ex in ly.experts)
    pos = torch.arange(START, START + N)
    with torch.inference_mode():
        got = model(ids, pos, RecomputeContext([N], pos, config.layer_windows))
    assert gap(exact, hf_logits(hf, ids)) > 0.05  # MXFP4 really moved the weights
    errs = sorted((got - exact).abs().max(-1).values.tolist())
    assert errs[-2] < 0.08 * exact.abs().max().item()
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
@pytest.mark.skipif(llama_cpp_bin() is None, reason="llama-perplexity is not built (make llamacpp, then "
                    "cmake --build .venv/llama.cpp/build --target llama-perplexity)")
def test_mxfp4_perplexity_beside_llama_cpp_on_the_same_file(mxfp4):
    """The MXFP4 gpt-oss file through kvcache (experts in their codes, the int8 products) against
    llama-perplexity, which multiplies MXFP4 blocks itself, on the same file and text."""
    import inspect
    import textwrap

    from kvcache import LLM
    from kvcache.eval.weights import chunks, perplexity
    from kvcache.peers.llama_cpp import llama_perplexity

    text = inspect.getsource(textwrap)
    llm = LLM(str(mxfp4), prefix=False)
    probe = llm.tokenizer.encode("a")
    bos = llm.tokenizer.bos_token_id if probe and probe[0] == llm.tokenizer.bos_token_id else None
    parts = chunks(llm.encode(text), 128, 4, bos)
    ours_ppl = perplexity(llm, parts)
    peer, note = llama_perplexity(str(llama_cpp_bin()), str(mxfp4), text, 128, len(parts), 2)
    assert peer is not None, note
    print(f"gpt-oss MXFP4: kvcache {ours_ppl:.4f}, llama.cpp {peer:.4f}")
    assert abs(ours_ppl / peer - 1) < 0.01, f"kvcache {ours_ppl:.4f}, llama.cpp {peer:.4f}"

