"""Next-token masks for a step's constrained samples (engine/grammar.py's matchers), computed on a
worker thread beside the forward pass, or on the engine thread for the samples whose choice the
grammar refused."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _background() -> None:
    """The mask thread runs at the lowest priority (Linux: a thread's nice value is its own, and the
    threads it starts inherit it): on a machine whose cores all run the forward it takes the CPU
    only where the forward leaves it idle, and at the latest when the step waits for the masks."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
        pass


class MaskWorker:
    """Next-token masks for a step's constrained samples. With a core to spare (more cores than
    torch threads), ``start`` computes them on a worker thread while the forward runs: it takes
    the matchers (each in the state after its last token) and returns a future of their masks
    [len(matchers), W] (int32), row i for matcher i. Without one, the mask thread could only take
    CPU from the forward (measured by `kvcache bench structured`), so the scheduler checks each
    sample's choice against its grammar instead and calls ``compute`` (on its own thread) only for
    the samples whose choice the grammar refuses. The worker thread runs at the lowest priority;
    masks for several samples go through llguidance's executor (``threads`` threads)."""

    def __init__(self, words: int, threads: int = 2) -> None:
        import os

        import torch

        self.words = words
        self.spare_core = (os.cpu_count() or 1) > torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvcache-masks", initializer=_background)
        self._executor: Any = None  # the worker thread's
        self._executor_here: Any = None  # the engine thread's
        self._threads = threads
        self.mask_s = 0.0  # time spent computing masks (on the worker)
        self.masks = 0

    def start(self, matchers: list[Any]) -> Future:
        return self._pool.submit(self._compute, list(matchers), "_executor")

    def compute(self, matchers: list[Any]) -> torch.Tensor:
        """The masks, on the calling thread (its own executor: the worker's threads run at the lowest priority)."""
        return self._compute(list(matchers), "_executor_here")

    def _compute(self, matchers: list[Any], executor: str) -> torch.Tensor:
        import time

        import llguidance
        import torch

        t0 = time.perf_counter()
        out = torch.zeros(len(matchers), self.words, dtype=torch.int32)
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(out.data_ptr(), self.words * 4)
        elif matchers:
            if getattr(self, executor) is None:
                setattr(self, executor, llguidance.LLExecutor(num_threads=self._threads))
            getattr(self, executor).unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.data_ptr(),
                                                            self.words * 4, len(matchers))
        self.mask_s += time.perf_counter() - t0
        self.masks += len(matchers)
        return out
