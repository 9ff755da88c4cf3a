"""Every key and tensor of a GGUF file honoured, or the file refused with one line naming it.

A GGUF carries metadata keys and tensors; some change the arithmetic (head counts, RoPE bases and
scalings, sliding windows, soft caps, biases, RoPE frequency factors), others only describe the file
(its name, licence, quantization tool). This module sorts every key and every tensor of a file into:

  honoured   used by kvcache's model, cache or tokenizer, with a value it implements;
  no effect  on the explicit list below of keys known not to change a model's outputs;
  refused    anything else: a key or tensor kvcache does not implement, a value it cannot honour
             (per-layer head counts, a value length unlike the key length, an unknown RoPE scaling),
             a tensor the architecture requires that the file lacks.

``check`` makes the report (``kvcache models --check FILE`` prints it); ``refuse`` raises on the
first refused item. Nothing here reads tensor data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvcache.errors import UnsupportedArchitecture
from kvcache.models.gguf_names import SUPPORTED, expected_tensors, has_experts

# Keys that only describe the file: provenance, licence, how it was quantized, sampling defaults a
# client may read, the header (GGUF.*). None changes a logit. (general.alignment is honoured by the reader.)
NO_EFFECT_PREFIXES = ("GGUF.", "general.", "quantize.imatrix.", "split.")
NO_EFFECT_KEYS = {
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.separator_token_id", "tokenizer.ggml.cls_token_id", "tokenizer.ggml.mask_token_id",
    "tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id",
    "tokenizer.ggml.prefix_token_id", "tokenizer.ggml.suffix_token_id", "tokenizer.ggml.middle_token_id",
    "tokenizer.ggml.add_sep_token", "tokenizer.ggml.token_type_count",
}
# What the tokenizer and chat rendering take from the file (tokenizer.chat_template.NAME too).
TOKENIZER_KEYS = {
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.remove_extra_whitespaces", "tokenizer.chat_template",
}
TOKENIZER_MODELS = ("gpt2", "llama")
# byte-level BPE pre-tokenizers whose split kvcache's tokenizer reproduces (models/gguf_tokenizer.py)
PRE_TYPES = (
    "default", "gpt-2", "phi-2", "mpt", "olmo", "smollm", "llama3", "llama-v3", "llama-bpe", "falcon3",
    "pixtral", "dbrx", "smaug-bpe", "tekken", "qwen2", "deepseek-r1-qwen", "qwen35", "gpt-4o", "llama4",
)

# Model keys ({arch}.KEY) each family honours. Values are checked in _check_values.
_COMMON = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.causal",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow", "rope.scale_linear",
}
_GEMMA = _COMMON | {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                    "final_logit_softcapping", "attn_logit_softcapping"}
MODEL_KEYS: dict[str, set[str]] = {
    "llama": _COMMON | {"expert_count", "expert_used_count"},  # Mixtral: llama with experts
    "mistral": _COMMON | {"attention.sliding_window"},
    "qwen2": _COMMON,
    "qwen3": _COMMON,
    "qwen3moe": _COMMON | {"expert_count", "expert_used_count", "expert_feed_forward_length"},
    "olmoe": _COMMON | {"expert_count", "expert_used_count"},
    "gpt-oss": _COMMON | {"expert_count", "expert_used_count", "expert_feed_forward_length",
                          "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"},
    "phi3": _COMMON | {"attention.sliding_window", "rope.scaling.attn_factor"},
    "smollm3": _COMMON,
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "gpt2": {"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
             "attention.head_count", "attention.head_count_kv", "attention.layer_norm_epsilon", "attention.causal"},
}
# keys that mean a different model altogether, with the reason a reader understands
_MEANS = {
    "expert_count": "a mixture of experts, which kvcache runs for qwen3moe, olmoe, gpt-oss and llama (Mixtral)",
    "expert_shared_count": "shared experts", "expert_shared_feed_forward_length": "shared experts",
    "attention.scale": "a custom attention scale", "logit_scale": "scaled logits",
    "embedding_scale": "scaled embeddings", "residual_scale": "scaled residuals",
}
# {arch}.KEY that change nothing at these values: no experts (older converters wrote expert_count 0),
# and the note of which layout a pth checkpoint had (the tensors are what they are)
_ZERO_IS_NONE = {"expert_count", "expert_used_count"}
_DESCRIPTIVE = {"tensor_data_layout"}
SCALINGS = {"none": None, "linear": "linear", "yarn": "yarn", "longrope": "longrope"}
# what an architecture's name alone decides, as llama.cpp's loader reads it (no key says it)
ARCH_RULES = {"smollm3": "every fourth layer without RoPE (layers 4, 8, ...)",
              "gpt-oss": "a learned sink logit per head in every softmax; the experts' SwiGLU clamped at 7 with "
                         "alpha 1.702; the router's softmax over its top k; a window on every other layer from the "
                         "first unless the file's pattern says otherwise"}


@dataclass
class Report:
    """What kvcache makes of one GGUF file."""

    arch: str
    honoured: list[str] = field(default_factory=list)  # keys and tensor kinds used
    no_effect: list[str] = field(default_factory=list)  # keys on the no-effect list
    refused: list[str] = field(default_factory=list)  # one reason each, naming the key or tensor
    types: list[str] = field(default_factory=list)  # each tensor type of the file, its count and how it is held

    @property
    def ok(self) -> bool:
        return not self.refused

    def lines(self, name: str) -> list[str]:
        """The report as `kvcache models --check` prints it."""
        keys = [h for h in self.honoured if not h.startswith("tensor ")]
        tensors = [h[len("tensor "):] for h in self.honoured if h.startswith("tensor ")]
        rule = f" ({ARCH_RULES[self.arch]})" if self.arch in ARCH_RULES else ""
        out = [f"{name}: architecture {self.arch or '(none)'}{rule}",
               f"honoured keys ({len(keys)}): {', '.join(keys) or '-'}",
               f"honoured tensors ({len(tensors)} kinds): {', '.join(tensors) or '-'}",
               f"keys with no effect on the outputs ({len(self.no_effect)}): {', '.join(self.no_effect) or '-'}"]
        if self.types:
            out.append(f"tensor types ({len(self.types)}), as the default weights mode holds them: {'; '.join(self.types)}")
        if self.ok:
            out.append("verdict: every key and tensor is honoured or has no effect; kvcache runs this file")
        else:
            out.append(f"verdict: refused ({len(self.refused)} reasons):")
            out.extend(f"  - {r}" for r in self.refused)
        return out


def check(meta: dict[str, Any], tensors: list[tuple[str, tuple[int, ...]]], n_vocab: int | None) -> Report:
    """Sort every key of ``meta`` (plain values; token lists may be absent) and every tensor
    ``(name, numpy-order shape)`` of a file into honoured, no effect and refused."""
    arch = str(meta.get("general.architecture", ""))
    rep = Report(arch)
    if arch not in SUPPORTED:
        rep.refused.append(f"architecture {arch or '(none)'!r} is not supported (supported: {', '.join(SUPPORTED)})")
        return rep
    own = MODEL_KEYS[arch]
    for key in sorted(meta):
        if key == "general.architecture" or key in TOKENIZER_KEYS or key.startswith("tokenizer.chat_template."):
            rep.honoured.append(key)
        elif key.startswith(f"{arch}."):
            sub = key[len(arch) + 1:]
            if sub in _ZERO_IS_NONE and not meta[key] and arch not in ("qwen3moe", "olmoe", "gpt-oss") or sub in _DESCRIPTIVE:
                rep.no_effect.append(key)
            elif sub in own:
                rep.honoured.append(key)
            else:
                why = _MEANS.get(sub, "kvcache does not implement it")
                rep.refused.append(f"key {key} is not honoured ({why})")
        elif key in NO_EFFECT_KEYS or key.startswith(NO_EFFECT_PREFIXES):
            rep.no_effect.append(key)
        else:
            rep.refused.append(f"key {key} is not honoured (not a key of a {arch} model that kvcache knows)")
    rep.refused.extend(_check_values(arch, meta, n_vocab))
    _check_tensors(arch, meta, tensors, rep)
    if has_experts(arch, meta):  # Mixtral: say so first when the file is not one
        count = meta[f"{arch}.expert_count"]
        if not any(name.endswith("ffn_gate_inp.weight") for name, _ in tensors):
            rep.refused.insert(0, f"key {arch}.expert_count is {count} but the file has no expert tensors "
                                  "(blk.*.ffn_gate_inp, ffn_*_exps)")
        if not meta.get(f"{arch}.expert_used_count"):
            rep.refused.insert(0, f"key {arch}.expert_count is {count} but {arch}.expert_used_count (experts "
                                  "per token) is missing")
    return rep


def refuse(rep: Report, name: str) -> None:
    """Raise UnsupportedArchitecture naming the first refused item of ``rep`` (and how many more)."""
    if rep.ok:
        return
    more = f" (and {len(rep.refused) - 1} more; `kvcache models --check` lists them)" if len(rep.refused) > 1 else ""
    raise UnsupportedArchitecture(f"{name}: {rep.refused[0]}{more}")


def _uniform(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(key)
    if isinstance(value, list) and len(set(value)) > 1:
        return f"key {key} gives per-layer values {_short(value)}; kvcache needs one value for every layer"
    return None


def _short(values: list) -> str:
    return str(values[:6])[:-1] + (", ...]" if len(values) > 6 else "]")


def _check_values(arch: str, meta: dict[str, Any], n_vocab: int | None) -> list[str]:
    out: list[str] = []

    def get(sub: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{sub}", default)

    for sub in ("attention.head_count", "attention.head_count_kv", "feed_forward_length", "expert_used_count"):
        why = _uniform(meta, f"{arch}.{sub}")
        if why:
            out.append(why)
    out += _check_numbers(arch, meta)
    k_len, v_len = get("attention.key_length"), get("attention.value_length")
    if k_len is not None and v_len is not None and int(k_len) != int(v_len):
        out.append(f"key {arch}.attention.value_length ({v_len}) differs from key_length ({k_len}); "
                   "kvcache needs keys and values of one head size")
    if get("attention.causal", True) is False:
        out.append(f"key {arch}.attention.causal is false: a non-causal (embedding) model")
    scaling = get("rope.scaling.type")
    if scaling is not None and str(scaling) not in SCALINGS:
        out.append(f"key {arch}.rope.scaling.type is {scaling!r}; kvcache honours {', '.join(SCALINGS)}")
    elif scaling == "longrope" and arch != "phi3":
        out.append(f"key {arch}.rope.scaling.type 'longrope' is honoured for phi3 files only")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = get(key)
        if arch == "gemma2" and cap is not None and float(cap) <= 0.0:  # llama.cpp divides by both
            out.append(f"key {arch}.{key} is {cap}: a gemma2 soft cap must be positive")
    if arch == "gemma3" and float(get("attn_logit_softcapping", 0.0) or 0.0) != 0.0:
        out.append(f"key {arch}.attn_logit_softcapping is set: llama.cpp's gemma3 never caps attention logits, "
                   "so the file cannot say which model it is")
    if arch == "gpt-oss":
        window = get("attention.sliding_window")
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            out.append(f"key {arch}.attention.sliding_window is {window!r}; llama.cpp's gpt-oss needs a window "
                       "of at least one token")
        base, swa = get("rope.freq_base"), get("rope.freq_base_swa")
        if swa is not None and base is not None and float(swa) != float(base):
            out.append(f"key {arch}.rope.freq_base_swa ({swa}) differs from rope.freq_base ({base}); kvcache's "
                       "gpt-oss turns every layer by one base")
        for sub in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
            if not get(sub):
                out.append(f"key {arch}.{sub} is {get(sub)!r}; a gpt-oss model needs it")
    if float(get("rope.scaling.yarn_ext_factor", 1.0)) != 1.0 and scaling == "yarn":
        out.append(f"key {arch}.rope.scaling.yarn_ext_factor {get('rope.scaling.yarn_ext_factor')} "
                   "is not honoured (only 1.0, what transformers computes)")
    model = meta.get("tokenizer.ggml.model")
    if model is not None and model not in TOKENIZER_MODELS:
        out.append(f"key tokenizer.ggml.model is {model!r}; kvcache reads {', '.join(TOKENIZER_MODELS)} vocabularies")
    pre = meta.get("tokenizer.ggml.pre")
    if model == "gpt2" and pre is not None and pre not in PRE_TYPES:
        out.append(f"key tokenizer.ggml.pre is {pre!r}: a pre-tokenizer kvcache does not reproduce")
    if meta.get("tokenizer.ggml.add_eos_token") is True:
        out.append("key tokenizer.ggml.add_eos_token is true: kvcache never appends EOS to a prompt")
    vocab = int(get("vocab_size", n_vocab or 0) or 0)
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        tid = meta.get(key)
        if tid is not None and (not isinstance(tid, int) or tid < 0 or (vocab and tid >= vocab)):
            out.append(f"key {key} is {tid!r}, not a token id of the vocabulary of {vocab}")
    return out


# hyper-parameters that size or scale the model: (key under the architecture, what it must be)
POSITIVE_INTS = ("block_count", "embedding_length", "feed_forward_length", "context_length", "attention.head_count",
                 "attention.head_count_kv", "attention.key_length", "attention.value_length",
                 "rope.dimension_count", "expert_feed_forward_length")  # expert counts may be 0: a dense model
POSITIVE_FLOATS = ("rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon",
                   "attention.layer_norm_epsilon")


def _check_numbers(arch: str, meta: dict[str, Any]) -> list[str]:
    """Sizes are positive integers and scales positive finite numbers, and the KV heads divide the
    query heads: a zero, a negative or a NaN here would divide by zero or compute noise."""
    import math

    out = []
    for sub in POSITIVE_INTS:
        v = meta.get(f"{arch}.{sub}")
        for x in (v if isinstance(v, list) else [v] if v is not None else []):
            if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
                out.append(f"key {arch}.{sub} is {x!r}; it must be a positive integer")
                break
    for sub in POSITIVE_FLOATS:
        v = meta.get(f"{arch}.{sub}")
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                              or v <= 0):
            out.append(f"key {arch}.{sub} is {v!r}; it must be a positive finite number")
    heads, kv = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.attention.head_count_kv")
    if isinstance(heads, int) and isinstance(kv, int) and heads > 0 and kv > 0 and heads % kv:
        out.append(f"key {arch}.attention.head_count_kv is {kv}, which does not divide head_count {heads}")
    return out


_BLK = re.compile(r"blk\.(\d+)\.(.+)$")


def _check_tensors(arch: str, meta: dict[str, Any], tensors: list[tuple[str, tuple[int, ...]]], rep: Report) -> None:
    top, per_layer = expected_tensors(arch, meta)
    try:
        layers = int(meta.get(f"{arch}.block_count", 0))
    except (TypeError, ValueError):
        layers = -1
    names = {n for n, _ in tensors}
    seen_layers: set[int] = set()
    kinds: set[str] = set()
    for name, _shape in tensors:
        m = _BLK.match(name)
        if m:
            i, part = int(m.group(1)), m.group(2)
            seen_layers.add(i)
            if part not in per_layer:
                rep.refused.append(f"tensor {name} is not honoured (kvcache's {arch} model has no such weight)")
            elif i >= layers:
                rep.refused.append(f"tensor {name} belongs to layer {i}, past {arch}.block_count = {layers}")
            else:
                kinds.add(f"tensor blk.*.{part}")
        elif name in top:
            kinds.add(f"tensor {name}")
        else:
            rep.refused.append(f"tensor {name} is not honoured (kvcache's {arch} model has no such weight)")
    rep.honoured.extend(sorted(kinds))
    for name, required in top.items():
        if required and name not in names:
            rep.refused.append(f"tensor {name} is missing; a {arch} model needs it")
    if 0 < layers <= 4096 and layers == len(seen_layers):
        for part, required in per_layer.items():
            if required is False:
                continue
            alt = required if isinstance(required, str) else None  # required unless this part is there
            gone = [i for i in range(layers)
                    if f"blk.{i}.{part}" not in names and (alt is None or f"blk.{i}.{alt}" not in names)]
            if gone:
                rep.refused.append(f"tensor blk.{gone[0]}.{part} is missing ({len(gone)} of {layers} layers "
                                   f"lack it); a {arch} model needs it")
    elif layers != len(seen_layers):
        rep.refused.append(f"key {arch}.block_count is {meta.get(f'{arch}.block_count')!r} but the file "
                           f"has tensors for {len(seen_layers)} layers")
