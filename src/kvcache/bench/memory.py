"""Memory benchmark: resident memory and KV bytes per strategy, each in a fresh process.

Each run loads the model in its own process (so peaks do not mix) with one weights mode, records
the resident set after loading and the weights' bytes by kind, then runs one request (a prompt of ``context`` tokens of English text and ``new`` tokens)
while a thread samples the resident set every few milliseconds; the peak during the request minus
the resident set after loading is what the request cost. KV bytes come from the cache itself
(kvcache's accounting; transformers' cache tensors).

A baseline process that only imports torch tells what the interpreter and torch hold before any
model: the rest of ``RSS loaded`` is the model (its weights, tokenizer, kernels).

Run as ``python -m kvcache.bench.memory SYSTEM CACHE CONTEXT NEW WEIGHTS [MODEL]``; prints one JSON
line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples the resident set on a thread between start() and stop()."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every_s)

    def __enter__(self) -> "PeakRss":
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def _prompt_ids(tokenizer_encode: Callable[[str], list[int]], context: int) -> list[int]:
    from kvcache.eval.fidelity import builtin_text

    return tokenizer_encode(builtin_text())[:context]


def probe_kvcache(spec: str, context: int, new: int, model: str | None, weights: str) -> dict[str, object]:
    from kvcache.bench.decode import weights_label
    from kvcache.engine.llm import LLM
    from kvcache.engine.params import SamplingParams

    llm = LLM(model, kv=spec, prefix=False, weights=weights)
    ids = _prompt_ids(llm.tokenizer.encode, context)
    loaded = rss_bytes()
    with PeakRss() as peak:
        r = llm.generate([ids], SamplingParams(max_tokens=new, ignore_eos=True))[0]
    st = r.kv_stats
    return {"rss_loaded": loaded, "rss_peak": peak.peak, "kv_used": st.bytes_used if st else 0,
            "kv_allocated": st.bytes_allocated if st else 0, "tokens": len(ids) + len(r.token_ids),
            "weights_label": weights_label(llm), "weight_kinds": llm.model.weight_kinds(),
            "weight_bytes": llm.model.weight_bytes(), "load_s": llm.load_s}


def probe_transformers(cache: str, context: int, new: int, model: str | None) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvcache.models.loading import fp32_folder
    from kvcache.models.tokenizer import Tokenizer

    path = fp32_folder(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = _prompt_ids(Tokenizer.from_dir(path).encode, context)
    kwargs: dict[str, object] = {"cache_implementation": "static"} if cache == "StaticCache" else {}
    loaded = rss_bytes()
    with PeakRss() as peak, torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=hf.config.eos_token_id, return_dict_in_generate=True, **kwargs)
    kv = 0
    for layer in getattr(out.past_key_values, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                kv += t.numel() * t.element_size()
    return {"rss_loaded": loaded, "rss_peak": peak.peak, "kv_used": kv, "kv_allocated": kv,
            "tokens": out.sequences.shape[1], "weights_label": "fp32",
            "weight_bytes": sum(p.numel() * p.element_size() for p in hf.parameters())}


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
    from kvcache.bench.child import run

    row = Row(system, cache, context, weights)
    cmd = [sys.executable, "-m", "kvcache.bench.memory", system, cache, str(context), str(new), weights]
    env = dict(os.environ)
    if threads:
        env["KVCACHE_THREADS"] = str(threads)
    out = run(cmd + ([model] if model else []), f"{system} probe", env=env)
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


def main(argv: list[str]) -> int:
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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
