"""Decode benchmark: new-token tok/s and time to first token, kvcache against HF transformers.

Same prompt, same fp32 weights (transformers loads the folder kvcache converted), same number of
new tokens (EOS ignored), batch 1, the same torch thread count; medians over repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from kvcache.engine.llm import LLM
from kvcache.engine.params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Row:
    system: str
    cache: str
    tok_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    gb_s: list[float] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, object]:
        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "system": self.system, "cache": self.cache, "tok_s": med(self.tok_s),
            "tok_s_min": min(self.tok_s, default=None), "tok_s_max": max(self.tok_s, default=None),
            "ttft_ms": (med(self.ttft_s) or 0) * 1000, "gb_s": med(self.gb_s), "note": self.note,
        }


def weight_bytes(model: torch.nn.Module, head: torch.Tensor | None = None) -> int:
    """Bytes of weights one decode step reads: every distinct parameter once, except embedding
    tables (a step reads one row of those), plus the output head. kvcache's own models count
    their quantized weights too (CausalLM.step_weight_bytes)."""
    if hasattr(model, "step_weight_bytes"):
        return int(model.step_weight_bytes())
    assert head is not None
    seen = {head.data_ptr()}
    total = head.numel() * head.element_size()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or any(key in name for key in ("embed", "wte", "wpe")):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def step_bytes(wbytes: int, kv_per_token: int, prompt_len: int, new: int) -> float:
    """Average bytes moved per decode step: all weights plus the K/V attended to."""
    avg_ctx = prompt_len + new / 2
    return wbytes + kv_per_token * avg_ctx


def bench_kvcache(llm: LLM, strategies: list[str], new: int, repeats: int, progress=None) -> list[Row]:
    from kvcache.engine.runner import ModelRunner
    from kvcache.config import parse_kv_spec

    ids = llm.encode(PROMPT, chat=True)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    wbytes = weight_bytes(llm.model)
    rows = []
    for strat in strategies:
        llm.cache_config = parse_kv_spec(strat)
        llm.runner = ModelRunner(llm.model, llm.cache_config)
        row = Row("kvcache", strat)
        llm.generate([ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(repeats):
            r = llm.generate([ids], params)[0]
            row.tok_s.append(r.decode_tok_s)
            row.ttft_s.append(r.prefill_s)
            kv = llm.config.kv_bytes_per_token() if strat != "none" else 0
            row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * r.decode_tok_s / 1e9)
            if progress:
                progress()
        rows.append(row)
    return rows


def bench_transformers(model_dir: str, ids: list[int], caches: list[str], new: int, repeats: int,
                       progress=None) -> list[Row]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return [Row("transformers", c, note="transformers not installed: skipped") for c in caches]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    wbytes = weight_bytes(model, model.get_output_embeddings().weight)
    kv_per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    ) * 4
    input_ids = torch.tensor([ids])
    rows = []
    for cache in caches:
        kwargs: dict[str, object] = {"use_cache": cache != "none"}
        if cache == "static":
            kwargs["cache_implementation"] = "static"
        row = Row("transformers", {"none": "use_cache=False", "dynamic": "DynamicCache", "static": "StaticCache"}[cache])
        gen = dict(do_sample=False, pad_token_id=model.config.eos_token_id, **kwargs)
        with torch.inference_mode():
            model.generate(input_ids[:, :8], max_new_tokens=4, min_new_tokens=4, **gen)  # warm-up
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **gen)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = model.generate(input_ids, max_new_tokens=new, min_new_tokens=new, **gen)
                total = time.perf_counter() - t0
                made = out.shape[1] - input_ids.shape[1]
                tok_s = (made - 1) / max(total - ttft, 1e-9)
                row.tok_s.append(tok_s)
                row.ttft_s.append(ttft)
                kv = kv_per_token if cache != "none" else 0
                row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * tok_s / 1e9)
                if progress:
                    progress()
        rows.append(row)
    return rows
