"""Layer-ahead fetching for offloaded caches (host memory beside a GPU, or disk).

While layer i computes, a worker thread brings layer i+1's stored K/V to the compute device
(on a GPU: non-blocking copies on a side stream), so the transfer hides behind the compute, as in
transformers' offloaded cache. Torch releases the GIL inside its ops, so the thread runs alongside.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-prefetch")


class Prefetcher:
    """Runs ``load(layer)`` (per sequence, the layer's K/V on ``compute``) one layer ahead."""

    def __init__(self, load: Callable[[int], list[torch.Tensor]], compute: torch.device) -> None:
        self.load = load
        self.pending: dict[int, Future] = {}
        self.stream = torch.cuda.Stream(compute) if compute.type == "cuda" else None

    def _load(self, layer: int) -> list[torch.Tensor]:
        if self.stream is None:
            return self.load(layer)
        with torch.cuda.stream(self.stream):
            out = self.load(layer)
        self.stream.synchronize()
        return out

    def start(self, layer: int) -> None:
        if layer not in self.pending:
            self.pending[layer] = _POOL.submit(self._load, layer)

    def take(self, layer: int) -> list[torch.Tensor]:
        self.start(layer)
        return self.pending.pop(layer).result()
