"""The kvcache side of ``kvcache bench context --long``: one KV spec in a process of its own.

The depth is reached by growing one sequence in stages: prefill the first C1 tokens of the
prompt, decode ``new`` tokens, then prefill the prompt on to C2 (the decoded tokens are truncated
away first, exactly, by the engine's own rule: a request whose sequence shares a prefix with its
prompt keeps that prefix and prefills the rest) and decode again, and so on up to the largest
context. One prefill of the largest context per spec thus gives every depth, and the prefill time
of C tokens is the sum of its stages' (the same tokens and the same attention work as one
prompt of C tokens, in a few forwards). A spec whose window has already dropped tokens cannot
keep a prefix; it prefills each context from scratch, and says so. A repeat at the same depth
keeps the prompt's K/V (its last token is recomputed) and decodes again.

Before any timing the pools are grown to the largest context, and a 512-token prompt is
prefilled into a fresh sequence (the reference the long prompts' throughput is compared with).
The process's resident set is sampled throughout (its peak), and read once more after the
largest context's last decode, the sequence still held, freed heap given back (as the engine does
when idle): what holding that context costs. Run as ``python -m kvcache.bench.longctx_child``
with a JSON request on stdin (bench/child.py); it prints one JSON line; status lines go to stderr.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

REFERENCE_PROMPT = 512  # the prompt every long prefill's throughput is compared with


def status(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def measure(req: dict[str, Any]) -> dict[str, Any]:
    """Everything one spec gives; ``req``: model, weights, spec, contexts, new, repeats, threads."""
    from kvcache.bench.measure import english_prompt, pregrow, resolve_spec, use_config, weight_bytes, weights_label
    from kvcache.bench.memory import PeakRss, rss_bytes
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams

    spec, contexts, new, repeats = str(req["spec"]), sorted(req["contexts"]), int(req["new"]), int(req["repeats"])
    llm = LLM(req.get("model"), threads=req.get("threads"), weights=str(req.get("weights", "file")), prefix=False)
    loaded = rss_bytes()
    cfg = resolve_spec(spec, contexts[-1] + new, llm.config.max_position)
    runner = use_config(llm, cfg)
    ids = english_prompt(llm, max(contexts[-1], REFERENCE_PROMPT))
    tag = f"kvcache {spec}"
    out: dict[str, Any] = {"spec": spec, "config": cfg.spec(), "model_name": llm.model_name,
                           "weights_label": weights_label(llm), "weight_bytes": weight_bytes(llm.model),
                           "rss_loaded": loaded, "prefill": [], "decode": []}
    with PeakRss() as peak:
        pregrow(runner, contexts[-1] + new)
        llm.generate([ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        ref = [_fresh_prefill(llm, ids[:REFERENCE_PROMPT]) for _ in range(repeats)]
        out["prefill"].append({"tokens": REFERENCE_PROMPT, "seconds": ref, "stages": 1})
        status(f"{tag}: prefill {REFERENCE_PROMPT} tokens {statistics.median(ref):.2f} s")
        out["decode"], grown, last = _grow(llm, ids, contexts, new, repeats, tag)
        out["prefill"] += grown
        from kvcache import hugepages

        hugepages.trim()  # as the engine does once idle
        stats = runner.stats()
        out["rss_after"] = rss_bytes()
        runner.free(last)
    out["rss_peak"] = peak.peak
    out["kv_used"] = stats.bytes_used if stats else 0
    out["kv_allocated"] = stats.bytes_allocated if stats else 0
    out["tokens_held"] = stats.tokens_stored if stats else 0
    return out


def _fresh_prefill(llm: Any, ids: list[int]) -> float:
    """Seconds to the first token of ``ids`` in a fresh sequence."""
    from kvcache.engine.params import SamplingParams

    r = llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return float(r.prefill_s)


def _grow(llm: Any, ids: list[int], contexts: list[int], new: int, repeats: int,
          tag: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
    """Decode rows and cumulative prefill rows per context, growing one sequence; returns them and
    the sequence (still held)."""
    from kvcache.engine.generate import RequestRun
    from kvcache.engine.params import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    seq = llm.runner.new_sequence()
    decode: list[dict[str, Any]] = []
    prefill: list[dict[str, Any]] = []
    total_s, stages, held = 0.0, 0, 0
    for c in contexts:
        row: dict[str, Any] = {"context": c, "tok_s": [], "kv_bytes_per_token": 0.0, "kv_bytes_used": 0,
                               "tokens_stored": 0}
        for i in range(repeats):
            if i == 0:
                status(f"{tag}: prefill {held} -> {c} tokens ...")
            run = RequestRun(llm.runner, llm.tokenizer, ids[:c], params, seq=seq, keep_seq=True)
            for _ in run:
                pass
            r = run.result
            if i == 0:
                if r.cached_tokens == 0:  # a window had dropped tokens: prefilled from scratch
                    total_s, stages = 0.0, 0
                total_s, stages = total_s + r.prefill_s, stages + 1
                prefill.append({"tokens": c, "seconds": [total_s], "stages": stages,
                                "stage_tokens": c - r.cached_tokens})
                status(f"{tag}: prefill {r.cached_tokens} -> {c} tokens {r.prefill_s:.1f} s "
                       f"({c / total_s:.0f} tok/s over the whole {c})")
            row["tok_s"].append(r.decode_tok_s)
            st = r.kv_stats
            if st is not None and st.tokens_stored:
                row.update(kv_bytes_per_token=st.bytes_used / st.tokens_stored, kv_bytes_used=st.bytes_used,
                           tokens_stored=st.tokens_stored)
        status(f"{tag}: decode {new} tokens after {c}: {statistics.median(row['tok_s']):.2f} tok/s")
        decode.append(row)
        held = c
    return decode, prefill, seq


if __name__ == "__main__":
    from kvcache.bench.child import child_main

    raise SystemExit(child_main(measure))
