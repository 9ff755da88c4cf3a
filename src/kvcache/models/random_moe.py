"""Mixture-of-experts benchmark models: ``qwen3moe`` and ``gpt-oss`` GGUFs with random weights and a
real tokenizer.

The sparse sibling of models/random_llama.py (bench/randmodel.py calls in here for the shapes
named in ``MOE_SHAPES``): ``write_f16`` writes an F16 GGUF of architecture ``qwen3moe``, as llama.cpp's
converter lays out a Qwen3-MoE checkpoint: Qwen3's attention with per-head ``attn_q_norm`` and
``attn_k_norm`` [head_dim] (F32), the router ``ffn_gate_inp`` [E, H] in F32, and each layer's
experts as three 3-D tensors ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] and ``ffn_down_exps``
[E, H, I] in F16. A ``gpt-oss`` shape is laid out as the converter writes gpt-oss: biases on q, k,
v, o, the router and every expert (F32), a learned sink logit per query head, ``post_attention_norm``
before the experts, a 128-token window on every other layer and yarn RoPE (factor 32 over 4,096).
Weights are normal(0, 0.02), norms all ones, the tokenizer the bundled SmolLM2's.
A 3-D tensor is generated and written one expert at a time, so memory stays at one expert's matrix
whatever the model's size. ``randmodel.make`` then quantizes the file with ``llama-quantize``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcache.models.random_weights import STD, add_llm_keys, open_writer, random_f16 as _random, write_planned


@dataclass(frozen=True)
class MoeShape:
    """A qwen3moe shape (every layer sparse, no shared expert)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int  # experts per token
    expert_ffn: int
    ffn: int = 0  # the file's feed_forward_length key (unused by a fully sparse model; 0: expert_ffn)
    rope_theta: float = 1000000.0
    context: int = 8192
    eps: float = 1e-6
    tied: bool = False
    arch: str = "qwen3moe"  # or "gpt-oss"


MOE_SHAPES: dict[str, MoeShape] = {
    # Qwen3-30B-A3B's shapes, 12 of its 48 layers
    "qwen3-30b-a3b-12l": MoeShape(2048, 12, 32, 4, 128, 128, 8, 768, ffn=6144),
    # the same with 2 layers (a quick load check)
    "qwen3-30b-a3b-2l": MoeShape(2048, 2, 32, 4, 128, 128, 8, 768, ffn=6144),
    # gpt-oss-20b's shapes, 4 of its 24 layers
    "gpt-oss-20b-4l": MoeShape(2880, 4, 64, 8, 64, 32, 4, 2880, rope_theta=150000.0, context=131072, eps=1e-5,
                               arch="gpt-oss"),
}


def moe_shape(text: str) -> MoeShape | None:
    """The MoE shape ``text`` names, or None when it names none."""
    return MOE_SHAPES.get(text.strip().lower())


def tensors(s: MoeShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes in llama.cpp's order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    e, i, h = s.experts, s.expert_ffn, s.hidden
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for n in range(s.layers):
        b = f"blk.{n}."
        if s.arch == "gpt-oss":
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_q.bias", (q,)),
                    (b + "attn_k.weight", (kv, h)), (b + "attn_k.bias", (kv,)), (b + "attn_v.weight", (kv, h)),
                    (b + "attn_v.bias", (kv,)), (b + "attn_output.weight", (h, q)), (b + "attn_output.bias", (h,)),
                    (b + "attn_sinks.weight", (s.heads,)), (b + "post_attention_norm.weight", (h,)),
                    (b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_inp.bias", (e,)),
                    (b + "ffn_gate_exps.weight", (e, i, h)), (b + "ffn_gate_exps.bias", (e, i)),
                    (b + "ffn_up_exps.weight", (e, i, h)), (b + "ffn_up_exps.bias", (e, i)),
                    (b + "ffn_down_exps.weight", (e, h, i)), (b + "ffn_down_exps.bias", (e, h))]
            continue
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h)), (b + "attn_q_norm.weight", (s.head_dim,)),
                (b + "attn_k_norm.weight", (s.head_dim,)), (b + "attn_output.weight", (h, q)),
                (b + "ffn_norm.weight", (h,)), (b + "ffn_gate_inp.weight", (e, h)),
                (b + "ffn_gate_exps.weight", (e, i, h)), (b + "ffn_up_exps.weight", (e, i, h)),
                (b + "ffn_down_exps.weight", (e, h, i))]
    out.append(("output_norm.weight", (h,)))
    if not s.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def _dtype(name: str, shape: tuple[int, ...]) -> type:
    return np.float32 if len(shape) == 1 or name.endswith(("ffn_gate_inp.weight", ".bias")) else np.float16


def _write_chunked(w, shape: tuple[int, ...], rng: np.random.Generator, done: Callable[[int], object]) -> None:
    """Write the next tensor of ``w`` (a 3-D F16 one) one [rows, cols] slice at a time: what
    GGUFWriter.write_tensor_data does for a whole array, without holding it."""
    fout = next(f for f, t in zip(w.fout, w.tensors) if t)
    tensors = w.tensors[w.fout.index(fout)]
    info = tensors.pop(next(iter(tensors)))
    assert info.nbytes == int(np.prod(shape)) * 2
    w.write_padding(fout, fout.tell())
    for _ in range(shape[0]):
        _random(shape[1:], rng, done).tofile(fout)
    w.write_padding(fout, info.nbytes)
    from gguf.gguf_writer import WriterState

    w.state = WriterState.WEIGHTS


def write_f16(shape: MoeShape, out: Path, seed: int = 0, name: str = "random", progress: bool = True) -> Path:
    """Write ``shape`` with random weights as an F16 GGUF of its architecture at ``out``; returns ``out``."""
    import gguf

    tmp = out.with_name(out.name + ".tmp")
    w, vocab = open_writer(tmp, shape.arch, name, seed)
    add_llm_keys(w, shape.context, shape.hidden, shape.layers, shape.ffn or shape.expert_ffn, shape.heads,
                 shape.kv_heads, shape.head_dim, shape.rope_theta, shape.eps)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.used)
    w.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.arch == "gpt-oss":  # as the converter writes gpt-oss-20b's config
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = tensors(shape, vocab)
    for tname, tshape in plan:
        dt = np.dtype(_dtype(tname, tshape))
        w.add_tensor_info(tname, tshape, dt, int(np.prod(tshape)) * dt.itemsize)
    total = sum(int(np.prod(t)) * np.dtype(_dtype(n, t)).itemsize for n, t in plan if not n.endswith("norm.weight"))

    def one(i: int, tname: str, tshape: tuple[int, ...], done: Callable[[int], object]) -> None:
        rng = np.random.default_rng([seed, i])  # each tensor its own stream
        if len(tshape) == 3:
            _write_chunked(w, tshape, rng, done)
        elif len(tshape) == 1 and tname.endswith("norm.weight"):
            w.write_tensor_data(np.ones(tshape, np.float32))
        elif _dtype(tname, tshape) is np.float32:  # the router, biases and sink logits
            a = rng.standard_normal(tshape, dtype=np.float32) * np.float32(STD)
            done(a.nbytes)
            w.write_tensor_data(a)
        else:
            w.write_tensor_data(_random(tshape, rng, done))

    return write_planned(w, tmp, out, plan, total, progress, one)