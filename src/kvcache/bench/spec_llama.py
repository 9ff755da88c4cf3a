"""``kvcache bench spec``'s llama.cpp peer: ``llama-server`` on the model's own GGUF file, without
speculation and with its n-gram prompt lookup (``--spec-type ngram-simple``, at most ``lookup``
tokens proposed a forward), on the very prompt token ids kvcache reads.

Two servers run (one of each kind, both started before timing; only one works at a time) and take
turns per repeat, after one untimed request each. A request is ``/completion`` with the prompt as
token ids, greedy (temperature 0), ``n_predict`` new tokens at most, the prompt cache off, the
tokens returned. Decode tok/s is kvcache's definition: the tokens after the first over the
server's generation time (``timings.predicted_ms``, which starts once the prompt's forward gave
the first token). Acceptance is ``draft_n_accepted / draft_n``; forwards after the prompt's are
``predicted_n - 1 - draft_n_accepted`` (each forward gives its kept proposals and one token).

A server that does not start, or a request that fails, makes the workload's row a skipped row
with the reason; a missing binary or GGUF file, skipped rows for all.
"""

from __future__ import annotations

import json
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REQUEST_TIMEOUT_S = 600.0


def server_cmd(binary: Path, gguf: Path, port: int, threads: int, ctx: int, lookup: int | None) -> list[str]:
    """llama-server with one slot of ``ctx`` tokens; ``lookup``: its n-gram prompt lookup."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
           str(threads), "-np", "1", "-c", str(ctx), "--no-webui", "--log-disable"]
    if lookup:
        cmd += ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(lookup)]
    return cmd


def complete(url: str, ids: list[int], new: int) -> dict[str, Any]:
    """One greedy /completion of the token ids ``ids``: its JSON answer."""
    body = {"prompt": ids, "n_predict": new, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.load(resp)


def skipped(workload: str, prompt_tokens: int, weights: str, label: str, note: str) -> dict[str, object]:
    return {"system": "llama-server", "weights": weights, "pair": "file", "workload": workload, "method": "lookup",
            "speculation": label, "prompt_tokens": prompt_tokens, "tokens": None, "plain_tok_s": None,
            "spec_tok_s": None, "speedup": None, "proposed": None, "accepted": None, "acceptance": None,
            "forwards": None, "tokens_per_forward": None, "plain_ms_per_forward": None, "spec_ms_per_forward": None,
            "forward_cost": None, "runs": 0, "mismatches": 0, "identical": None, "note": note}


def _tok_s(answer: dict[str, Any]) -> float:
    t = answer["timings"]
    n = int(t["predicted_n"])
    return (n - 1) / (float(t["predicted_ms"]) / 1000) if n > 1 and float(t["predicted_ms"]) > 0 else 0.0


def rows(binary: Path | None, gguf: Path | None, prompts: dict[str, list[int]], new: int, repeats: int, lookup: int,
         threads: int, weights: str, label: str, tick: Any = None) -> list[dict[str, object]]:
    """One row per workload (see the module doc); ``weights`` and ``label`` name the file and the
    speculation as kvcache's rows do."""
    from kvcache.bench.local_redis import free_port
    from kvcache.bench.serving import server

    if binary is None or gguf is None:
        why = ("no GGUF file for this model" if gguf is None else "llama-server not built: `make llamacpp`, then "
               "`cmake --build .venv/llama.cpp/build --target llama-server`")
        return [skipped(w, len(ids), weights, label, why + ": skipped") for w, ids in prompts.items()]
    ctx = max(len(ids) for ids in prompts.values()) + new + 64
    out: list[dict[str, object]] = []
    with ExitStack() as stack:
        urls = {}
        for side, k in (("plain", None), ("spec", lookup)):
            port = free_port()
            url, why = stack.enter_context(server(server_cmd(binary, gguf, port, threads, ctx, k), port,
                                                  f"llama-server ({side})"))
            if url is None:
                return [skipped(w, len(ids), weights, label, why + ": skipped") for w, ids in prompts.items()]
            urls[side] = url
        for w, ids in prompts.items():
            try:
                out.append(_workload(urls, w, ids, new, repeats, weights, label))
            except (OSError, ValueError, KeyError) as e:
                out.append(skipped(w, len(ids), weights, label, f"llama-server request failed ({e}): skipped"))
            if tick:
                tick()
    return out


def _workload(urls: dict[str, str], workload: str, ids: list[int], new: int, repeats: int, weights: str,
              label: str) -> dict[str, object]:
    ref = complete(urls["plain"], ids, new)  # untimed, each side
    first = complete(urls["spec"], ids, new)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
    mismatches, checked = int(first["tokens"] != ref["tokens"]), 1
    for rep in range(repeats):
        for side in (("plain", "spec") if rep % 2 == 0 else ("spec", "plain")):
            a = complete(urls[side], ids, new)
            runs[side].append(a)
            if side == "spec":
                checked += 1
                mismatches += a["tokens"] != ref["tokens"]
    plain = max(runs["plain"], key=_tok_s)
    spec = max(runs["spec"], key=_tok_s)
    n = int(spec["timings"]["predicted_n"])
    proposed = int(spec["timings"].get("draft_n") or 0)
    accepted = int(spec["timings"].get("draft_n_accepted") or 0)
    forwards = max(1, n - 1 - accepted)
    plain_ms = float(plain["timings"]["predicted_ms"]) / max(1, int(plain["timings"]["predicted_n"]) - 1)
    spec_ms = float(spec["timings"]["predicted_ms"]) / forwards
    plain_tok_s, spec_tok_s = _tok_s(plain), _tok_s(spec)
    return {"system": "llama-server", "weights": weights, "pair": "file", "workload": workload, "method": "lookup",
            "speculation": label, "prompt_tokens": len(ids), "tokens": n, "plain_tok_s": plain_tok_s,
            "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s if plain_tok_s else None,
            "proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else None,
            "forwards": forwards, "tokens_per_forward": (n - 1) / forwards, "plain_ms_per_forward": plain_ms,
            "spec_ms_per_forward": spec_ms, "forward_cost": spec_ms / plain_ms if plain_ms else None,
            "runs": checked, "mismatches": mismatches, "identical": mismatches == 0,
            "plain_tok_s_runs": [_tok_s(a) for a in runs["plain"]], "spec_tok_s_runs": [_tok_s(a) for a in runs["spec"]],
            "token_ids": [int(t) for t in ref["tokens"]], "note": ""}
