"""``kvcache bench memory``: resident memory and KV bytes per strategy, each in a fresh process,
beside transformers' caches; the weights each weights mode holds and what resident memory it adds
to a process that only imported torch; the longest context each strategy fits in a budget.

Each run loads the model in its own process (so peaks do not mix) with one weights mode, records
the resident set after loading and the weights' bytes by kind, then runs one request (a prompt of ``context`` tokens of English text and ``new`` tokens)
while a thread samples the resident set every few milliseconds; the peak during the request minus
the resident set after loading is what the request cost. KV bytes come from the cache itself
(kvcache's accounting; transformers' cache tensors).

A baseline process that only imports torch tells what the interpreter and torch hold before any
model: the rest of ``RSS loaded`` is the model (its weights, tokenizer, kernels).

A probe runs as ``python -m kvcache.bench.memory SYSTEM CACHE CONTEXT NEW WEIGHTS [MODEL]`` and prints
one JSON line; the suite's imports stay inside ``run`` so that a probe loads only what it measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.peers.process import PeakRss, rss_bytes

if TYPE_CHECKING:
    import argparse

    from kvcache.bench.rows import Headline

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "memory"
ORDER = 120
OPTIONS = ("context", "new_tokens", "kv", "peers", "budget", "weights")
QUICK = {"context": 320, "kv": "dynamic;int4", "new_tokens": 2, "peers": "dynamic"}

DEFAULT_SPECS = "dynamic;static;fp16;int8;int4;sink;disk"
QUICK_SPECS = "dynamic;int4"
DEFAULT_WEIGHTS, QUICK_WEIGHTS = "file,q8,fp32", "file,fp32"


def _prompt_ids(tokenizer_encode: Callable[[str], list[int]], context: int) -> list[int]:
    from kvcache.eval.fidelity import builtin_text

    return tokenizer_encode(builtin_text())[:context]


def probe_kvcache(spec: str, context: int, new: int, model: str | None, weights: str) -> dict[str, object]:
    from kvcache.bench.measure import weights_label
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams

    llm = LLM(model, kv=spec, prefix=False, weights=weights)
    ids = _prompt_ids(llm.tokenizer.encode, context)
    loaded = rss_bytes()
    with PeakRss() as peak:
        r = llm.generate([ids], SamplingParams(max_tokens=new, ignore_eos=True))[0]
    st = r.kv_stats
    from kvcache import hugepages

    hugepages.trim()  # as the engine does once idle: the request's freed scratch goes back
    after, kv_alloc = rss_bytes(), llm.kv_stats().bytes_allocated
    return {"rss_loaded": loaded, "rss_peak": peak.peak, "kv_used": st.bytes_used if st else 0,
            "kv_allocated": st.bytes_allocated if st else 0, "tokens": len(ids) + len(r.token_ids),
            # what the process holds beyond its weights and its KV pools, once the request is done
            "overhead": after - llm.model.weight_bytes() - kv_alloc,
            "weights_label": weights_label(llm), "weight_kinds": llm.model.weight_kinds(),
            "weight_bytes": llm.model.weight_bytes(), "load_s": llm.load_s}


def probe_transformers(cache: str, context: int, new: int, model: str | None) -> dict[str, object]:
    from kvcache.models.loading import fp32_folder
    from kvcache.models.tokenizer import Tokenizer
    from kvcache.peers.hf_transformers import memory_probe

    path = fp32_folder(model)
    return memory_probe(path, _prompt_ids(Tokenizer.from_dir(path).encode, context), cache, new)


@dataclass
class Row:
    system: str
    cache: str
    context: int
    weights: str = "fp32"  # the mode asked for (the result says what was loaded)
    result: dict[str, object] | None = None
    note: str = ""

    def summary(self) -> dict[str, object]:
        r = self.result or {}
        extra = (int(r["rss_peak"]) - int(r["rss_loaded"])) if r else None  # type: ignore[call-overload]
        return {"system": self.system, "cache": self.cache, "context": self.context, **r, "weights": self.weights,
                "request_peak": extra, "note": self.note}


def run_probe(system: str, cache: str, context: int, new: int, model: str | None, threads: int | None,
              weights: str = "fp32") -> Row:
    from kvcache.peers.process import run as run_child

    row = Row(system, cache, context, weights)
    cmd = [sys.executable, "-m", "kvcache.bench.memory", system, cache, str(context), str(new), weights]
    env = dict(os.environ)
    if threads:
        env["KVCACHE_THREADS"] = str(threads)
    out = run_child(cmd + ([model] if model else []), f"{system} probe", env=env)
    if not out.ok:
        row.note = out.note
        return row
    row.result = out.data
    return row


TORCH_ALONE = ("import os, torch; "
               "print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))")


def torch_baseline() -> int | None:
    """Resident bytes of a fresh ``python -c "import torch"`` (None when it cannot be measured)."""
    p = subprocess.run([sys.executable, "-c", TORCH_ALONE], capture_output=True, text=True, timeout=600)
    try:
        return int(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def probe_main(argv: list[str]) -> int:
    """One probe in this process: the arguments of ``run_probe``'s command line."""
    system, cache, context, new, weights = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    model = argv[5] if len(argv) > 5 else None
    threads = os.environ.get("KVCACHE_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    res = (probe_kvcache(cache, context, new, model, weights) if system == "kvcache"
           else probe_transformers(cache, context, new, model))
    print(json.dumps(res))
    return 0


def run(args: argparse.Namespace) -> int:
    from kvcache.cliargs import split_specs, weights_list
    from kvcache.errors import InvalidParams

    quick = args.quick
    context = args.context if args.context is not None else (256 if quick else 4096)
    new = args.new_tokens if args.new_tokens is not None else (4 if quick else 16)
    budget = args.budget if args.budget is not None else 4.0
    specs = split_specs(args.kv if args.kv is not None else (QUICK_SPECS if quick else DEFAULT_SPECS))
    peers = [p for p in (args.peers if args.peers is not None else "dynamic" if quick else "dynamic,static").split(",")
             if p]
    for p in peers:
        if p not in ("dynamic", "static"):
            raise InvalidParams(f"unknown transformers cache {p!r} for memory; choose from dynamic, static")
    if context < 16 or new < 1:
        raise InvalidParams("--context must be at least 16 and --new-tokens at least 1")
    if budget <= 0:
        raise InvalidParams(f"--budget must be positive GiB, got {budget}")
    modes = weights_list(args, QUICK_WEIGHTS if quick else DEFAULT_WEIGHTS)

    from kvcache.bench.measure import resolve_spec
    from kvcache.inspect.size import load_model_config, longest_context

    name, model_cfg = load_model_config(args.model)
    configs = {s: resolve_spec(s, context + new, model_cfg.max_position) for s in dict.fromkeys(specs)}

    from tqdm import tqdm

    # every spec under the first weights mode; the first spec under every other mode
    runs = [(modes[0], s) for s in configs] + [(m, next(iter(configs))) for m in modes[1:]]
    bar = tqdm(total=1 + len(runs) + len(peers), desc="bench memory", file=sys.stderr)
    baseline = torch_baseline()
    bar.update()
    rows = []
    for mode, spec in runs:
        rows.append(run_probe("kvcache", configs[spec].spec(), context, new, args.model, args.threads, mode))
        rows[-1].cache = spec
        bar.update()
    for p in peers:
        rows.append(run_probe("transformers", {"dynamic": "DynamicCache", "static": "StaticCache"}[p], context, new,
                              args.model, args.threads))
        bar.update()
    bar.close()
    results = [r.summary() for r in rows]
    limit = int(budget * 2**30)
    for r in results:
        spec = r["cache"] if r["system"] == "kvcache" else None
        r["longest_context_in_budget"] = longest_context(model_cfg, configs[spec], 1, limit) if spec else None
    _print(name, context, new, budget, baseline, results)
    if args.json:
        from kvcache.bench.report import run_meta

        meta = run_meta(model=name, context=context, new_tokens=new, budget_gib=budget, kv=list(configs),
                        weights=modes, rss_torch_alone=baseline)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def _print(name: str, context: int, new: int, budget: float, baseline: int | None,
           results: list[dict[str, object]]) -> None:
    from kvcache.fmt import human_bytes

    base = "-" if baseline is None else human_bytes(baseline)
    print(f"\nmemory: {name}, each run in a fresh process; `python -c \"import torch\"` alone is {base} resident")
    print("\nweights, as each mode holds them (bytes by kind; RSS right after loading, and what that adds to "
          "torch alone)")
    print(f"{'system':<13} {'weights':<13} {'weights by kind':<46} {'total':>10} {'RSS loaded':>10} {'- torch':>10} "
          f"{'overhead':>10}")
    seen = set()
    for r in results:
        key = (r["system"], r.get("weights"))
        if r.get("rss_loaded") is None or key in seen:
            continue
        seen.add(key)
        kinds = r.get("weight_kinds") or {"fp32": r.get("weight_bytes", 0)}
        order = sorted(kinds.items(), key=lambda kv: -kv[1])  # type: ignore[union-attr]
        text = ", ".join(f"{k} {human_bytes(v)}" for k, v in order if v)
        added = "-" if baseline is None else human_bytes(int(r["rss_loaded"]) - baseline)  # type: ignore[call-overload]
        over = "-" if r.get("overhead") is None else human_bytes(r["overhead"])  # type: ignore[arg-type]
        print(f"{r['system']:<13} {_label(r):<13} {text:<46} {human_bytes(r.get('weight_bytes') or 0):>10} "
              f"{human_bytes(r['rss_loaded']):>10} {added:>10} {over:>10}")
    print("overhead: resident memory after a request, once idle (freed heap given back, as the engine does), minus "
          "the weights and the KV pools' allocation: the fixed cost of the process (interpreter, torch, tokenizer, "
          "kernels)")
    print(f"\nrequests: a prompt of {context} tokens of English text + {new} new tokens, batch 1; request peak = "
          "peak resident memory during the request minus after loading")
    print(f"{'system':<13} {'weights':<13} {'cache':<14} {'RSS loaded':>10} {'RSS peak':>10} {'request peak':>12} "
          f"{'KV used':>10} {'KV allocated':>12} {'longest ctx in ' + format(budget, 'g') + ' GiB':>22}")
    for r in results:
        if r.get("rss_peak") is None:
            print(f"{r['system']:<13} {_label(r):<13} {r['cache']:<14} {r['note']}")
            continue
        longest = r["longest_context_in_budget"]
        lc = "-" if longest is None else ("unbounded" if longest >= 2**40 else f"{longest:,}")  # type: ignore[operator]
        print(f"{r['system']:<13} {_label(r):<13} {r['cache']:<14} {human_bytes(r['rss_loaded']):>10} "
              f"{human_bytes(r['rss_peak']):>10} {human_bytes(r['request_peak']):>12} {human_bytes(r['kv_used']):>10} "
              f"{human_bytes(r['kv_allocated']):>12} {lc:>22}")
    print("KV used: bytes the cache holds for the tokens stored (scales and fp32 windows included); allocated: the "
          "pools' size; longest context: KV bytes alone, from `kvcache size`")


def _label(r: dict[str, object]) -> str:
    """The weights as loaded (``file (Q4_1)``), else the mode asked for."""
    return str(r.get("weights_label") or r["weights"])


def headline(d: dict) -> list[Headline]:
    """``bench memory``: a request's peak memory beside transformers' with the same cache kind."""
    from kvcache.bench.rows import Headline, one, positive

    results = d["results"]
    k = one(results, system="kvcache", cache="dynamic")
    p = one(results, system="transformers", cache="DynamicCache")
    return [Headline(f"a request's peak memory MB, {k['context']}-token prompt", positive(k["request_peak"]) / 2**20,
                "transformers DynamicCache", positive(p["request_peak"]) / 2**20, "MB", higher_better=False)]


def plot(plt, data: dict):
    rows = [r for r in data["results"] if r.get("rss_peak")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(rows)))
    labels = [f"{r['system']} {r.get('weights_label') or r.get('weights', '')} {r['cache']}" for r in rows]
    peak = [r["request_peak"] / 2**20 for r in rows]
    kv = [r["kv_used"] / 2**20 for r in rows]
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], peak, height=0.4, label="request peak RSS (MiB)", color="#aa4466")
    ax.barh([i + 0.2 for i in y], kv, height=0.4, label="KV held (MiB)", color="#4477aa")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title(f"memory of one request, {data['meta'].get('context')}-token prompt")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    raise SystemExit(probe_main(sys.argv[1:]))
