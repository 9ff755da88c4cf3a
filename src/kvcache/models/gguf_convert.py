"""GGUF file -> HF-format model folder (config.json, tokenizer files, and model.safetensors in fp32
when the fp32 weights are asked for), and the file's weights by HF name for the ``file`` mode.

Weights are dequantized to fp32 with the gguf package and renamed to HF names (``file`` leaves
the quantized ones in the file: models/weights.py reads and repacks them). llama.cpp permutes
the Q and K rows of llama-architecture models for its interleaved RoPE; that permutation is undone
so every family runs one (HF, rotate-half) convention. llama.cpp stores Gemma's norm weights as
(1 + w); HF names hold w, so 1 is subtracted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvcache.errors import ModelLoadError, UnsupportedArchitecture
from kvcache.models.gguf_config import hf_config_from_meta
from kvcache.models.gguf_names import SUPPORTED, hf_tensor_name
from kvcache.models.gguf_tensor import MXFP4, GGUFTensor, qtype
from kvcache.kernels.qweight import FORMAT_OF



def open_gguf(path: Path):  # -> gguf.GGUFReader
    """Open and validate a GGUF file; a one-line ModelLoadError when it is not a whole GGUF."""
    from kvcache.models.gguf_reader import TruncatedGGUF, gguf_reader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    try:
        reader = gguf_reader(path)
    except TruncatedGGUF as e:
        raise ModelLoadError(f"{path} is truncated: {e}") from None
    except Exception as e:  # the reader raises many kinds of errors on damaged files
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.size * t.data.itemsize < t.n_bytes:
            raise ModelLoadError(f"{path} is truncated: tensor {t.name} extends past the end of the file")
    return reader


def metadata(reader) -> dict[str, Any]:
    """GGUF metadata as plain Python values (token lists left out)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # pragma: no cover - exotic field types are not needed
            continue
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows (head, d/2, 2) -> (head, 2, d/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(t) -> np.ndarray:
    """One tensor as float32 in numpy (row-major) shape."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as deq

    shape = tuple(int(s) for s in reversed(t.shape))
    if t.tensor_type == Q.F32:
        arr = np.asarray(t.data, dtype=np.float32)
    elif t.tensor_type == Q.F16:
        arr = np.asarray(t.data).astype(np.float32)
    else:
        try:
            arr = deq(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"tensor {t.name} has unsupported GGUF type {t.tensor_type.name}") from None
    return arr.reshape(shape).astype(np.float32, copy=False)


def _fixed(t, arch: str, name: str, n_head: int | None, n_kv: int | None) -> np.ndarray:
    """One tensor as fp32 in HF's layout and convention."""
    w = dequantize(t)
    heads = _permuted_heads(arch, t.name, n_head, n_kv)
    if heads is not None:
        w = _unpermute(w, heads)
    if arch in ("gemma2", "gemma3") and t.name.endswith("norm.weight"):
        w = w - 1.0
    if arch == "gpt2" and w.ndim == 2 and ".h." in name and not name.endswith("wte.weight"):
        w = w.T  # HF GPT-2 uses Conv1D: [in, out]
    return np.array(w, dtype=np.float32, order="C")  # a copy: never a view of the mapped file


def _permuted_heads(arch: str, name: str, n_head: int | None, n_kv: int | None) -> int | None:
    """Heads of a llama (or smollm3, which its converter writes as a llama) Q or K weight or bias
    whose rows llama.cpp's converter permuted, else None."""
    if arch not in ("llama", "smollm3"):
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return n_head
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return n_kv
    return None


def _kept(ggml: int) -> bool:
    """Whether the file mode keeps a tensor of GGUF type ``ggml`` in its type (else it is read as fp32)."""
    return ggml in FORMAT_OF


def _experts(t, name: str, keep_quantized: str | None) -> dict[str, Any]:
    """A MoE layer's 3-D expert tensor [E, rows, K] as one HF-named 2-D weight per expert: slices
    of the file (GGUFTensor) when quantized and kept, else fp32; a 2-D one [E, rows] (gpt-oss's
    expert biases) as one vector per expert."""
    if len(t.shape) == 2:
        b = dequantize(t)  # [E, rows]
        return {name.format(e=e): torch.from_numpy(np.array(b[e], dtype=np.float32, order="C")) for e in range(len(b))}
    n_exp, rows, k = (int(s) for s in reversed(t.shape))
    kind = int(t.tensor_type)
    if keep_quantized and _kept(kind):
        step = GGUFTensor(keep_quantized, kind, rows, k, 0).row_bytes * rows
        return {name.format(e=e): GGUFTensor(keep_quantized, kind, rows, k, int(t.data_offset) + e * step)
                for e in range(n_exp)}
    w = dequantize(t)  # [E, rows, K]
    return {name.format(e=e): torch.from_numpy(np.array(w[e], dtype=np.float32, order="C")) for e in range(n_exp)}


def convert_weights(reader, arch: str, config: dict[str, Any],
                    progress: Callable[[int], None] | None = None, keep_quantized: str | None = None) -> dict[str, Any]:
    """HF-named weights of every GGUF tensor: fp32 tensors, or with ``keep_quantized`` (the file's
    path) the quantized 2-D tensors left in the file as GGUFTensors (read and repacked later)."""
    out: dict[str, Any] = {}
    n_head, n_kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    for t in reader.tensors:
        name = hf_tensor_name(arch, t.name)
        if name is None:
            raise ModelLoadError(f"tensor {t.name} has no place in a {arch} model")
        if "{e}" in name:
            out.update(_experts(t, name, keep_quantized))
        elif keep_quantized and _kept(int(t.tensor_type)) and len(t.shape) == 2:
            k, rows = int(t.shape[0]), int(t.shape[1])
            heads = _permuted_heads(arch, t.name, n_head, n_kv)
            out[name] = GGUFTensor(keep_quantized, int(t.tensor_type), rows, k, int(t.data_offset), heads)
        else:
            out[name] = torch.from_numpy(_fixed(t, arch, name, n_head, n_kv))
        if progress:
            progress(1)
    if config.get("tie_word_embeddings") is False and "lm_head.weight" not in out:
        config["tie_word_embeddings"] = True
    return out


def _report(reader, meta: dict[str, Any]):  # -> (gguf_check.Report, vocabulary size or None)
    from kvcache.models.gguf_check import check

    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    report = check(meta, [(t.name, tuple(int(s) for s in reversed(t.shape))) for t in reader.tensors], n_vocab)
    report.types = _held_types(reader)
    return report, n_vocab


def _held_types(reader) -> list[str]:
    """Each tensor type of the file with its count and what the file weights mode makes of it."""
    from collections import Counter

    counts = Counter(int(t.tensor_type) for t in reader.tensors)
    out = []
    for ggml, n in sorted(counts.items()):
        if not _kept(ggml):
            how = "fp32" if ggml == 0 else "read as fp32"
        elif ggml == MXFP4:
            how = "kept in the file's type: its codes, 4.5 bits a weight in memory with fp16 block scales"
        else:
            how = "kept in the file's type"
        out.append(f"{qtype(ggml).name} x{n} ({how})")
    return out


def read_gguf(path: Path) -> tuple[Any, str, dict[str, Any]]:
    """(reader, architecture, HF config dict) of a GGUF file. Every key and tensor is checked first
    (models/gguf_check.py): a file that carries anything kvcache does not honour is refused with a
    line naming it."""
    from kvcache.models.gguf_check import refuse

    reader = open_gguf(path)
    meta = metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED:
        raise UnsupportedArchitecture(
            f"{path.name}: unsupported architecture {arch or '(none)'!r}; supported: {', '.join(SUPPORTED)}"
        )
    report, n_vocab = _report(reader, meta)
    refuse(report, path.name)
    try:
        config = hf_config_from_meta(arch, meta, n_vocab, {t.name for t in reader.tensors})
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path.name}: its metadata cannot describe a {arch} model ({type(e).__name__}: {e})") from None
    return reader, arch, config


def check_file(path: Path):  # -> gguf_check.Report
    """What kvcache makes of every key and tensor of ``path`` (nothing refused on the way)."""
    reader = open_gguf(path)
    return _report(reader, metadata(reader))[0]


TABLE = "file-weights"  # the file mode's tensor table in a converted folder (.json + .safetensors)


def gguf_weights(path: Path, cache_dir: Path | None = None) -> dict[str, Any]:
    """The weights of a GGUF file as the ``file`` mode holds them: quantized projections and
    tables left in the file (GGUFTensor), the rest (norms, fp32/fp16 tensors) as fp32. With
    ``cache_dir`` (the file's converted folder) the table of tensors is kept there, so later loads
    skip parsing the GGUF (its token lists alone take seconds)."""
    if cache_dir is not None:
        cached = _read_table(cache_dir, path)
        if cached is not None:
            return cached
    reader, arch, config = read_gguf(path)
    out = convert_weights(reader, arch, config, keep_quantized=str(path))
    if cache_dir is not None:
        _write_table(cache_dir, out)
    return out


def _write_table(folder: Path, weights: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    table = {name: {"type": w.ggml_type, "out": w.out, "k": w.k, "offset": w.offset, "permute_heads": w.permute_heads}
             for name, w in weights.items() if isinstance(w, GGUFTensor)}
    small = {k: v.contiguous() for k, v in weights.items() if not isinstance(v, GGUFTensor)}
    tmp = folder / f".{TABLE}.tmp"
    save_file(small, str(tmp.with_suffix(".safetensors")))
    tmp.with_suffix(".json").write_text(json.dumps(table))
    os.replace(tmp.with_suffix(".safetensors"), folder / f"{TABLE}.safetensors")
    os.replace(tmp.with_suffix(".json"), folder / f"{TABLE}.json")


def _read_table(folder: Path, path: Path) -> dict[str, Any] | None:
    from safetensors.torch import load_file

    j, st = folder / f"{TABLE}.json", folder / f"{TABLE}.safetensors"
    if not (j.is_file() and st.is_file()):
        return None
    try:
        table = json.loads(j.read_text())
        out: dict[str, Any] = dict(load_file(str(st)))
    except (OSError, ValueError):
        return None  # unreadable: parse the file again
    for name, e in table.items():
        # tables written before MXFP4 was held in its own type name it as the type it was read as
        # ("type" Q5_0) beside the file's ("source")
        kind = e.get("source") or e["type"]
        out[name] = GGUFTensor(str(path), kind, e["out"], e["k"], e["offset"], e["permute_heads"])
    return out


def convert_gguf(path: Path, out_dir: Path, show_progress: bool = True, weights: bool = True,
                 tokenizer: bool = True) -> None:
    """Write config.json and (with ``tokenizer``) the tokenizer files of ``path`` into ``out_dir``,
    and with ``weights`` model.safetensors (every tensor as fp32), without it the ``file`` mode's
    table of tensors (gguf_weights)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from kvcache.models.gguf_tokenizer import write_tokenizer

    from kvcache.models.config import ModelConfig
    from kvcache.models.shapes import check_shapes

    reader, arch, config = read_gguf(path)
    # every tensor's shape against the hyper-parameters before any is read or reshaped, and before a
    # converted folder exists: a file whose tensors and keys disagree leaves nothing behind
    check_shapes(ModelConfig.from_hf(config), {hf_tensor_name(arch, t.name): tuple(int(x) for x in reversed(t.shape))
                                               for t in reader.tensors if "{e}" not in (hf_tensor_name(arch, t.name) or "{e}")})
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights:
        bar = tqdm(total=len(reader.tensors), desc=f"converting {path.name} to fp32", unit="tensor",
                   disable=not show_progress, leave=False)
        tensors = convert_weights(reader, arch, config, bar.update)
        bar.close()
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:  # the file mode's table (what gguf_weights would parse the file again for); settles tie_word_embeddings
        _write_table(out_dir, convert_weights(reader, arch, config, keep_quantized=str(path)))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        write_tokenizer(path, metadata(reader), out_dir, reader)
