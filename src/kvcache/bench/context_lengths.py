"""``kvcache bench context``: decode tok/s and KV bytes per token at several context lengths, per KV spec.

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

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.measure import english_prompt, pregrow, resolve_spec, use_config, weight_bytes
from kvcache.bench.report import cell, run_meta
from kvcache.cliargs import one_weights, split_specs
from kvcache.errors import InvalidParams
from kvcache.peers.row import median, step_bytes

if TYPE_CHECKING:
    from kvcache.cache.config import CacheConfig
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "context"
ORDER = 20
OPTIONS = ("new_tokens", "repeats", "kv", "contexts", "weights")
QUICK = {"contexts": "256", "kv": "dynamic,int8", "new_tokens": 8, "repeats": 1}

DEFAULT_SPECS, QUICK_SPECS = "dynamic,fp16,int8,int4,sink", "dynamic,static"
DEFAULT_CONTEXTS, QUICK_CONTEXTS = "128,512,2048,8000", "256,1024"


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
        med = median
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


def _run_once(llm: LLM, ids: list[int], params: SamplingParams, seq):
    """One request on ``seq`` (kept afterwards), with the cache's accounting at its last token."""
    from kvcache.engine.generate import RequestRun

    run = RequestRun(llm.runner, llm.tokenizer, ids, params, seq=seq, keep_seq=True)
    for _ in run:
        pass
    return run.result, run.result.kv_stats


def bench_context(llm: LLM, specs: dict[str, CacheConfig], contexts: list[int], new: int, repeats: int,
                  progress=None) -> list[ContextRow]:
    from kvcache.engine.params import SamplingParams
    from kvcache.eval.fidelity import builtin_text

    wbytes = weight_bytes(llm.model)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    text = builtin_text()
    prompts = {c: english_prompt(llm, c, text) for c in contexts}
    rows: list[ContextRow] = []
    original = llm.cache_config
    for spec, cfg in specs.items():
        pregrow(use_config(llm, cfg), max(contexts) + new)
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
    use_config(llm, original)
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
    from kvcache.cache.config import CacheConfig, parse_kv_spec

    default = CacheConfig()
    return next((s for s in specs if parse_kv_spec(s) == default), None)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.engine.llm import LLM
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    quick = args.quick
    weights = one_weights(args)
    new = args.new_tokens if args.new_tokens is not None else (16 if quick else 64)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 2)
    if new < 2:
        raise InvalidParams(f"--new-tokens must be >= 2, got {new}")
    if repeats < 1:
        raise InvalidParams(f"--repeats must be >= 1, got {repeats}")
    contexts = parse_contexts(args.contexts if args.contexts is not None
                              else QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS)
    specs = split_specs(args.kv if args.kv is not None else (QUICK_SPECS if quick else DEFAULT_SPECS))
    if not specs:
        raise InvalidParams("--kv needs at least one cache spec, e.g. --kv dynamic,int8")
    model_context = ModelConfig.from_hf(read_config(resolve_model(args.model).path)).max_position
    configs = {s: resolve_spec(s, max(contexts) + new, model_context) for s in dict.fromkeys(specs)}
    check_contexts(contexts, new, model_context, configs)

    from tqdm import tqdm

    llm = LLM(args.model, threads=args.threads, weights=weights)
    bar = tqdm(total=len(configs) * len(contexts) * repeats, desc="bench context", file=sys.stderr)
    rows = bench_context(llm, configs, contexts, new, repeats, bar.update)
    bar.close()
    ref = reference_spec(list(configs))
    results = with_ratios([r.summary() for r in rows], ref)
    width = max(12, *(len(s) for s in configs))
    print(f"\ncontext: {llm.model_name}, {new} new tokens after a prompt of C tokens of English text, batch 1, "
          f"{llm.weights} weights, {torch.get_num_threads()} threads, median of {repeats} (min-max)")
    if repeats > 1:
        print("repeats keep the prompt's K/V where the spec still holds them; prefill s: runs that prefilled it all")
    if ref is None:
        print("(no fp32 dynamic row in --kv: the ratio columns are empty)")
    header = (f"{'kv':<{width}} {'tok/s':>7} {'min-max':>13} {'prefill s':>9} {'KV B/token':>10} {'KV held':>9} "
              f"{'GB/s':>6} {'tok/s vs fp32':>13} {'bytes vs fp32':>13}")
    for c in contexts:
        print(f"\ncontext {c} tokens")
        print(header)
        for r in results:
            if r["context"] != c:
                continue
            held = f"{r['kv_bytes_used'] / 2**20:.1f} MiB" if r["kv_bytes_used"] else "-"
            tok = f"{cell(r['tok_s_min'])}-{cell(r['tok_s_max'])}"
            vs_tok = "-" if r["tok_s_vs_ref"] is None else f"{r['tok_s_vs_ref']:.2f}x"
            vs_b = "-" if r["bytes_vs_ref"] is None else f"{r['bytes_vs_ref']:.3f}x"
            line = (f"{r['spec']:<{width}} {cell(r['tok_s']):>7} {tok:>13} {cell(r['prefill_s'], '.2f'):>9} "
                    f"{r['kv_bytes_per_token']:>10.0f} {held:>9} {cell(r['gb_s'], '.2f'):>6} {vs_tok:>13} {vs_b:>13}")
            print(line + (f"  ({r['note']})" if r["note"] else ""))
    print("\nKV B/token: bytes the cache holds / tokens stored, after the last step (windows and fp32 tails "
          "included); GB/s: (weights + KV read per step) x tok/s")
    if args.json:
        meta = run_meta(model=llm.model_name, weights=llm.weights, new_tokens=new, repeats=repeats, contexts=contexts,
                        kv=list(configs), reference=ref, prompt="pydoc_data.topics, first C tokens")
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def plot(plt, data: dict):
    from kvcache.bench.plots import finish

    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec in dict.fromkeys(r["spec"] for r in rows):
        mine = sorted((r for r in rows if r["spec"] == spec), key=lambda r: r["context"])
        xs = [r["context"] for r in mine]
        a.plot(xs, [r["tok_s"] for r in mine], marker="o", label=spec)
        b.plot(xs, [r["kv_bytes_used"] / 2**20 for r in mine], marker="o", label=spec)
    for ax, ylabel, title in ((a, "decode tok/s", "speed against context"),
                              (b, "KV held (MiB)", "KV memory against context")):
        ax.set_xscale("log", base=2)
        finish(ax, "context (tokens)", ylabel, title)
    return fig
