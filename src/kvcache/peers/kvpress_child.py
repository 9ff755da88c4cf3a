"""kvpress, measured the way ``kvcache eval`` measures kvcache's presses, in a process of its own.

A standalone script: it imports only the standard library, torch, transformers and kvpress, never
kvcache, because kvpress pins a transformers older than kvcache's (it runs in .venv-kvpress, see
``make kvpress``). It reads one JSON request on stdin and writes one JSON answer on stdout.

Request::

    {"model": "<HF folder with fp32 safetensors>", "threads": 2,
     "cases": [{"press": "knorm", "ratio": 0.5}, {"press": "snapkv", "budget": 512}, ...],
     "fidelity": {"context": [ids], "continuation": [ids]} | null,
     "passkey": [{"context": [ids], "question": [ids]}, ...], "answer_tokens": 8, "eos": [ids]}

Protocol (kvpress's own pipeline): the context is prefilled through ``model.model`` inside the
press's context manager, so every layer's K/V are pruned right after that layer's prefill; the
continuation (or the passkey question) follows in one forward at positions counted from the
context's original length, with no press active. The reference is the same procedure with no
press. Scored: the continuation's next-token distributions (log-probabilities of the text's
tokens, KL(reference || press), top-1 agreement), per position; passkey answers are the greedy
token ids (the caller decodes and looks for the key).

Answer::

    {"versions": {...}, "reference": {"nll": [...], "passkey": [[ids], ...]},
     "results": [{"press": ..., "ratio": ..., "nll": [...], "kl": [...], "agree": [...],
                  "kept": mean tokens kept per layer, "context": C, "passkey": [[ids], ...]}
                 | {"press": ..., "error": "one line"}]}
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _press(name: str, ratio: float):
    import kvpress

    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio)
    if name == "expected":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "kvzip":  # layerwise: each layer evicts its share, as kvcache's does (heads may differ)
        return kvpress.KVzipPress(compression_ratio=ratio, layerwise=True)
    if name == "h2o":  # H2O's accumulated attention, as kvpress scores it (needs eager attention)
        return kvpress.ObservedAttentionPress(compression_ratio=ratio)
    raise ValueError(f"no kvpress press for {name!r}")


def _prefill(model, press, context, cache):
    import contextlib

    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=context, past_key_values=cache)


def _continue(model, cache, ids, start: int):
    """Logits [T, V] of ``ids`` fed after the cache, at positions start.. (the original context length)."""
    import torch

    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    return model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0].float()


def _answer(model, cache, question, start: int, n: int, eos: list[int]) -> list[int]:
    """Greedy answer ids after the cache: the question in one forward, then token by token."""
    import torch

    logits = _continue(model, cache, question, start)
    out = [int(logits[-1].argmax())]
    pos = start + question.shape[1]
    while len(out) < n and out[-1] not in eos:
        logits = _continue(model, cache, torch.tensor([[out[-1]]]), pos)
        pos += 1
        out.append(int(logits[-1].argmax()))
    return out


def _run_case(model, case, fid, keys, n_answer: int, eos):
    import torch
    from transformers import DynamicCache

    press = None
    if case.get("press"):
        ratio = case.get("ratio")
        if ratio is None:  # a token budget: the share of the context it evicts
            n_ctx = fid["context"].shape[1] if fid else keys[0]["context"].shape[1]
            ratio = max(0.0, 1 - case["budget"] / n_ctx)
        press = _press(case["press"], float(ratio))
    out: dict = {}
    if fid is not None:
        ctx, cont = fid["context"], fid["continuation"]
        cache = DynamicCache()
        _prefill(model, press, ctx, cache)
        out["kept"] = sum(cache.get_seq_length(i) for i in range(len(cache))) / len(cache)
        out["context"] = ctx.shape[1]
        lp = torch.log_softmax(_continue(model, cache, cont[:, :-1], ctx.shape[1]), -1)  # [T, V]
        target = cont[0, 1:]
        out["nll"] = (-lp[torch.arange(target.shape[0]), target]).tolist()
        out["_lp"] = lp
    answers = []
    for k in keys:
        cache = DynamicCache()
        _prefill(model, press, k["context"], cache)
        answers.append(_answer(model, cache, k["question"], k["context"].shape[1], n_answer, eos))
    out["passkey"] = answers
    return out


def main() -> int:
    req = json.load(sys.stdin)
    import torch
    import transformers

    import kvpress

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    torch.set_num_threads(int(req.get("threads") or torch.get_num_threads()))
    versions = {"kvpress": getattr(kvpress, "__version__", None), "transformers": transformers.__version__,
                "torch": torch.__version__}
    try:
        from importlib.metadata import version

        versions["kvpress"] = version("kvpress")
    except Exception:  # noqa: BLE001
        pass
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}

    def model_for(press: str | None):
        impl = "eager" if press == "h2o" else "sdpa"  # kvpress's observed attention needs the weights
        if impl not in models:
            models[impl] = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32,
                                                                attn_implementation=impl).eval()
        return models[impl]

    fid = None
    if req.get("fidelity"):
        fid = {k: torch.tensor([req["fidelity"][k]]) for k in ("context", "continuation")}
    keys = [{k: torch.tensor([p[k]]) for k in ("context", "question")} for p in req.get("passkey") or []]
    n_answer = int(req.get("answer_tokens", 8))
    answer = {"versions": versions, "results": []}
    with torch.inference_mode():
        m = model_for(None)
        eos = req.get("eos") or m.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        t0 = time.perf_counter()
        ref = _run_case(m, {}, fid, keys, n_answer, eos)
        answer["reference"] = {"nll": ref.get("nll"), "passkey": ref["passkey"],
                               "seconds": time.perf_counter() - t0}
        for case in req.get("cases", []):
            row = {k: case.get(k) for k in ("press", "ratio", "budget")}
            t0 = time.perf_counter()
            try:
                got = _run_case(model_for(case["press"]), case, fid, keys, n_answer, eos)
            except Exception as e:  # noqa: BLE001  (one press failing is that row's note)
                msg = str(e).strip().splitlines()
                row["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"
                row["trace"] = traceback.format_exc(limit=3)
                answer["results"].append(row)
                continue
            if fid is not None:
                lr, lp = ref["_lp"], got.pop("_lp")
                row["kl"] = (lr.exp() * (lr - lp)).sum(-1).tolist()
                row["agree"] = (lr.argmax(-1) == lp.argmax(-1)).int().tolist()
            row.update(got)
            row["seconds"] = time.perf_counter() - t0
            answer["results"].append(row)
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
