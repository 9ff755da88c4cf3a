"""Weight bytes a model holds in memory under each weights mode (``kvcache size``).

Counted from the architecture: the projections (attention, MLP, the output head) are what ``q8``
and ``q4`` quantize, at 34 and 20 bytes per 32 weights (a Q8_0 or Q4_1 block: codes and fp16
scale, and minimum for Q4_1); an untied input embedding table, GPT-2's position table and the
norms stay fp32 in those modes. ``file`` is what a GGUF holds: its quantized tensors at their own
size, its float tensors expanded to fp32. Biases and per-head norms are left out (well under 0.1%
of any model here); kvcache's packed layouts add a little padding on top.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.models.config import ModelConfig

Q8_PER_WEIGHT, Q4_PER_WEIGHT = 34 / 32, 20 / 32
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class WeightSize:
    params: int
    by_mode: dict[str, int]  # fp32, q8, q4 and, for a GGUF file, file
    file_kinds: dict[str, int] = field(default_factory=dict)  # GGUF tensor type -> bytes in the file


def parameter_groups(m: ModelConfig) -> tuple[int, int, int]:
    """(projection weights, weights that stay fp32 in every mode, of which the untied embedding)."""
    h, q, kv, inter = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    if m.model_type == "gpt2":
        per_layer = h * 3 * h + h * h + 2 * h * inter  # fused q/k/v, output, fc and proj
        other = m.max_position * h  # learned positions
    else:
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter  # q, k, v, o; gate, up, down
        other = 0
    projections = m.num_layers * per_layer + m.vocab_size * h  # the output head is a projection
    embed = 0 if m.tie_embeddings else m.vocab_size * h
    norms = m.num_layers * 2 * h + h
    return projections, other + embed + norms, embed


def weight_size(m: ModelConfig, gguf: Path | None = None) -> WeightSize:
    proj, rest, _ = parameter_groups(m)
    by_mode = {"fp32": 4 * (proj + rest), "q8": round(proj * Q8_PER_WEIGHT) + 4 * rest,
               "q4": round(proj * Q4_PER_WEIGHT) + 4 * rest}
    kinds: dict[str, int] = {}
    if gguf is not None:
        from kvcache.models.gguf_convert import open_gguf

        counts: Counter[str] = Counter()
        in_memory = 0
        for t in open_gguf(gguf).tensors:
            kind = t.tensor_type.name
            counts[kind] += int(t.n_bytes)
            in_memory += 4 * int(t.n_elements) if kind in FLOAT_TYPES else int(t.n_bytes)
        kinds = dict(counts.most_common())
        by_mode["file"] = in_memory
    return WeightSize(proj + rest, by_mode, kinds)


def describe(ws: WeightSize, human: Callable[[float], str]) -> str:
    """``134.5 M parameters: fp32 513.0 MiB · q8 136.4 MiB · q4 80.3 MiB · file 92.1 MiB (Q4_1 ...)``."""
    count = f"{ws.params / 1e9:.2f} B" if ws.params >= 1e9 else f"{ws.params / 1e6:.1f} M"
    parts = [f"{mode} {human(ws.by_mode[mode])}" for mode in ("fp32", "q8", "q4") if mode in ws.by_mode]
    if "file" in ws.by_mode:
        kinds = ", ".join(f"{k} {human(v)}" for k, v in ws.file_kinds.items())
        parts.append(f"file {human(ws.by_mode['file'])} (in the file: {kinds})")
    return f"{count} parameters: " + " · ".join(parts)
