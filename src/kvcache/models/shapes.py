"""Every weight's shape checked against the model's configuration before the model is built.

A file whose hyper-parameters and tensors disagree (a norm of 50 values in a model of hidden size
64) is refused with one line naming the tensor, the shape it has and the one the configuration
asks for, instead of a reshape or broadcasting error from deep inside the build. The rules cover
the Hugging Face names of the llama-style families (llama, mistral, qwen2, qwen3, phi3, gemma3 and
qwen3moe's attention and dense parts); a name no rule knows is left to its family's builder.
"""

from __future__ import annotations

import re
from typing import Any

from kvcache.errors import ModelLoadError
from kvcache.models.config import ModelConfig


def _rules(c: ModelConfig) -> list[tuple[re.Pattern, tuple[int, ...]]]:
    h, v, f, d = c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim
    q, k = c.num_heads * d, c.num_kv_heads * d
    norm = r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)"
    rules = [
        (r"(^|\.)embed_tokens\.weight", (v, h)), (r"^lm_head\.weight", (v, h)), (r"^model\.norm\.weight", (h,)),
        (rf"\.{norm}\.weight", (h,)),
        (r"\.self_attn\.q_proj\.weight", (q, h)), (r"\.self_attn\.k_proj\.weight", (k, h)),
        (r"\.self_attn\.v_proj\.weight", (k, h)), (r"\.self_attn\.o_proj\.weight", (h, q)),
        (r"\.self_attn\.q_proj\.bias", (q,)), (r"\.self_attn\.k_proj\.bias", (k,)), (r"\.self_attn\.v_proj\.bias", (k,)),
        *([(r"\.self_attn\.q_norm\.weight", (q,)), (r"\.self_attn\.k_norm\.weight", (k,))]  # OLMoE: all of q, of k
          if c.model_type == "olmoe" else [(r"\.self_attn\.(q|k)_norm\.weight", (d,))]),
        (r"\.self_attn\.qkv_proj\.weight", (q + 2 * k, h)),
    ]
    if c.attn_sink_logits:  # gpt-oss: a learned logit per query head
        rules += [(r"\.self_attn\.sinks(\.weight)?", (c.num_heads,)), (r"\.self_attn\.o_proj\.bias", (h,))]
    if c.family not in ("qwen3moe", "gptoss"):  # their layers' MLPs are experts of their own size
        rules += [(r"\.mlp\.(gate|up)_proj\.weight", (f, h)), (r"\.mlp\.down_proj\.weight", (h, f)),
                  (r"\.mlp\.gate_up_proj\.weight", (2 * f, h))]
    return [(re.compile(p + "$"), shape) for p, shape in rules]


def check_shapes(config: ModelConfig, state_dict: dict[str, Any]) -> None:
    """ModelLoadError naming the first weight whose shape is not the one ``config`` asks for; the
    values are tensors (anything with a ``shape``) or shapes as tuples."""
    if config.family == "gpt2":
        return  # its own names and layouts: its builder checks them
    rules = _rules(config)
    for name, w in state_dict.items():
        shape = tuple(int(x) for x in (w if isinstance(w, tuple) else getattr(w, "shape", ())))
        for pattern, want in rules:
            if pattern.search(name):
                if shape != want:
                    raise ModelLoadError(
                        f"the weight {name} has shape {list(shape)} where the model's configuration (hidden size "
                        f"{config.hidden_size}, {config.num_heads} heads of {config.head_dim}, {config.num_kv_heads} "
                        f"KV heads, FFN {config.intermediate_size}, vocabulary {config.vocab_size}) needs {list(want)}")
                break
