"""Layer groups: layers that see the same tokens share page tables.

Each layer's visibility comes from the cache config (``window``, ``sinks``) and the model's own
sliding layers (Gemma 3, Mistral). Layers with the same visibility form a group with its own
pool and allocator, so pages that fall out of a sliding layer's window go back to that group's
pool while full-attention layers keep theirs (hybrid per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache.cache.config import CacheConfig

if TYPE_CHECKING:  # the model's shape comes in; the cache imports nothing of models/
    from kvcache.models.config import ModelConfig


@dataclass(frozen=True)
class LayerGroup:
    index: int
    layers: tuple[int, ...]
    window: int | None  # tokens a query sees (sinks included); None: all before it
    sinks: int  # first tokens kept beside the window (re-positioned, StreamingLLM)

    @property
    def recent(self) -> int | None:
        """How many of the latest tokens (the query's own included) the window shows."""
        return None if self.window is None else self.window - self.sinks

    def dead_before(self, next_pos: int) -> int:
        """Positions below this (except sinks) are never seen again by a query at ``next_pos`` or
        later."""
        return 0 if self.window is None else max(0, next_pos - self.window + self.sinks + 1)


def layer_visibility(model: ModelConfig, config: CacheConfig, layer: int) -> tuple[int | None, int]:
    """(window, sinks) of one layer."""
    own = model.layer_windows[layer] if model.layer_windows else None
    user = config.window
    if own is None:
        return (user, config.sinks) if user is not None else (None, 0)
    if user is not None and user < own:
        return user, config.sinks
    return own, 0


def plan_groups(model: ModelConfig, config: CacheConfig) -> list[LayerGroup]:
    """Group layers by visibility, groups ordered by their first layer."""
    by_vis: dict[tuple[int | None, int], list[int]] = {}
    for i in range(model.num_layers):
        by_vis.setdefault(layer_visibility(model, config, i), []).append(i)
    return [LayerGroup(g, tuple(layers), vis[0], vis[1]) for g, (vis, layers) in enumerate(by_vis.items())]
