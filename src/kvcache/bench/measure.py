"""What the kvcache side of several bench suites shares: prompts of exactly N tokens of English
prose, distinct slices of it for the servers' load, the bytes and the label of the weights a step reads, a runner for a cache spec, and pools
grown before timing so that no timed run pays a one-off resize.

Imports nothing heavy at module level; a suite passes in the LLM it loaded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache.cache.config import CacheConfig
    from kvcache.engine.llm import LLM
    from kvcache.engine.runner import ModelRunner
    from kvcache.models.base import CausalLM


def english_slices(model: str | None, count: int, tokens: int, skip: int = 4000) -> list[str]:
    """``count`` distinct slices of the built-in English text, ``tokens`` tokens each by the model's
    tokenizer, from token ``skip`` on (wrapping around): prompts that share no prefix."""
    from kvcache.eval.fidelity import builtin_text
    from kvcache.models.loading import resolve_model
    from kvcache.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model(model).path)
    ids = tok.encode(builtin_text())
    out, at = [], skip
    for _ in range(count):
        if at + tokens > len(ids):
            at = 0
        out.append(tok.decode(ids[at : at + tokens]))
        at += tokens + 11
    return out


def english_prompt(llm: LLM, n: int, text: str | None = None) -> list[int]:
    """Exactly ``n`` token ids of English prose (the text repeats if it is too short)."""
    from kvcache.eval.fidelity import builtin_text

    text = text or builtin_text()
    chars = max(64, n * 6)
    while True:
        piece = text
        while len(piece) < chars:
            piece += "\n\n" + text
        ids = llm.encode(piece[:chars])
        if len(ids) >= n:
            return ids[:n]
        chars *= 2


def weight_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode step reads (CausalLM.step_weight_bytes: quantized weights at
    their own size, input embedding tables not counted)."""
    return int(model.step_weight_bytes())


def weights_label(llm: LLM) -> str:
    """``file (Q4_1)`` for a GGUF's own types, else the mode (``q8``, ``q4``, ``fp32``)."""
    if llm.weights != "file":
        return llm.weights
    from kvcache.peers.row import shipped_type

    kind = shipped_type(llm.model_path) if llm.model_path.endswith(".gguf") else None
    return f"file ({kind})" if kind else "file"


def resolve_spec(spec: str, largest: int, model_context: int) -> CacheConfig:
    """The CacheConfig of a spec, with a static cache sized to hold the largest run when its
    ``max_tokens`` was left to the default."""
    from kvcache.cache.config import parse_kv_spec

    cfg = parse_kv_spec(spec)
    if cfg.capacity == "static" and cfg.max_tokens is None:
        cfg = replace(cfg, max_tokens=max(min(model_context, 4096), largest))
    return cfg


def use_config(llm: LLM, cfg: CacheConfig) -> ModelRunner:
    """Give ``llm`` a fresh runner (its own pools) for the cache config ``cfg``; returns it."""
    from kvcache.engine.runner import ModelRunner

    llm.cache_config = cfg
    llm.runner = ModelRunner(llm.model, cfg)
    return llm.runner


def pregrow(runner: ModelRunner, tokens: int) -> None:
    """Grow the pools to hold one sequence of ``tokens`` tokens, then give the pages back."""
    seq = runner.new_sequence()
    try:
        if seq.kv is not None and runner.cache is not None:
            runner.cache.reserve(seq.kv, tokens)
    finally:
        runner.free(seq)


def products_bandwidth(model: object, repeats: int = 3) -> float | None:
    """GB/s at which the quantized products alone read a model's weights: one row through every
    quantized weight a decode step multiplies by, in turn (a step's products without its attention,
    norms, sampling or Python), the best of ``repeats``. The ceiling a decode can reach on this
    machine's memory with these kernels, beside ``read_bandwidth``'s plain read. None for a model
    without quantized weights."""
    import time

    import torch

    tables = {id(t) for t in model.lookup_tables()}  # type: ignore[attr-defined]
    ws = [w for w in model.quantized_weights() if id(w) not in tables]  # type: ignore[attr-defined]
    if not ws:
        return None
    xs = {w.k: torch.randn(1, w.k) for w in ws}
    nbytes = sum(w.nbytes for w in ws)

    def products() -> None:
        for w in ws:
            w.forward(xs[w.k])

    products()  # pages and the kernels' scratch in place, not timed
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        products()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def read_bandwidth(threads: int | None = None, gib: float = 1.0, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in GB/s, measured now: the best of ``repeats`` reads of
    a ``gib`` GiB float32 vector (every byte once, far larger than any cache) on ``threads`` torch
    threads: kernels/membw.c's streaming sum (vector accumulators and software prefetch, as the
    quantized products read weights), else torch's dot product of the vector with itself. The
    vector is allocated as the weights are (numpy: huge pages where the kernel allows them, which
    reads a third faster than 4 KiB pages on the reference host)."""
    import time

    import torch

    from kvcache import kernels

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        import numpy as np

        # numpy asks the kernel for huge pages on large arrays, as for the weights the kernels read
        x = torch.from_numpy(np.ones(int(gib * 2**30) // 4, np.float32))
        read = (lambda: kernels.stream_sum(x)) if kernels.stream_sum(x) is not None else (lambda: torch.dot(x, x))
        read()  # pages touched, not timed
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(old)
