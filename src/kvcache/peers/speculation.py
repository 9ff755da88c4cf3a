"""The peers' speculative decoding for ``bench spec`` (bench/spec.py says what is compared):

transformers, in a child process on the fp32 folder kvcache converted: ``generate`` without and
with ``prompt_lookup_num_tokens``, alternating, tok/s as peers/hf_transformers.py measures it (new
tokens after the first over the generate time less the time to first token of a one-token
generate); its forwards counted by a forward hook and its proposals by wrapping its candidate
generators, in one untimed run of each. Its draft row: ``assistant_model`` a copy of the same model
with its linear layers quantized to int8 by torch's ``quantize_dynamic``, 8 tokens proposed a
forward. The child is ``python -m kvcache.peers.speculation`` with a JSON request on stdin.

llama-server, on the model's own GGUF file twice, without speculation and with its n-gram prompt
lookup, on the same prompt token ids (``/completion``, greedy, the prompt cache off, the tokens
returned), taking turns per repeat after one untimed request each.

A crash, a missing package, a server that does not start or a request that fails is a skipped row
with the reason.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.peers.hf_transformers import NO_TRANSFORMERS, transformers_model
from kvcache.peers.process import child_main, run_module
from kvcache.peers.row import method_label, spec_row

PEER_TIMEOUT_S = 1800.0


def peer_rows(model_dir: str, prompts: dict[str, list[int]], new: int, repeats: int, lookup: int, threads: int,
              eos: list[int] | None = None, timeout: float = PEER_TIMEOUT_S) -> list[dict[str, object]]:
    """transformers' rows, one per workload (or skipped rows with the reason); ``eos``: the tokens
    that end a text, as kvcache's tokenizer has them (default: the model's generation config)."""
    req = {"model_dir": model_dir, "prompts": prompts, "new": new, "repeats": repeats, "lookup": lookup,
           "threads": threads, "eos": eos}
    out = run_module("kvcache.peers.speculation", req, "transformers", timeout=timeout)
    if out.ok and isinstance(out.data, list):
        return out.data
    return [_peer_skipped(w, len(ids), lookup, out.note) for w, ids in prompts.items()]


ASSISTANT = "draft: int8 copy"  # transformers' draft row: the model quantized by torch's quantize_dynamic
ASSISTANT_TOKENS = 8


def _peer_skipped(workload: str, prompt_tokens: int, lookup: int, note: str,
                  method: str = "lookup") -> dict[str, object]:
    label = method_label("lookup", lookup) if method == "lookup" else ASSISTANT
    return spec_row("transformers", "fp32", "fp32", workload, method, label, prompt_tokens, note)


def _peer_child(req: dict[str, Any]) -> list[dict[str, object]]:
    import torch

    torch.set_num_threads(int(req["threads"]))
    prompts = {w: list(ids) for w, ids in req["prompts"].items()}
    lookup = int(req["lookup"])
    model = transformers_model(req["model_dir"])
    if model is None:
        return [_peer_skipped(w, len(ids), lookup, NO_TRANSFORMERS) for w, ids in prompts.items()]
    eos = req.get("eos") or model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else [int(t) for t in eos or []]
    gen: dict[str, Any] = {"do_sample": False, "pad_token_id": eos_ids[0] if eos_ids else None}
    if eos_ids:
        gen["eos_token_id"] = eos_ids
    new, repeats = int(req["new"]), int(req["repeats"])
    with torch.inference_mode():
        model.generate(torch.tensor([next(iter(prompts.values()))[:8]]), max_new_tokens=4, min_new_tokens=4, **gen)
        rows = [_peer_workload(model, w, ids, new, repeats, gen, set(eos_ids), "lookup",
                               {"prompt_lookup_num_tokens": lookup}, method_label("lookup", lookup))
                for w, ids in prompts.items()]
        try:
            assistant = _int8_copy(model)
        except Exception as e:  # torch without its dynamic quantization: the draft rows say why
            return rows + [_peer_skipped(w, len(ids), lookup, f"no int8 assistant ({e}): skipped", "draft")
                           for w, ids in prompts.items()]
        return rows + [_peer_workload(model, w, ids, new, repeats, gen, set(eos_ids), "draft",
                                      {"assistant_model": assistant}, ASSISTANT) for w, ids in prompts.items()]


def _int8_copy(model: Any) -> Any:
    """The model with its linear layers quantized to int8 (dynamic activations), as an assistant."""
    import copy
    import warnings

    import torch
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    out.generation_config.num_assistant_tokens = ASSISTANT_TOKENS
    out.generation_config.num_assistant_tokens_schedule = "constant"
    return out


@dataclass
class _Counts:
    forwards: int = 0
    proposed: int | None = 0  # None: not counted (no prompt-lookup generator to wrap)


@contextmanager
def _counting(model: Any) -> Iterator[_Counts]:
    """Forwards of the model (a forward hook) and tokens proposed by prompt lookup or an assistant
    (their candidate generators wrapped) within the block."""
    counts = _Counts()

    def forward(*_: object) -> None:
        counts.forwards += 1

    hook = model.register_forward_hook(forward)
    try:
        from transformers.generation import candidate_generator as cg

        classes = [cg.PromptLookupCandidateGenerator, cg.AssistedCandidateGenerator]
    except (ImportError, AttributeError):
        classes = []
        counts.proposed = None
    origs = [c.get_candidates for c in classes]

    def wrapped(orig: Any) -> Any:
        def get_candidates(gen: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(gen, input_ids, *args, **kwargs)
            counts.proposed = (counts.proposed or 0) + int(out[0].shape[1] - input_ids.shape[1])
            return out
        return get_candidates

    for c, orig in zip(classes, origs):
        c.get_candidates = wrapped(orig)
    try:
        yield counts
    finally:
        hook.remove()
        for c, orig in zip(classes, origs):
            c.get_candidates = orig


def _peer_workload(model: Any, workload: str, ids: list[int], new: int, repeats: int, gen: dict[str, Any],
                   eos: set[int], method: str, spec: dict[str, Any], label: str) -> dict[str, object]:
    import torch

    x = torch.tensor([ids])

    def generate(**kw: Any) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = model.generate(x, **gen, **kw)
        return out[0, x.shape[1]:].tolist(), time.perf_counter() - t0

    def text(toks: list[int]) -> list[int]:
        return toks[:-1] if toks and toks[-1] in eos else toks

    spec_kw = {"max_new_tokens": new, **spec}
    with _counting(model) as pc:
        plain_toks, _ = generate(max_new_tokens=new)
    with _counting(model) as sc:
        spec_toks, _ = generate(**spec_kw)
    ref = text(plain_toks)
    n = len(ref)
    plain_tok_s, spec_tok_s = [], []
    mismatches, checked = int(text(spec_toks) != ref), 1
    for rep in range(repeats):
        _, ttft = generate(max_new_tokens=1)
        for side in (("plain", "spec") if rep % 2 == 0 else ("spec", "plain")):
            toks, total = generate(**(spec_kw if side == "spec" else {"max_new_tokens": new}))
            tok_s = (n - 1) / max(total - ttft, 1e-9) if n > 1 else 0.0
            if side == "spec":
                spec_tok_s.append(tok_s)
                checked += 1
                mismatches += text(toks) != ref
            else:
                plain_tok_s.append(tok_s)
    made = len(spec_toks)  # EOS included: its forward made it
    fwd = sc.forwards - 1  # after the prompt's (which verified the first proposals too)
    pfwd = pc.forwards - 1
    plain_best, spec_best = max(plain_tok_s), max(spec_tok_s)
    plain_ms = 1000 / plain_best if plain_best else None  # one token per forward
    spec_ms = (n - 1) / spec_best / fwd * 1000 if spec_best and fwd > 0 else None
    return spec_row("transformers", "fp32", "fp32", workload, method, label, len(ids), tokens=n,
                    plain_tok_s=plain_best, spec_tok_s=spec_best, proposed=sc.proposed,
                    accepted=max(0, made - sc.forwards), forwards=fwd, plain_forwards=pfwd,
                    plain_ms_per_forward=plain_ms, spec_ms_per_forward=spec_ms, runs=checked, mismatches=mismatches,
                    plain_tok_s_runs=plain_tok_s, spec_tok_s_runs=spec_tok_s, token_ids=ref)


# -- llama-server, on the model's GGUF file ---------------------------------------------------------


def _complete(url: str, ids: list[int], new: int) -> dict[str, Any]:
    """One greedy /completion of the token ids ``ids`` (prompt cache off, tokens returned): its answer."""
    body = {"prompt": ids, "n_predict": new, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=PEER_TIMEOUT_S) as resp:
        return json.load(resp)


def _server_tok_s(answer: dict[str, Any]) -> float:
    t = answer["timings"]
    n = int(t["predicted_n"])
    return (n - 1) / (float(t["predicted_ms"]) / 1000) if n > 1 and float(t["predicted_ms"]) > 0 else 0.0


def llama_rows(binary: Path | None, gguf: Path | None, prompts: dict[str, list[int]], new: int, repeats: int,
               lookup: int, threads: int, weights: str, label: str, tick: Any = None) -> list[dict[str, object]]:
    """llama-server's row per workload (see the module doc): two servers, without and with its
    n-gram lookup, both started before timing, taking turns; ``weights`` and ``label`` name the file
    and the speculation as kvcache's rows do. A server that does not start or a request that fails
    is a skipped row with the reason."""
    from kvcache.peers.process import free_port
    from kvcache.peers.llama_cpp import NO_SERVER, llama_server_cmd
    from kvcache.peers.servers import server

    def skipped(w: str, why: str) -> dict[str, Any]:
        return spec_row("llama-server", weights, "file", w, "lookup", label, len(prompts[w]), why)

    if binary is None or gguf is None:
        return [skipped(w, "no GGUF file for this model: skipped" if gguf is None else NO_SERVER) for w in prompts]
    ctx = max(len(ids) for ids in prompts.values()) + new + 64
    out: list[dict[str, object]] = []
    with ExitStack() as stack:
        urls = {}
        for side, k in (("plain", None), ("spec", lookup)):
            port = free_port()
            url, why = stack.enter_context(server(llama_server_cmd(binary, gguf, port, threads, 1, ctx, k), port,
                                                  f"llama-server ({side})"))
            if url is None:
                return [skipped(w, why + ": skipped") for w in prompts]
            urls[side] = url
        for w, ids in prompts.items():
            try:
                out.append(_server_workload(urls, w, ids, new, repeats, weights, label))
            except (OSError, ValueError, KeyError) as e:
                out.append(skipped(w, f"llama-server request failed ({e}): skipped"))
            if tick:
                tick()
    return out


def _server_workload(urls: dict[str, str], workload: str, ids: list[int], new: int, repeats: int, weights: str,
                     label: str) -> dict[str, object]:
    """Decode tok/s is kvcache's definition: the tokens after the first over the server's
    generation time (``timings.predicted_ms``, from the prompt's forward's first token on).
    Acceptance is ``draft_n_accepted / draft_n``; the forwards after the prompt's are
    ``predicted_n - 1 - draft_n_accepted`` (each gives its kept proposals and one token)."""
    ref = _complete(urls["plain"], ids, new)  # untimed, each side
    first = _complete(urls["spec"], ids, new)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
    mismatches, checked = int(first["tokens"] != ref["tokens"]), 1
    for rep in range(repeats):
        for side in (("plain", "spec") if rep % 2 == 0 else ("spec", "plain")):
            a = _complete(urls[side], ids, new)
            runs[side].append(a)
            if side == "spec":
                checked += 1
                mismatches += a["tokens"] != ref["tokens"]
    plain, spec = max(runs["plain"], key=_server_tok_s), max(runs["spec"], key=_server_tok_s)
    n = int(spec["timings"]["predicted_n"])
    accepted = int(spec["timings"].get("draft_n_accepted") or 0)
    forwards = max(1, n - 1 - accepted)
    return spec_row("llama-server", weights, "file", workload, "lookup", label, len(ids), tokens=n,
                    plain_tok_s=_server_tok_s(plain), spec_tok_s=_server_tok_s(spec),
                    proposed=int(spec["timings"].get("draft_n") or 0), accepted=accepted, forwards=forwards,
                    plain_ms_per_forward=float(plain["timings"]["predicted_ms"]) / max(
                        1, int(plain["timings"]["predicted_n"]) - 1),
                    spec_ms_per_forward=float(spec["timings"]["predicted_ms"]) / forwards, runs=checked,
                    mismatches=mismatches, plain_tok_s_runs=[_server_tok_s(a) for a in runs["plain"]],
                    spec_tok_s_runs=[_server_tok_s(a) for a in runs["spec"]],
                    token_ids=[int(t) for t in ref["tokens"]])


if __name__ == "__main__":
    sys.exit(child_main(_peer_child))
