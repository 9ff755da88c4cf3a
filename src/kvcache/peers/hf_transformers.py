"""transformers as a peer: its causal LM of the fp32 folder kvcache converted (the weights of
kvcache's ``fp32`` mode), or a row that says it is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NO_TRANSFORMERS = "transformers not installed: skipped"


def transformers_model(model_dir: str | Path) -> Any | None:
    """transformers' causal LM of ``model_dir`` in fp32, in eval mode (kvcache's fp32 folder,
    ``models.loading.fp32_folder``: the weights of kvcache's ``fp32`` mode); None when transformers
    is not installed (its rows then say ``NO_TRANSFORMERS``)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    import torch

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
