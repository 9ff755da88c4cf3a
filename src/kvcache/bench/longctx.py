"""``kvcache bench context --long``: decode and prefill at depth, kvcache's KV encodings beside
llama.cpp's on the same GGUF, with the memory-bandwidth wall and the memory each encoding holds.

One command measures, on one model:

- kvcache decode tok/s after N tokens of context (default 4096, 16384, 32768) for each KV spec
  (default fp16, bf16, int8, int4, int2; any spec ``--kv`` names passes through), each spec in a
  process of its own (``python -m kvcache.bench.longctx``), so a crash is that spec's skipped rows and the
  resident-set figures of one spec never mix with another's;
- llama-bench beside it: ``-d N -fa 1 -ctk X -ctv X`` for X in f16,
  q8_0, q4_0 (``--peers``), and prefill ``-p N -fa 1``; a missing binary or a crash is a skipped
  row with the reason;
- prefill of N-token prompts on both sides, in seconds per 1k tokens and against the 512-token
  prompt's throughput;
- the read bandwidth, measured in the same run before and after the systems (the best of the two:
  kernels/membw.c's streaming read, as ``bench decode`` reports it), and for each decode figure
  the bytes one step reads (weights + the KV it attends to at that depth) and the share of that
  bandwidth it achieves (the arithmetic below);
- resident memory per spec at the largest context, beside ``kvcache size``'s figure.

How depth is reached: kvcache grows one sequence per spec in stages, 4096 -> 16384 -> 32768,
decoding at each stage; before the next stage the decoded tokens are truncated away by the
engine's own rule (a kept sequence shares the prompt's prefix; what follows it goes), which is
exact: the cache then equals one that never saw them. So each spec pays one prefill of the
largest context, and the prefill of N tokens is timed as the sum of its stages. llama-bench has
no such path: it prefills every depth of every KV type itself (untimed), which makes its side
the longer part of a full run.

``--quick``: contexts 256, 1024, 8 new tokens, 1 repeat, fp16 and int8, a quarter-GiB read probe
(for tests; the bundled model). JSON (``--json``/``--out``): ``meta``, ``results`` (one row per system, KV, test and
context) and ``memory``.

kvcache's side, one spec a process: the depth is reached by growing one sequence in stages:
prefill the first C1 tokens of the prompt, decode ``new`` tokens, then prefill the prompt on to C2 (the decoded tokens are truncated
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
when idle): what holding that context costs. Run as ``python -m kvcache.bench.longctx``
with a JSON request on stdin (peers/process.py); it prints one JSON line; status lines go to stderr.

llama.cpp's side, decode at depth: one run per KV type,
``llama-bench -p 0 -n NEW -d N1,N2,.. -fa 1 -ctk X -ctv X`` (it prefills each depth once, untimed, and restores that state for its repeats). Prefill: one
run ``-p 512 -n 0 -fa 1`` (with its warm-up) and one ``-p N1,N2,.. -n 0 -fa 1 --no-warmup -r 1``
(a warm-up would run each long prompt twice), f16 KV, llama-bench's defaults otherwise. A run
that cannot start, crashes or prints no JSON leaves its rows skipped with the reason; a
missing llama-bench skips them all, naming what is missing (peers/llama_bench.py, ``depth_rows``).

The bytes a llama.cpp step reads are counted as ``bench decode`` counts them: the GGUF file's
size (a tied model's file holds each weight once), plus the KV at its type's block size.

The arithmetic (free of torch and of the engine: plain arithmetic on what the processes measured):

- bytes per token (a decode step): the weights one step reads plus the KV it attends to,
  ``weights + kv_per_context_token * (context + new / 2)`` (rows.step_bytes: the context grows by
  one each step, so the average step sees ``new / 2`` more than the depth);
- GB/s: bytes per token x tok/s; share of the wall: GB/s / the read bandwidth measured in the run;
- prefill: the median seconds of the whole prompt; s per 1k: seconds x 1000 / tokens; vs 512:
  tok/s over the same system's (and KV's) 512-token prompt tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.bench.rows import Headline, beside_same_file, suite_parts
from kvcache.errors import InvalidParams
from kvcache.peers.llama_bench import KV_TYPE_BYTES, depth_rows
from kvcache.peers.row import DepthRow

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "context"
MODE = "long"  # run instead of the suite's own module when --long is given
ORDER = 21
OPTIONS = ("new_tokens", "repeats", "kv", "contexts", "weights", "peers", "llama_cpp_bin")

REFERENCE = 512  # prompt tokens every prefill is compared with


def summarize(rows: list[DepthRow], read_gb_s: float | None) -> list[dict[str, object]]:
    """Every row's summary, prefill rows with ``vs_512`` (tok/s over the same system and KV's
    512-token prompt; None without one)."""
    out = [r.summary(read_gb_s) for r in rows]
    ref = {(r["system"], r["kv"]): r["tok_s"] for r in out if r["test"] == "prefill" and r["context"] == REFERENCE}
    for r in out:
        if r["test"] == "prefill":
            base, tok = ref.get((r["system"], r["kv"])), r["tok_s"]
            r["vs_512"] = tok / base if tok and base else None  # type: ignore[operator]
    return out


def _n(x: object, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _mb(x: object) -> str:
    return "-" if not x else f"{float(x) / 1e6:,.1f} MB"  # type: ignore[arg-type]


def _mib(x: object) -> str:
    return "-" if not x else f"{float(x) / 2**20:,.1f} MiB"  # type: ignore[arg-type]


def _of_test(results: list[dict[str, object]], test: str) -> list[dict[str, object]]:
    """The rows of one test, by context, kvcache's first."""
    rows = [r for r in results if r["test"] == test]
    return sorted(rows, key=lambda r: (r["context"], r["system"] != "kvcache"))  # type: ignore[arg-type,return-value]


def _skipped(r: dict[str, object], blanks: int) -> str:
    """A table line for a row that was skipped, with its reason and ``blanks`` empty cells after it."""
    return f"| {r['context']} | {r['system']} | {r['kv']} | skipped: {r['note']} |" + " |" * blanks


def decode_table(results: list[dict[str, object]]) -> list[str]:
    lines = ["| context | system | kv | tok/s (min-max) | KV B/context token | bytes read/token | GB/s | share of wall |",
             "|---|---|---|---|---|---|---|---|"]
    for r in _of_test(results, "decode"):
        if r["tok_s"] is None:
            lines.append(_skipped(r, 4))
            continue
        share = r["wall_share"]
        lines.append(f"| {r['context']} | {r['system']} | {r['kv']} | {_n(r['tok_s'], '.2f')} "
                     f"({_n(r['tok_s_min'], '.2f')}-{_n(r['tok_s_max'], '.2f')}) | {_n(r['kv_bytes_per_token'], ',.0f')} "
                     f"| {_mb(r['bytes_per_token'])} | {_n(r['gb_s'], '.2f')} | "
                     f"{'-' if share is None else f'{100 * share:.0f}%'} |")  # type: ignore[operator]
    return lines


def prefill_table(results: list[dict[str, object]]) -> list[str]:
    lines = ["| prompt | system | kv | seconds | tok/s | s per 1k tokens | vs 512 |", "|---|---|---|---|---|---|---|"]
    for r in _of_test(results, "prefill"):
        if r["seconds"] is None:
            lines.append(_skipped(r, 3))
            continue
        vs = r["vs_512"]
        lines.append(f"| {r['context']} | {r['system']} | {r['kv']} | {_n(r['seconds'], '.2f')} | {_n(r['tok_s'], '.0f')} "
                     f"| {_n(r['s_per_1k'], '.2f')} | {'-' if vs is None else f'{vs:.2f}x'} |")
    return lines


def memory_table(memory: list[dict[str, object]]) -> list[str]:
    lines = ["| kv | context | KV held | KV allocated | `kvcache size` | RSS loaded | RSS at depth | RSS peak |",
             "|---|---|---|---|---|---|---|---|"]
    for m in memory:
        if m.get("note"):
            lines.append(f"| {m['kv']} | {m['context']} | skipped: {m['note']} | | | | | |")
            continue
        lines.append(f"| {m['kv']} | {m['context']} | {_mib(m['kv_used'])} | {_mib(m['kv_allocated'])} | "
                     f"{_mib(m['size_bytes'])} | {_mib(m['rss_loaded'])} | {_mib(m['rss_after'])} | "
                     f"{_mib(m['rss_peak'])} |")
    return lines


def print_report(meta: dict[str, object], results: list[dict[str, object]], memory: list[dict[str, object]]) -> None:
    bw = meta.get("read_gb_s")
    print(f"\nlong context: {meta['model']} ({meta['weights']} weights), batch 1, {meta['threads']} threads, "
          f"{meta['new_tokens']} new tokens per decode, median of {meta['repeats']}")
    print(f"host: {meta.get('host')}")
    load = meta.get("load_avg_1min")
    if isinstance(load, dict):
        print(f"load average (1 min) before the run {load['before']:.2f}, after {load['after']:.2f} (this run's own "
              f"{meta['threads']} threads included after; more than that means other processes shared the cores)")
    print(f"memory read bandwidth measured in this run: {_n(bw)} GB/s (a streaming read of "
          f"{meta.get('read_gib', 1.0):g} GiB, the best of "
          "the probes before and after); share of wall: a decode's GB/s as a share of it")
    print("kvcache reaches each depth by growing one sequence per spec in stages (one prefill of the largest "
          "context); llama-bench prefills every depth itself (-d N -fa 1 -ctk X -ctv X)")
    print("\ndecode after N tokens of context\n")
    print("\n".join(decode_table(results)))
    print("\nprefill of an N-token prompt (kvcache: the sum of its stages; llama.cpp: llama-bench -p N -fa 1, "
          "f16 KV)\n")
    print("\n".join(prefill_table(results)))
    if memory:
        print("\nmemory at the largest context (kvcache, each spec in its own process)\n")
        print("\n".join(memory_table(memory)))
    print("\nbytes read/token: the weights a step reads + KV B/context token x (N + new/2); KV B/context token: "
          "kvcache's own accounting (quantized: scales and the fp32 tail included), llama.cpp's from its KV "
          "type's block size; RSS at depth: resident after the last decode with the sequence held, freed heap "
          "given back; `kvcache size`: its KV bytes for the same tokens")


DEFAULT_CONTEXTS, QUICK_CONTEXTS = "4096,16384,32768", "256,1024"
DEFAULT_SPECS, QUICK_SPECS = "fp16,bf16,int8,int4,int2", "fp16,int8"
DEFAULT_PEERS = "f16,q8_0,q4_0"
DEFAULT_NEW, QUICK_NEW = 32, 8
DEFAULT_REPEATS, QUICK_REPEATS = 2, 1
CHILD_TIMEOUT_S = 6 * 3600.0


@dataclass(frozen=True)
class Plan:
    model: str | None
    gguf: Path | None  # the model's GGUF file, for llama.cpp (None: not a GGUF)
    weights: str
    specs: list[str]
    contexts: list[int]
    new: int
    repeats: int
    threads: int
    peers: list[str]  # llama.cpp KV types
    kv_values: int  # K and V values of one token over all layers
    read_gib: float = 1.0  # the read bandwidth probe's vector (--quick: a quarter)


def make_plan(args: argparse.Namespace) -> Plan:
    """Every option checked before anything loads (one-line errors)."""
    from kvcache.bench.context_lengths import check_contexts, parse_contexts
    from kvcache.bench.measure import resolve_spec
    from kvcache.cliargs import one_weights, split_specs
    from kvcache.engine.llm import default_threads
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    quick = args.quick
    new = args.new_tokens if args.new_tokens is not None else (QUICK_NEW if quick else DEFAULT_NEW)
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if new < 2 or repeats < 1:
        raise InvalidParams(f"--new-tokens must be >= 2 and --repeats >= 1 (got {new} and {repeats})")
    contexts = parse_contexts(args.contexts if args.contexts is not None
                              else QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS)
    specs = list(dict.fromkeys(split_specs(args.kv if args.kv is not None else QUICK_SPECS if quick else DEFAULT_SPECS)))
    if not specs:
        raise InvalidParams("--kv needs at least one cache spec, e.g. --kv fp16,int8")
    peers = parse_kv_types(args.peers if args.peers is not None else DEFAULT_PEERS)
    resolved = resolve_model(args.model)
    cfg = ModelConfig.from_hf(read_config(resolved.path))
    configs = {s: resolve_spec(s, max(contexts) + new, cfg.max_position) for s in specs}
    for s, c in configs.items():
        if not c.uses_cache:
            raise InvalidParams(f"--kv {s!r} keeps no cache: at depth every step would recompute the whole "
                                "context; leave it out of --long")
    check_contexts(contexts, new, cfg.max_position, configs)
    src = Path(str(resolved.source)) if resolved.source is not None else None
    gguf = src if src is not None and src.suffix == ".gguf" else None
    return Plan(args.model, gguf, one_weights(args, "file"), specs, contexts, new, repeats,
                args.threads or default_threads(), peers, 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim,
                0.25 if quick else 1.0)


def kvcache_side(plan: Plan, spec: str) -> tuple[list[DepthRow], dict[str, object], dict[str, object]]:
    """One spec in its own process: (rows, memory entry, what it said of the model)."""
    from kvcache.peers.process import run_module

    req = {"model": plan.model, "weights": plan.weights, "spec": spec, "contexts": plan.contexts, "new": plan.new,
           "repeats": plan.repeats, "threads": plan.threads}
    res = run_module("kvcache.bench.longctx", req, f"kvcache {spec}", timeout=CHILD_TIMEOUT_S, echo="")
    d = res.data if res.ok and isinstance(res.data, dict) else None
    rows = [DepthRow("kvcache", spec, "prefill", n) for n in [REFERENCE, *plan.contexts]]
    rows += [DepthRow("kvcache", spec, "decode", c, new=plan.new) for c in plan.contexts]
    memory: dict[str, object] = {"kv": spec, "context": max(plan.contexts)}
    if d is None:
        for r in rows:
            r.note = res.note or "no result"
        memory["note"] = res.note or "no result"
        return rows, memory, {}
    for r in rows:
        got = next((x for x in d["prefill" if r.test == "prefill" else "decode"]
                    if x.get("tokens", x.get("context")) == r.context), None)
        if got is None:
            r.note = "not measured"
        elif r.test == "prefill":
            r.samples, r.stages = list(got["seconds"]), int(got["stages"])
        else:
            r.samples, r.kv_bytes_per_token, r.weight_bytes = list(got["tok_s"]), float(got["kv_bytes_per_token"]), \
                int(d["weight_bytes"])
    memory.update({k: d[k] for k in ("config", "rss_loaded", "rss_after", "rss_peak", "kv_used", "kv_allocated",
                                     "tokens_held")})
    memory["size_bytes"] = size_bytes(plan, spec, int(d["tokens_held"]))
    return rows, memory, {k: d[k] for k in ("model_name", "weights_label", "weight_bytes")}


def size_bytes(plan: Plan, spec: str, tokens: int) -> int | None:
    """``kvcache size``'s KV bytes for ``tokens`` tokens of ``spec`` on this model."""
    from kvcache.cache.config import parse_kv_spec
    from kvcache.inspect.size import kv_size
    from kvcache.models.config import ModelConfig
    from kvcache.models.loading import read_config, resolve_model

    if tokens < 1:
        return None
    cfg = ModelConfig.from_hf(read_config(resolve_model(plan.model).path))
    return kv_size(cfg, parse_kv_spec(spec), tokens).bytes_total


def run(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    from kvcache.peers.llama_cpp import find_tool
    from kvcache.bench.measure import read_bandwidth
    from kvcache.bench.report import run_meta
    from kvcache.envinfo import host_line

    exe, why = find_tool(args.llama_cpp_bin, "llama-bench") if plan.peers else (None, "")
    steps = len(plan.specs) + (2 + len(plan.peers) if plan.peers else 0)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{steps}] {what} done", file=sys.stderr, flush=True)

    load = [os.getloadavg()[0]]  # other processes on these cores distort every figure: it is recorded
    bandwidth = [read_bandwidth(plan.threads, plan.read_gib)]
    print(f"read bandwidth: {bandwidth[0]:.1f} GB/s; {len(plan.specs)} kvcache specs to grow to "
          f"{max(plan.contexts)} tokens" + (", then llama-bench" if plan.peers else ""), file=sys.stderr, flush=True)
    rows: list[DepthRow] = []
    memory: list[dict[str, object]] = []
    info: dict[str, object] = {}
    for spec in plan.specs:
        got, mem, said = kvcache_side(plan, spec)
        rows += got
        memory.append(mem)
        info = info or said
        tick(f"kvcache {spec}")
    if plan.peers:
        rows += depth_rows(exe, why, plan.gguf, plan.peers, plan.contexts, plan.new, plan.repeats,
                           plan.threads, plan.kv_values, REFERENCE, lambda: tick("llama-bench run"))
    load.append(os.getloadavg()[0])
    bandwidth.append(read_bandwidth(plan.threads, plan.read_gib))
    read_gb_s = max(bandwidth)
    results = summarize(rows, read_gb_s)
    meta = run_meta(mode="long", model=info.get("model_name") or str(plan.model), weights=info.get("weights_label")
                    or plan.weights, weight_bytes=info.get("weight_bytes"), gguf=str(plan.gguf) if plan.gguf else None,
                    kv=plan.specs, peers=plan.peers, contexts=plan.contexts, new_tokens=plan.new,
                    repeats=plan.repeats, read_gb_s=read_gb_s, read_gb_s_probes=[round(b, 2) for b in bandwidth],
                    read_gib=plan.read_gib,
                    kv_values_per_token=plan.kv_values, llama_bench=str(exe) if exe else None,
                    llama_cpp_note=why or None, host=host_line(), reference_prompt=REFERENCE,
                    depth="kvcache: one sequence per spec grown in stages (one prefill of the largest context); "
                          "llama-bench: each depth prefilled by llama-bench")
    meta["threads"] = plan.threads
    meta["load_avg_1min"] = {"before": load[0], "after": load[1]}
    print_report(meta, results, memory)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "memory": memory}, indent=2))
    return 0


# -- kvcache's side: one spec in a process of its own ----------------------------------------------


def status(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def spec_child(req: dict[str, Any]) -> dict[str, Any]:
    """Everything one spec gives; ``req``: model, weights, spec, contexts, new, repeats, threads."""
    from kvcache.bench.measure import english_prompt, pregrow, resolve_spec, use_config, weight_bytes, weights_label
    from kvcache.peers.process import PeakRss, rss_bytes
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams

    spec, contexts, new, repeats = str(req["spec"]), sorted(req["contexts"]), int(req["new"]), int(req["repeats"])
    llm = LLM(req.get("model"), threads=req.get("threads"), weights=str(req.get("weights", "file")), prefix=False)
    loaded = rss_bytes()
    cfg = resolve_spec(spec, contexts[-1] + new, llm.config.max_position)
    runner = use_config(llm, cfg)
    ids = english_prompt(llm, max(contexts[-1], REFERENCE))
    tag = f"kvcache {spec}"
    out: dict[str, Any] = {"spec": spec, "config": cfg.spec(), "model_name": llm.model_name,
                           "weights_label": weights_label(llm), "weight_bytes": weight_bytes(llm.model),
                           "rss_loaded": loaded, "prefill": [], "decode": []}
    with PeakRss() as peak:
        pregrow(runner, contexts[-1] + new)
        llm.generate([ids[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        ref = [_fresh_prefill(llm, ids[:REFERENCE]) for _ in range(repeats)]
        out["prefill"].append({"tokens": REFERENCE, "seconds": ref, "stages": 1})
        status(f"{tag}: prefill {REFERENCE} tokens {statistics.median(ref):.2f} s")
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


def parse_kv_types(text: str) -> list[str]:
    """``--peers`` of the long mode: llama.cpp KV types ('' runs no llama.cpp)."""
    types = list(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    for t in types:
        if t not in KV_TYPE_BYTES:
            raise InvalidParams(f"--peers: unknown llama.cpp KV type {t!r}; choose from {', '.join(KV_TYPE_BYTES)} "
                                "('' runs no llama.cpp)")
    return types


_LLAMA_KV = {"fp16": "f16", "int8": "q8_0", "int4": "q4_0"}


def headline(d: dict) -> list[Headline]:
    """``bench context --long``: decode at depth with each KV encoding beside llama.cpp's KV type of
    the same width, and prefill of the longest prompt (fp16 beside f16), on the same GGUF."""
    meta, results, model = suite_parts(d)
    rows = []
    for k in (r for r in results if r["system"] == "kvcache"):
        peer_kv = _LLAMA_KV.get(k["kv"])
        p = next((x for x in results if x["system"] != "kvcache" and x["kv"] == peer_kv
                  and x["test"] == k["test"] and x["context"] == k["context"]), None)
        if p is None or not (p.get("tok_s") and k.get("tok_s")):  # a skipped row (its reason) has no figure
            continue
        if k["test"] == "prefill" and k["context"] == meta.get("reference_prompt"):
            continue
        what = (f"{model}: decode tok/s after {k['context']} tokens, {k['kv']} KV (peer {peer_kv})"
                if k["test"] == "decode" else f"{model}: prefill {k['context']} tokens, {k['kv']} KV, tok/s")
        rows.append(beside_same_file(what, k, p))
    return rows


def plot(plt, data: dict[str, Any]):
    """``bench context --long``: decode tok/s against the context, one line per KV encoding and
    peer; beside it prefill tok/s against the prompt's length."""
    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, test in ((a, "decode"), (b, "prefill")):
        mine = [r for r in rows if r["test"] == test]
        for key in dict.fromkeys((r["system"], r["kv"]) for r in mine):
            line = sorted((r for r in mine if (r["system"], r["kv"]) == key), key=lambda r: r["context"])
            style = "-" if key[0] == "kvcache" else "--"
            ax.plot([r["context"] for r in line], [r["tok_s"] for r in line], style, marker="o",
                    label=f"{key[0]} {key[1]}")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["context"] for r in mine})
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.set_xlabel("context before decoding (tokens)" if test == "decode" else "prompt (tokens)")
        ax.set_ylabel("new tokens/s" if test == "decode" else "prompt tokens/s")
        ax.set_title("decode at depth" if test == "decode" else "prefill")
        ax.grid(alpha=0.3)
        if mine:
            ax.legend(fontsize=8)
    fig.suptitle(f"{data['meta'].get('model')}, {data['meta'].get('weights')} weights, "
                 f"read bandwidth {data['meta'].get('read_gb_s')} GB/s", fontsize=10)
    return fig


if __name__ == "__main__":
    from kvcache.peers.process import child_main

    raise SystemExit(child_main(spec_child))
