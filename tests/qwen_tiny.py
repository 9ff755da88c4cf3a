"""A tiny random Qwen2 GGUF that speaks with Qwen2.5's real tokenizer and chat template.

The tokenizer and template come from Qwen2.5-Coder-1.5B-Instruct's own GGUF metadata
(``python -m kvcache.models.fetch_qwen --tokenizer``, run by ``make setup-test``): its 151,936
tokens, its BPE merges, its special tokens (``<tool_call>`` and ``</tool_call>`` among them) and
its tools-aware template. The weights are random (2 layers, hidden 64), so what the model says is
noise (save that it ends every JSON value as soon as it may: see below), but every token id, template render, grammar and parser sees what a real Qwen2.5 file
gives it. The file is written once per seed into the user cache (a second call is instant).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def tokenizer_gguf() -> Path:
    """Qwen2.5's tokenizer-only GGUF; skips the test where it is not installed."""
    from kvcache.models.fetch_qwen import tokenizer_ok, tokenizer_path

    path = tokenizer_path()
    if not tokenizer_ok(path):
        pytest.skip("Qwen2.5's tokenizer is not installed (make qwen-tokenizer; make setup-test does it)")
    return path


def tiny_qwen(seed: int = 0) -> Path:
    """The tiny model's GGUF (written on first use)."""
    import gguf

    from kvcache.models.random_weights import copy_fields
    from kvcache.models.gguf_reader import gguf_reader
    from kvcache.paths import cache_home

    src = tokenizer_gguf()
    out = cache_home() / "testmodels" / f"qwen2-tiny-qwen-tokenizer-v3-{seed}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf_reader(src)  # gguf's reader, parsing a vocabulary three times faster
    tok = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    vocab = len(tok["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    tmp = out.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen2")
    w.add_type("model")
    w.add_name(f"tiny random qwen2 with Qwen2.5's tokenizer (seed {seed})")
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    copy_fields(w, tok)
    dim = HIDDEN // HEADS

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)

    # one steady direction (dimension 0) through the residual stream, along which the tokens that end
    # JSON values stand out, most of all the closing quote, then the closing brackets, then the
    # comma: the model closes every string, number, array and object as soon as its grammar lets it,
    # so that a schema without bounds (an agent's final_answer) ends within a few tokens instead of
    # running to max_tokens
    embd = rand(vocab, HIDDEN)
    embd[:, 0] = 1.0
    texts = [str(t) for t in tok["tokenizer.ggml.tokens"].contents()]
    for text, weight in (('"', 3.0), ("}", 2.75), ("]", 2.75), (",", 2.5)):
        embd[texts.index(text), 0] = weight
    w.add_tensor("token_embd.weight", embd.astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(b + "attn_q.weight", rand(HEADS * dim, HIDDEN))
        w.add_tensor(b + "attn_q.bias", rand(HEADS * dim))
        w.add_tensor(b + "attn_k.weight", rand(KV_HEADS * dim, HIDDEN))
        w.add_tensor(b + "attn_k.bias", rand(KV_HEADS * dim))
        w.add_tensor(b + "attn_v.weight", rand(KV_HEADS * dim, HIDDEN))
        w.add_tensor(b + "attn_v.bias", rand(KV_HEADS * dim))
        w.add_tensor(b + "attn_output.weight", rand(HIDDEN, HEADS * dim))
        w.add_tensor(b + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(b + "ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(b + "ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(b + "ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out
