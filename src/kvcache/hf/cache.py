"""KVCache: a ``transformers.Cache`` whose layers keep K/V in kvcache's pages.

``update(k, v, layer)`` stores the new tokens' K/V ([B, Hkv, T, D]) in the row's pages and returns
the K/V its queries may see ([B, Hkv, L, D], in the model's dtype): every token for full layers,
the window for sliding ones (the model's own, or ``window=N``), the sinks first when there are
any. ``get_mask_sizes`` tells transformers' masks where those keys sit. Beam search and
``batch_repeat_interleave`` fork rows (pages shared, copied only when a branch writes into a
shared partly filled page).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache

from kvcache.cache.accounting import CacheStats
from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.errors import InvalidParams
from kvcache.hf.layout import Layout, layout_of
from kvcache.hf.store import PageStore


class BridgeLayer(CacheLayerMixin):
    """One decoder layer's face towards transformers; the data lives in the shared PageStore."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, store: PageStore, index: int, sliding: bool) -> None:
        super().__init__()
        self.store, self.index, self.is_sliding = store, index, sliding

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.store.cache is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # set by CacheLayerMixin.__init__
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.update(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.store.mask_sizes(self.index, q)

    def get_seq_length(self) -> int:
        return self.store.written[self.index]

    def get_max_length(self) -> int:
        return self.store.max_length()

    def reset(self) -> None:
        pass  # the store resets once for all layers

    def offload(self) -> None:
        pass  # placement is the cache config's (host, disk)

    def prefetch(self) -> None:
        pass


class KVCache(Cache):
    """kvcache's paged cache as a ``transformers.Cache``; build it with ``make_cache``."""

    def __init__(self, layout: Layout, config: CacheConfig) -> None:
        self.layout, self.config = layout, config
        self.store = PageStore(layout, config)
        layers = [BridgeLayer(self.store, i, t == "sliding_attention") for i, t in enumerate(layout.layer_types)]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"KVCache({self.config.spec()!r}, rows={len(self.store.rows)}, tokens={self.store.length})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, Hkv, T, D] -> visible K, V: [B, Hkv, L, D]."""
        return self.store.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.written[layer_idx] if layer_idx < len(self.store.written) else 0

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:  # type: ignore[override]
        return self.layers[layer_idx].get_mask_sizes(query_length)  # type: ignore[union-attr]

    def reset(self) -> None:
        self.store.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select([int(i) for i in torch.as_tensor(indices).flatten().tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.select([i for i in range(len(self.store.rows)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        self.store.crop(tokens_to_remove)

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return len(self.store.rows) or -1

    # -- kvcache's side ---------------------------------------------------------------------------
    def fork(self, rows: int = 1) -> "KVCache":
        """A new cache whose ``rows`` rows each share this one's (single row's) pages."""
        store = self.store
        if store.pending:
            raise InvalidParams("cannot fork a cache in the middle of a forward")
        if len(store.rows) != 1:
            raise InvalidParams(f"fork copies a one-row cache; this one has {len(store.rows)} rows")
        assert store.cache is not None
        child = KVCache(self.layout, self.config)
        child.store.adopt(store, [store.cache.fork(store.rows[0]) for _ in range(rows)])
        return child

    def stats(self) -> CacheStats:
        """Pages, bytes allocated and used, per layer: of the pool this cache shares with its forks."""
        if self.store.cache is None:
            raise InvalidParams("the cache is empty: run a forward first")
        return self.store.cache.stats()

    def check_integrity(self) -> None:
        if self.store.cache is not None:
            self.store.cache.check_integrity()

    @property
    def kv_bytes(self) -> int:
        """Bytes the K/V of this cache's pool occupy (stored form, fp32 tails included)."""
        return self.stats().bytes_used if self.store.cache is not None else 0


def make_cache(model: Any, spec: str | CacheConfig | None = "dynamic") -> Cache:
    """A transformers cache for ``model`` (or its config) keeping K/V the way ``spec`` says
    (kvcache's ``--kv`` syntax: ``dynamic``, ``static,max_tokens=N``, ``int4``, ``offloaded``,
    ``disk,dir=PATH``, ``sinks=4,window=1024`` ...). Encoder–decoder models get an
    ``EncoderDecoderCache`` whose self-attention side is kvcache's."""
    config = parse_kv_spec(spec)
    if not config.uses_cache:
        raise InvalidParams("the 'none' strategy keeps no cache: call generate(..., use_cache=False) instead "
                            "of passing a cache")
    if config.press is not None:
        raise InvalidParams(f"press={config.press} runs in kvcache's own engine (LLM, generate, serve); the "
                            "transformers bridge keeps every token")
    hf_config = getattr(model, "config", model)
    cache = KVCache(layout_of(hf_config), config)
    if getattr(hf_config, "is_encoder_decoder", False):
        return EncoderDecoderCache(cache, DynamicCache())
    return cache
