"""Random weights for the random-weight GGUFs (models/random_llama.py, models/random_moe.py): normal(0, STD)
in float16, made a chunk of rows at a time so that no float32 copy of a whole tensor exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

STD = 0.02  # weight std; norms are 1.0
_CHUNK = 1 << 22  # values generated per step


def random_f16(shape: tuple[int, ...], rng: np.random.Generator, done: Callable[[int], object]) -> np.ndarray:
    """normal(0, STD) [shape] in float16; ``done(bytes)`` after each chunk."""
    a = np.empty(shape, dtype=np.float16)
    rows = max(1, _CHUNK // shape[1])
    for r in range(0, shape[0], rows):
        chunk = a[r:r + rows]
        chunk[...] = rng.standard_normal(chunk.shape, dtype=np.float32) * STD
        done(chunk.nbytes)
    return a


def add_llm_keys(w: Any, context: int, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int,
                 head_dim: int, theta: float, eps: float) -> None:
    """The hyper-parameter keys every benchmark GGUF has, on the gguf writer ``w``."""
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)


def copy_fields(w: Any, fields: dict[str, Any]) -> None:
    """GGUF reader fields (the bundled tokenizer's) written as they are by the writer ``w``."""
    import gguf

    for key, f in fields.items():
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), vtype)


def open_writer(tmp: Any, arch: str, name: str, seed: int) -> tuple[Any, int]:
    """A gguf writer of architecture ``arch`` at ``tmp`` with the description keys and the bundled
    SmolLM2's tokenizer copied in (a real vocabulary); returns (writer, vocabulary size)."""
    import gguf

    from kvcache.models.bundled import default_gguf
    from kvcache.models.gguf_reader import gguf_reader

    src = gguf_reader(default_gguf())
    tok = {k: f for k, f in src.fields.items() if k.startswith("tokenizer.")}
    vocab = len(tok["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_type("model")
    w.add_name(f"kvcache random {name} (seed {seed})")
    w.add_description("random weights (normal, std 0.02) with SmolLM2's tokenizer: for speed benchmarks only")
    w.add_vocab_size(vocab)
    copy_fields(w, tok)
    return w, vocab


def write_planned(w: Any, tmp: Any, out: Any, plan: list, total: int, progress: bool,
                  write_one: Callable[[int, str, tuple[int, ...], Callable[[int], object]], None]) -> Any:
    """Write the header, the keys, the tensor table and then each tensor of ``plan`` ((name, shape)
    in file order) by ``write_one(i, name, shape, done)``, with a progress bar over ``total`` bytes;
    ``tmp`` renamed to ``out`` when whole, removed otherwise. Returns ``out``."""
    from tqdm import tqdm

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc=out.name, disable=not progress) as bar:
            for i, (tname, tshape) in enumerate(plan):
                write_one(i, tname, tshape, bar.update)
        w.close()
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out
