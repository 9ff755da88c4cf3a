"""The well-known models ``kvcache size`` sizes by name: their public config.json values (what the
KV and weight sizes depend on). Imports nothing: the command line lists the names in its help
without loading torch."""

from __future__ import annotations

from typing import Any

_COMMON = {"vocab_size": 32000, "intermediate_size": 1, "hidden_act": "silu"}
# public config.json values of well-known models (what the KV and weight sizes depend on)
KNOWN: dict[str, dict[str, Any]] = {
    "Llama-2-7B": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "hidden_size": 4096, "max_position_embeddings": 4096,
                   "intermediate_size": 11008, "vocab_size": 32000},
    "Llama-3-8B": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096, "max_position_embeddings": 8192,
                   "intermediate_size": 14336, "vocab_size": 128256},
    "Llama-3-70B": {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "hidden_size": 8192, "max_position_embeddings": 8192,
                    "intermediate_size": 28672, "vocab_size": 128256},
    "Mistral-7B": {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096, "max_position_embeddings": 32768,
                   "sliding_window": 4096, "intermediate_size": 14336, "vocab_size": 32000},
    "Qwen2.5-7B": {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "hidden_size": 3584, "max_position_embeddings": 32768,
                   "intermediate_size": 18944, "vocab_size": 152064},
    "Gemma-3-27B": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
                    "max_position_embeddings": 131072, "sliding_window": 1024, "intermediate_size": 21504,
                    "vocab_size": 262208, "tie_word_embeddings": True,
                    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                    for i in range(62)]},
    "Phi-3-mini": {"model_type": "phi3", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "hidden_size": 3072, "max_position_embeddings": 4096,
                   "sliding_window": 2047, "intermediate_size": 8192, "vocab_size": 32064},
    "Llama-3.2-1B": {"model_type": "llama", "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2048,
                     "max_position_embeddings": 131072, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "Llama-3.2-3B": {"model_type": "llama", "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 3072,
                     "max_position_embeddings": 131072, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "SmolLM2-135M": {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "hidden_size": 576, "max_position_embeddings": 8192,
                     "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True},
}
_ALIASES = {None: "SmolLM2-135M", "smollm2": "SmolLM2-135M"}


def known_names() -> str:
    return ", ".join(KNOWN)
