"""Decode benchmark, kvcache's side: new-token tok/s and time to first token, prompt tok/s of a
fresh prefill, and decode at a long context, for one loaded model (one weights mode). Rows are
``bench.rows.Row``, the shape every system's rows share.
"""

from __future__ import annotations

import time

from kvcache.bench.rows import Row, Tick, step_bytes
from kvcache.engine.llm import LLM
from kvcache.engine.params import SamplingParams
from kvcache.engine.runner import ModelRunner
from kvcache.models.base import CausalLM

__all__ = ["PROMPT", "Row", "Tick", "bench_decode", "bench_depth", "bench_prefill", "step_bytes", "weight_bytes"]

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def weight_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode step reads (CausalLM.step_weight_bytes: quantized weights at
    their own size, input embedding tables not counted)."""
    return int(model.step_weight_bytes())


def weights_label(llm: LLM) -> str:
    """``file (Q4_1)`` for a GGUF's own types, else the mode (``q8``, ``q4``, ``fp32``)."""
    if llm.weights != "file":
        return llm.weights
    stem = llm.model_path.rsplit("/", 1)[-1]
    kind = stem[:-5].rsplit(".", 1)[-1] if stem.endswith(".gguf") and "." in stem[:-5] else ""
    return f"file ({kind})" if kind else "file"


def _runner(llm: LLM, spec: str) -> ModelRunner:
    from kvcache.cache.config import parse_kv_spec

    llm.cache_config = parse_kv_spec(spec)
    llm.runner = ModelRunner(llm.model, llm.cache_config)
    return llm.runner


def _pregrow(runner: ModelRunner, tokens: int) -> None:
    """Grow the pools to hold ``tokens`` (no timed run pays a pool resize), then give the pages back."""
    seq = runner.new_sequence()
    try:
        if seq.kv is not None and runner.cache is not None:
            runner.cache.reserve(seq.kv, tokens)
    finally:
        runner.free(seq)


def bench_decode(llm: LLM, ids: list[int], strategies: list[str], new: int, repeats: int,
                 tick: Tick | None = None) -> list[Row]:
    """Decode after the prompt ``ids``, one row per cache strategy."""
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    wbytes, label = weight_bytes(llm.model), weights_label(llm)
    rows = []
    for strat in strategies:
        _runner(llm, strat)
        row = Row("kvcache", label, strat, pair=llm.weights, tokens=len(ids))
        llm.generate([ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(repeats):
            r = llm.generate([ids], params)[0]
            row.tok_s.append(r.decode_tok_s)
            row.ttft_s.append(r.prefill_s)
            kv = llm.config.kv_bytes_per_token() if strat != "none" else 0
            row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * r.decode_tok_s / 1e9)
            if tick:
                tick()
        rows.append(row)
    return rows


def bench_prefill(llm: LLM, prompts: dict[int, list[int]], repeats: int, tick: Tick | None = None) -> list[Row]:
    """Prompt tokens per second of one runner step over a fresh sequence (dynamic fp32 cache),
    one row per prompt length."""
    runner = _runner(llm, "dynamic")
    _pregrow(runner, max(prompts))
    warm = runner.new_sequence()
    runner.step([warm], [next(iter(prompts.values()))[:16]])  # warm-up
    runner.free(warm)
    rows = []
    for n, ids in prompts.items():
        row = Row("kvcache", weights_label(llm), "dynamic", pair=llm.weights, test="prefill", tokens=n)
        for _ in range(repeats):
            seq = runner.new_sequence()
            t0 = time.perf_counter()
            runner.step([seq], [ids])
            row.tok_s.append(n / (time.perf_counter() - t0))
            runner.free(seq)
            if tick:
                tick()
        rows.append(row)
    return rows


def bench_depth(llm: LLM, ids: list[int], spec: str, new: int, repeats: int, tick: Tick | None = None) -> Row:
    """Decode ``new`` tokens after a context of ``len(ids)`` tokens held in a ``spec`` cache; the
    context is prefilled once and kept, every repeat decodes from the same point."""
    runner = _runner(llm, spec)
    _pregrow(runner, len(ids) + new)
    row = Row("kvcache", weights_label(llm), spec, pair=llm.weights, test="depth", tokens=len(ids))
    from kvcache.engine.generate import RequestRun

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    seq = runner.new_sequence()
    wbytes = weight_bytes(llm.model)
    try:
        for _ in range(repeats):
            run = RequestRun(runner, llm.tokenizer, ids, params, seq=seq, keep_seq=True)
            for _ in run:
                pass
            r = run.result
            row.tok_s.append(r.decode_tok_s)
            if r.cached_tokens == 0:
                row.ttft_s.append(r.prefill_s)
            st = r.kv_stats
            kv = st.bytes_used / st.tokens_stored if st is not None and st.tokens_stored else 0.0
            row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * r.decode_tok_s / 1e9)
            if tick:
                tick()
    finally:
        runner.free(seq)
    return row
