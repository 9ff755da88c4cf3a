"""PromptCache: prefill a prefix once, then fork it per request instead of ``copy.deepcopy``.

A fork shares every page of the prefix (reference counts, no copy); the partly filled last page
is copied by the first branch that writes into it. Extending the prefix (the next chat turn)
prefills only the new tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcache.cache.config import CacheConfig
from kvcache.errors import InvalidParams
from kvcache.hf.cache import KVCache, make_cache


class PromptCache:
    def __init__(self, model: Any, spec: str | CacheConfig | None = "dynamic") -> None:
        if getattr(model.config, "is_encoder_decoder", False):
            raise InvalidParams("PromptCache serves decoder-only models; for encoder-decoder models pass "
                                "make_cache(model, spec) to generate")
        self.model = model
        root = make_cache(model, spec)
        assert isinstance(root, KVCache)
        self.root = root
        self.tokens: list[int] = []

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor | list[int]) -> "PromptCache":
        """Make the cached prefix ``input_ids`` ([T] or [1, T]); it must start with the tokens
        already cached, and only the tokens after them are computed."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).tolist()
        if ids[: len(self.tokens)] != self.tokens:
            raise InvalidParams("the new prefix does not start with the cached tokens; make a new PromptCache")
        new = ids[len(self.tokens):]
        if new:
            device = next(self.model.parameters()).device
            x = torch.tensor([new], dtype=torch.long, device=device)
            pos = torch.arange(len(self.tokens), len(ids), device=device)[None]
            self.model(input_ids=x, position_ids=pos, past_key_values=self.root, use_cache=True,
                       logits_to_keep=1)
            self.tokens = ids
        return self

    def fork(self, rows: int = 1, input_ids: torch.Tensor | None = None) -> KVCache:
        """A cache holding the prefix in ``rows`` rows, sharing its pages, to pass to ``generate``
        (with input ids that start with the prefix; checked when ``input_ids`` is given)."""
        if not self.tokens:
            raise InvalidParams("nothing to fork: call prefill(prefix_ids) first")
        if input_ids is not None:
            ids = torch.as_tensor(input_ids)
            ids = ids.reshape(-1, ids.shape[-1])  # [rows, T]
            n = len(self.tokens)
            if ids.shape[1] <= n or any(row[:n].tolist() != self.tokens for row in ids):
                raise InvalidParams(f"input_ids must start with the {n} cached prefix tokens and add at least one")
        return self.root.fork(rows)

    def stats(self):  # -> CacheStats
        return self.root.stats()
