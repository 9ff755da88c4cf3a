"""``kvcache bench context --long``: decode and prefill at depth, kvcache's KV encodings beside
llama.cpp's on the same GGUF, with the memory-bandwidth wall and the memory each encoding holds.

One command measures, on one model:

- kvcache decode tok/s after N tokens of context (default 4096, 16384, 32768) for each KV spec
  (default fp16, bf16, int8, int4, int2; any spec ``--kv`` names passes through), each spec in a
  process of its own (bench/longctx_child.py), so a crash is that spec's skipped rows and the
  resident-set figures of one spec never mix with another's;
- llama-bench beside it (bench/longctx_llama.py): ``-d N -fa 1 -ctk X -ctv X`` for X in f16,
  q8_0, q4_0 (``--peers``), and prefill ``-p N -fa 1``; a missing binary or a crash is a skipped
  row with the reason;
- prefill of N-token prompts on both sides, in seconds per 1k tokens and against the 512-token
  prompt's throughput;
- the read bandwidth, measured in the same run before and after the systems (the best of the two:
  kernels/membw.c's streaming read, as ``bench decode`` reports it), and for each decode figure
  the bytes one step reads (weights + the KV it attends to at that depth) and the share of that
  bandwidth it achieves (bench/longctx_table.py has the arithmetic);
- resident memory per spec at the largest context, beside ``kvcache size``'s figure.

How depth is reached: kvcache grows one sequence per spec in stages, 4096 -> 16384 -> 32768,
decoding at each stage; before the next stage the decoded tokens are truncated away by the
engine's own rule (a kept sequence shares the prompt's prefix; what follows it goes), which is
exact: the cache then equals one that never saw them. So each spec pays one prefill of the
largest context, and the prefill of N tokens is timed as the sum of its stages. llama-bench has
no such path: it prefills every depth of every KV type itself (untimed), which makes its side
the longer part of a full run.

``--quick``: contexts 256, 1024, 8 new tokens, 1 repeat, fp16 and int8 (for tests; the bundled
model). JSON (``--json``/``--out``): ``meta``, ``results`` (one row per system, KV, test and
context) and ``memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvcache.bench.longctx_table import REFERENCE, DepthRow, print_report, summarize
from kvcache.errors import InvalidParams

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


def make_plan(args: argparse.Namespace) -> Plan:
    """Every option checked before anything loads (one-line errors)."""
    from kvcache.bench.context_lengths import check_contexts, parse_contexts
    from kvcache.bench.longctx_llama import parse_kv_types
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
                args.threads or default_threads(), peers, 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)


def kvcache_side(plan: Plan, spec: str) -> tuple[list[DepthRow], dict[str, object], dict[str, object]]:
    """One spec in its own process: (rows, memory entry, what it said of the model)."""
    from kvcache.bench.child import run_module

    req = {"model": plan.model, "weights": plan.weights, "spec": spec, "contexts": plan.contexts, "new": plan.new,
           "repeats": plan.repeats, "threads": plan.threads}
    res = run_module("kvcache.bench.longctx_child", req, f"kvcache {spec}", timeout=CHILD_TIMEOUT_S, echo="")
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
    from kvcache.bench import longctx_llama
    from kvcache.bench.measure import read_bandwidth
    from kvcache.bench.report import run_meta
    from kvcache.envinfo import host_line

    exe, why = longctx_llama.find_bench(args.llama_cpp_bin) if plan.peers else (None, "")
    steps = len(plan.specs) + (2 + len(plan.peers) if plan.peers else 0)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{steps}] {what} done", file=sys.stderr, flush=True)

    load = [os.getloadavg()[0]]  # other processes on these cores distort every figure: it is recorded
    bandwidth = [read_bandwidth(plan.threads)]
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
        rows += longctx_llama.measure(exe, why, plan.gguf, plan.peers, plan.contexts, plan.new, plan.repeats,
                                      plan.threads, plan.kv_values, lambda: tick("llama-bench run"))
    load.append(os.getloadavg()[0])
    bandwidth.append(read_bandwidth(plan.threads))
    read_gb_s = max(bandwidth)
    results = summarize(rows, read_gb_s)
    meta = run_meta(mode="long", model=info.get("model_name") or str(plan.model), weights=info.get("weights_label")
                    or plan.weights, weight_bytes=info.get("weight_bytes"), gguf=str(plan.gguf) if plan.gguf else None,
                    kv=plan.specs, peers=plan.peers, contexts=plan.contexts, new_tokens=plan.new,
                    repeats=plan.repeats, read_gb_s=read_gb_s, read_gb_s_probes=[round(b, 2) for b in bandwidth],
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
