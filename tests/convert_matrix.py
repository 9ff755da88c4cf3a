"""Tiny random HF models of every family and feature, saved by transformers and converted to GGUF by
llama.cpp's own convert_hf_to_gguf.py, as users' files are made.

The converter ships in the llama-cpp-python sdist that `make llama-src` unpacks under
.venv/llama.cpp/src; ``converter()`` finds it (or None). ``convert_all`` runs it once, in one child
process that imports it once and converts every (folder, type) pair: an import costs seconds, a
tiny conversion a fraction of one.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, INTER = 64, 96


def converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from the unpacked sdist, or None."""
    found = sorted((ROOT / ".venv" / "llama.cpp" / "src").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


def _rope(kind: str, theta: float = 10000.0) -> dict[str, Any]:
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256, "rope_theta": 500000.0}
    if kind == "linear":
        return {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "rope_theta": theta}
    return {"rope_type": "default", "rope_theta": theta}


def hf_config(row: str, vocab: int) -> Any:
    """The transformers config of one matrix row: a family and the feature it exercises."""
    import transformers as tf

    c: dict[str, Any] = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if row in ("llama", "llama3", "llama_yarn", "llama_linear"):
        return tf.LlamaConfig(**c, rope_parameters=_rope(row.replace("llama_", "") if row != "llama" else "default"),
                              tie_word_embeddings=row == "llama")
    if row == "llama_gqa8":  # 8 query heads sharing one KV head, head_dim != hidden / heads
        return tf.LlamaConfig(**{**c, "num_attention_heads": 8, "num_key_value_heads": 1}, head_dim=16,
                              attention_bias=True, tie_word_embeddings=False)
    if row == "mistral":  # GQA 4:1; the converter writes Mistral as llama and drops a sliding window
        return tf.MistralConfig(**{**c, "num_attention_heads": 8}, head_dim=32, sliding_window=None)
    if row == "qwen2":
        return tf.Qwen2Config(**{**c, "num_key_value_heads": 4}, tie_word_embeddings=False)
    if row == "qwen3":
        return tf.Qwen3Config(**c, head_dim=32, tie_word_embeddings=True)
    if row == "phi3":
        return tf.Phi3Config(**{**c, "num_key_value_heads": 4}, tie_word_embeddings=False)
    if row == "phi3_longrope":  # Phi-3-mini-128k style: long/short factors, partial rotary
        half = int(HIDDEN // 4 * 0.5) // 2
        return tf.Phi3Config(**{**c, "num_key_value_heads": 4}, partial_rotary_factor=0.5,
                             original_max_position_embeddings=512, rope_parameters={
                                 "rope_type": "longrope", "rope_theta": 10000.0,
                                 "long_factor": [1.0 + 0.37 * i for i in range(half)],
                                 "short_factor": [1.0 + 0.05 * i for i in range(half)]})
    if row == "gemma3":  # every sixth layer global (llama.cpp's default pattern), linear on global
        return tf.Gemma3TextConfig(**{**c, "num_hidden_layers": 6}, head_dim=16, sliding_window=32,
                                   query_pre_attn_scalar=16, rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if row == "gemma2":  # soft-capped attention logits and final logits, a window on every other layer
        return tf.Gemma2Config(**{**c, "num_hidden_layers": 4}, head_dim=16, sliding_window=32,
                               query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                               rope_parameters=_rope("default"))
    if row == "qwen3moe":  # 8 experts, 2 a token, renormalised (llama.cpp's qwen3moe always renormalises)
        return tf.Qwen3MoeConfig(**c, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                 norm_topk_prob=True, tie_word_embeddings=False)
    if row == "olmoe":  # 8 experts of intermediate_size, 2 a token, not renormalised; q and k each normed whole
        # (as many KV heads as query heads, as OLMoE-1B-7B: llama.cpp's olmoe takes no other k norm)
        return tf.OlmoeConfig(**{**c, "num_key_value_heads": 4}, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=False, tie_word_embeddings=False)
    if row == "mixtral":  # 8 experts of intermediate_size, 2 a token; the converter writes it as llama
        return tf.MixtralConfig(**c, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                                sliding_window=None, tie_word_embeddings=False)
    if row == "gpt_oss":  # learned sinks, biased router and experts, clamped SwiGLU, a window on layer 0 of 2;
        # yarn with the correction range truncated, as llama.cpp always computes it (the file cannot say otherwise)
        return tf.GptOssConfig(**c, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
                               tie_word_embeddings=False, rope_parameters={
                                   "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": True, "original_max_position_embeddings": 512,
                                   "rope_theta": 150000.0})
    if row == "smollm3":  # RoPE left out of every fourth layer (layer 3 of 4 here), as in SmolLM3-3B
        return tf.SmolLM3Config(**{**c, "num_hidden_layers": 4}, rope_parameters=_rope("default", 2e6),
                                tie_word_embeddings=True)
    if row == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=2048, n_ctx=2048,
                             n_inner=4 * HIDDEN, initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raise ValueError(row)


ROWS = ["llama", "llama3", "llama_yarn", "llama_linear", "llama_gqa8", "mistral", "qwen2", "qwen3", "phi3",
        "phi3_longrope", "gemma2", "gemma3", "qwen3moe", "mixtral", "olmoe", "gpt_oss", "smollm3", "gpt2"]
# rows whose tokenizer is byte-level BPE (the bundled SmolLM2's): the converter needs a known one
BPE_ROWS = {"gpt2", "qwen3moe", "mixtral", "olmoe", "gpt_oss"}  # qwen3moe: the converter reads only a BPE tokenizer for it


def spm_tokenizer(folder: Path, vocab: int) -> None:
    """A small SentencePiece model (tokenizer.model) trained on a few lines, what the converter reads
    for the sentencepiece families."""
    import sentencepiece as spm

    lines = [f"the cache holds keys and values of token {i} at position {i * 7}" for i in range(200)]
    lines += ["def main(): return sum(range(10)) + len('kvcache')", "Les modèles lisent le texte. Été, déjà."]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=vocab, model_type="bpe", character_coverage=1.0, byte_fallback=True,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": False,
                                                            "tokenizer_class": "LlamaTokenizer"}))


def make_model(row: str, folder: Path, bpe_dir: Path) -> Any:
    """Save row's tiny random model (norms and biases randomised so that each matters) with a
    tokenizer into ``folder``; returns the HF model."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    if row in BPE_ROWS:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(bpe_dir / f, folder / f)
        vocab = len(json.loads((bpe_dir / "tokenizer.json").read_text())["model"]["vocab"])
    else:
        vocab = 512  # 256 byte pieces (llama.cpp needs the byte fallback for unseen characters) and 256 more
        spm_tokenizer(folder, vocab)
    torch.manual_seed(sum(map(ord, row)))
    model = AutoModelForCausalLM.from_config(hf_config(row, vocab), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    return model


_DRIVER = r"""
import json, logging, sys
sys.path.insert(0, sys.argv[1])
logging.disable(logging.WARNING)
import convert_hf_to_gguf as c
for folder, outtype, out in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", out]
    c.main()
"""


def convert_all(jobs: list[tuple[Path, str, Path]]) -> None:
    """Convert (HF folder, outtype, GGUF path) jobs with llama.cpp's converter in one child process."""
    script = converter()
    assert script is not None
    spec = json.dumps([[str(f), t, str(o)] for f, t, o in jobs])
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(script.parent), spec], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-3000:]}")


def read_gguf(path: Path | str) -> Any:
    """gguf's reader of ``path`` (kvcache's plain-view parse, three times faster than gguf's own),
    parsed once a test process per version of the file (path, size, mtime): the tiny Qwen file's
    151k-token vocabulary takes a second and a half to parse, and several fixtures rewrite it."""
    st = Path(path).stat()
    return _read_gguf(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.cache
def _read_gguf(path: str, size: int, mtime_ns: int) -> Any:
    from kvcache.models.gguf_reader import gguf_reader

    return gguf_reader(path)


def rewrite_gguf(src: Path, dst: Path, *, arch: str | None = None, drop: tuple[str, ...] = (),
                 add: dict[str, Any] | None = None, add_tensors: dict[str, Any] | None = None,
                 retype: tuple[str, Any] | None = None) -> Path:
    """A copy of the F32/F16 GGUF ``src`` as a hostile or damaged file might be: keys renamed to
    another architecture (``arch``), tensors or keys named in ``drop`` left out, keys ``add``ed
    (name -> value or (value, GGUFValueType)), tensors ``add_tensors``ed (name -> numpy array);
    ``retype`` (name suffix, GGMLQuantizationType): those tensors quantized by gguf-py to that type."""
    import gguf
    import numpy as np

    reader = read_gguf(src)
    old = str(reader.fields["general.architecture"].contents())
    new = arch or old
    writer = gguf.GGUFWriter(str(dst), new)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        name = new + key[len(old):] if key.startswith(old + ".") else key
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for key, value in (add or {}).items():
        value, vtype = value if isinstance(value, tuple) else (value, gguf.GGUFValueType.get_type(value))
        sub = gguf.GGUFValueType.get_type(value[0]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if retype is not None and t.name.endswith(retype[0]):
            from gguf.quants import quantize

            writer.add_tensor(t.name, quantize(np.array(t.data), retype[1]), raw_dtype=retype[1])
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, arr in (add_tensors or {}).items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
