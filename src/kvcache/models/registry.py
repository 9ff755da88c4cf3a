"""ModelConfig.family -> native model class."""

from __future__ import annotations


from kvcache.errors import UnsupportedArchitecture
from kvcache.models.base import CausalLM
from kvcache.models.config import FAMILIES, ModelConfig
from kvcache.models.shapes import check_shapes


def build_model(config: ModelConfig, state_dict: dict, weights: str = "fp32") -> CausalLM:
    """Instantiate the native model for ``config`` from HF-named weights (fp32 tensors, or
    quantized GGUF tensors for the ``file`` mode), holding them as ``weights`` says."""
    if config.model_type not in FAMILIES:
        raise UnsupportedArchitecture(
            f"unsupported architecture {config.model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    check_shapes(config, state_dict)
    family = config.family
    if family == "llama":
        from kvcache.models.llama import LlamaForCausalLM as cls
    elif family == "qwen3moe":
        from kvcache.models.qwen3moe import Qwen3MoeForCausalLM as cls  # type: ignore[assignment]
    elif family == "gptoss":
        from kvcache.models.gptoss import GptOssForCausalLM as cls  # type: ignore[assignment]
    elif family == "gemma3":
        from kvcache.models.gemma3 import Gemma3ForCausalLM as cls  # type: ignore[assignment]
    else:
        from kvcache.models.gpt2 import GPT2ForCausalLM as cls  # type: ignore[assignment]
    return cls.from_state_dict(config, state_dict, weights)
