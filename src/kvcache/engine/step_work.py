"""What a step's tokens cost: the scheduler's budget counts work, not tokens.

A prompt token at position ``p`` costs its share of the weights' products, the same at every
position, plus its attention over the ``p`` keys before it (capped by a layer's sliding window),
which grows with ``p``: on SmolLM2-135M's shape a token at depth 28,000 costs about 25 times
what one at the start costs. Counted in tokens, a step of 256 prompt tokens deep in a long
document takes seconds where a step of 256 tokens at its start takes a fraction of one, and a short
request that arrives meanwhile waits for the whole of it. Counted in work, every step of a long
prefill costs about as much as a step at depth 0, so the steps stay short however deep the document
goes, and a newcomer waits for one such step.

The unit is one token's weight products (``token_work(config)(0) == 1.0`` up to the attention over
itself); ``max_batch_tokens`` is a budget in that unit, so where attention is cheap (short
prompts, decodes, windowed layers) nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.models.config import ModelConfig

__all__ = ["token_work"]

# what an attention multiply-add over fp32 pages costs against one of the weights' int8 products
# (which VNNI runs four to a lane): timed prompt steps of SmolLM2-135M's shape on a Zen4 (2 cores,
# avx512vnni; BENCHMARKS.md, "Serving: short chats beside one long document") took 0.58 ms a token
# at depth 0 and 1.3, 1.75 and 9.7 ms at depths 1,770, 2,610 and 15,400: 2.8, 3.0 and 4.0 here
# (the deeper, the more of the keys come from memory rather than the caches). The scheduler counts
# with it while other requests are about: a step deep in a document then costs about its budget,
# and a request that arrives meanwhile waits for no more than that
ATTENTION_WEIGHT = 3.5
# the figure a document alone is counted with: its steps deep in the prompt carry two to three
# times the tokens, and each step reads the document's keys once for all of them (a 12,000-token
# prompt alone: 42 s in 156 steps, against 50 s in 304 steps counted with ATTENTION_WEIGHT)
ALONE_ATTENTION_WEIGHT = 1.5


def _weight_flops(config: ModelConfig) -> float:
    """Multiply-adds of the weights one token goes through (the experts it is routed to)."""
    h, hd = config.hidden_size, config.head_dim
    attn = h * hd * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o; k, v
    raw = config.raw or {}
    if raw.get("num_experts_per_tok") and raw.get("moe_intermediate_size"):
        ffn = 3 * h * int(raw["moe_intermediate_size"]) * int(raw["num_experts_per_tok"])
    else:
        ffn = (2 if config.model_type == "gpt2" else 3) * h * config.intermediate_size
    return float(config.num_layers * (attn + ffn) + h * config.vocab_size)


def token_work(config: ModelConfig, attention_weight: float = ATTENTION_WEIGHT) -> Callable[[int], float]:
    """``work(p)``: the cost of one token at position ``p``, in tokens at depth 0 (>= 1), an
    attention multiply-add counted as ``attention_weight`` of the weights' products."""
    weights = _weight_flops(config)
    windows = config.layer_windows or (None,) * config.num_layers
    per_key = 2.0 * config.num_heads * config.head_dim * attention_weight / weights  # K·q and w·V, a layer
    full = sum(1 for w in windows if w is None)
    capped = [w for w in windows if w is not None]

    def work(position: int) -> float:
        keys = full * position + sum(min(position, w) for w in capped)
        return 1.0 + per_key * keys

    return work
