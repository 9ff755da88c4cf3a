"""Context benchmark: decode tok/s and KV bytes per token at several context lengths, per KV spec.

Each run prefills a prompt of exactly C tokens of English text (the Python documentation's topic
pages, shipped with the standard library) and decodes a fixed number of new tokens (EOS ignored),
batch 1. The weights load once; every spec gets its own runner. Before timing, the cache is grown
to the largest context, so no timed run pays a one-off pool resize. A repeat at the same context
keeps the prompt's K/V from the run before (as a chat turn would; only the prompt's last token is
recomputed) unless the spec has already dropped some of them (windows), so the prefill time comes
from the runs that prefilled the whole prompt. KV bytes are read from the cache's own accounting
after the last step, while the sequence is still alive: bytes held / tokens stored.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from kvcache.bench.decode import step_bytes, weight_bytes
from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.engine.llm import LLM
from kvcache.engine.params import SamplingParams
from kvcache.errors import InvalidParams
from kvcache.eval.fidelity import builtin_text

def split_specs(text: str) -> list[str]:
    """Split this suite's ``--kv`` into specs: comma-separated items, where an option
    (``key=value``) belongs to the spec before it. ``dynamic,fp16,int8,int4,sink`` is five specs,
    ``dynamic,int8,sinks=4,window=1024`` two (``dynamic`` and ``int8,sinks=4,window=1024``).
    With ``;`` the specs are separated explicitly: ``static,int4;dynamic``."""
    if ";" in text:
        return [s.strip().strip(",") for s in text.split(";") if s.strip().strip(",")]
    specs: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if "=" in item and specs:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def parse_contexts(text: str) -> list[int]:
    """``--contexts`` text -> sorted distinct context lengths (each at least 2 tokens)."""
    out: list[int] = []
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise InvalidParams(f"--contexts: {raw!r} is not an integer number of tokens") from None
        if value < 2:
            raise InvalidParams(f"--contexts: {value} is too short; a context needs at least 2 tokens")
        out.append(value)
    if not out:
        raise InvalidParams("--contexts needs at least one context length, e.g. --contexts 512,2048")
    return sorted(set(out))


def resolve_spec(spec: str, largest: int, model_context: int) -> CacheConfig:
    """The CacheConfig of a spec, with a static cache sized to hold the largest run when its
    ``max_tokens`` was left to the default."""
    cfg = parse_kv_spec(spec)
    if cfg.capacity == "static" and cfg.max_tokens is None:
        cfg = replace(cfg, max_tokens=max(min(model_context, 4096), largest))
    return cfg


def check_contexts(contexts: list[int], new: int, model_context: int, configs: dict[str, CacheConfig]) -> None:
    """Refuse a context that leaves no room for the new tokens (model context, static size)."""
    for c in contexts:
        if c + new > model_context:
            raise InvalidParams(f"--contexts: {c} + {new} new tokens exceeds the model's context of "
                                f"{model_context} tokens; use at most {model_context - new}")
        for spec, cfg in configs.items():
            if cfg.capacity == "static" and cfg.max_tokens is not None and c + new > cfg.max_tokens:
                raise InvalidParams(f"--contexts: {c} + {new} new tokens exceeds --kv {spec}'s "
                                    f"max_tokens={cfg.max_tokens}")


def english_prompt(llm: LLM, n: int, text: str | None = None) -> list[int]:
    """Exactly ``n`` token ids of English prose (the text repeats if it is too short)."""
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


@dataclass
class ContextRow:
    spec: str
    config: str
    context: int
    tok_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    gb_s: list[float] = field(default_factory=list)
    kv_bytes_per_token: float = 0.0  # bytes held / tokens stored, right after the last step
    kv_bytes_per_token_stored: int = 0  # the stored form of one token (quantized: without fp32 tail)
    kv_bytes_used: int = 0
    kv_bytes_allocated: int = 0
    tokens_stored: int = 0
    note: str = ""

    def summary(self) -> dict[str, object]:
        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "spec": self.spec, "config": self.config, "context": self.context,
            "tok_s": med(self.tok_s), "tok_s_min": min(self.tok_s, default=None),
            "tok_s_max": max(self.tok_s, default=None),
            "prefill_s": med(self.prefill_s), "prefill_s_min": min(self.prefill_s, default=None),
            "prefill_s_max": max(self.prefill_s, default=None), "full_prefills": len(self.prefill_s),
            "gb_s": med(self.gb_s),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_stored": self.kv_bytes_per_token_stored,
            "kv_bytes_used": self.kv_bytes_used, "kv_bytes_allocated": self.kv_bytes_allocated,
            "tokens_stored": self.tokens_stored, "note": self.note,
        }


def _pregrow(llm: LLM, tokens: int) -> None:
    """Grow the cache pools to hold one sequence of ``tokens`` tokens, then give the pages back."""
    cache = getattr(llm.runner, "cache", None)
    if cache is None or not hasattr(cache, "reserve"):
        return
    seq = cache.new_sequence()
    try:
        cache.reserve(seq, tokens)
    finally:
        cache.free(seq)


def _run_once(llm: LLM, ids: list[int], params: SamplingParams, seq):
    """One request on ``seq`` (kept afterwards), with the cache's accounting at its last token."""
    from kvcache.engine.generate import RequestRun

    run = RequestRun(llm.runner, llm.tokenizer, ids, params, seq=seq, keep_seq=True)
    for _ in run:
        pass
    return run.result, run.result.kv_stats


def bench_context(llm: LLM, specs: dict[str, CacheConfig], contexts: list[int], new: int, repeats: int,
                  progress=None) -> list[ContextRow]:
    from kvcache.engine.runner import ModelRunner

    wbytes = weight_bytes(llm.model)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    text = builtin_text()
    prompts = {c: english_prompt(llm, c, text) for c in contexts}
    rows: list[ContextRow] = []
    original = llm.cache_config
    for spec, cfg in specs.items():
        llm.cache_config = cfg
        llm.runner = ModelRunner(llm.model, cfg)
        _pregrow(llm, max(contexts) + new)
        llm.generate([prompts[contexts[0]][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for c in contexts:
            row = ContextRow(spec, llm.runner.cache_config.spec(), c)
            seq = llm.runner.new_sequence()
            for _ in range(repeats):
                r, stats = _run_once(llm, prompts[c], params, seq)
                row.tok_s.append(r.decode_tok_s)
                if r.cached_tokens == 0:
                    row.prefill_s.append(r.prefill_s)
                if stats is not None and stats.tokens_stored:
                    row.kv_bytes_per_token = stats.bytes_used / stats.tokens_stored
                    row.kv_bytes_per_token_stored = stats.bytes_per_token
                    row.kv_bytes_used, row.kv_bytes_allocated = stats.bytes_used, stats.bytes_allocated
                    row.tokens_stored = stats.tokens_stored
                row.gb_s.append(step_bytes(wbytes, int(row.kv_bytes_per_token), c, new) * r.decode_tok_s / 1e9)
                if progress:
                    progress()
            llm.runner.free(seq)
            if not cfg.uses_cache:
                row.note = "no cache: every step recomputes the context"
            rows.append(row)
        llm.runner = None  # type: ignore[assignment]  # free this spec's pools before the next
    llm.cache_config = original
    llm.runner = ModelRunner(llm.model, original)
    return rows


def with_ratios(results: list[dict[str, object]], reference: str | None) -> list[dict[str, object]]:
    """Add each row's tok/s and KV bytes per token relative to the reference spec's row at the
    same context (None where there is no reference)."""
    ref = {r["context"]: r for r in results if r["spec"] == reference}
    for r in results:
        base = ref.get(r["context"])
        tok, btok = (base or {}).get("tok_s"), (base or {}).get("kv_bytes_per_token")
        r["tok_s_vs_ref"] = r["tok_s"] / tok if tok and r["tok_s"] is not None else None  # type: ignore[operator]
        r["bytes_vs_ref"] = r["kv_bytes_per_token"] / btok if btok else None  # type: ignore[operator]
    return results


def reference_spec(specs: list[str]) -> str | None:
    """The first spec that is the default fp32 dynamic cache."""
    default = CacheConfig()
    return next((s for s in specs if parse_kv_spec(s) == default), None)
