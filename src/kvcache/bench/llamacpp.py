"""llama.cpp through llama-cpp-python (the optional extra ``pip install 'kvcache[llamacpp]'``),
always in a child process: the parent never loads llama.cpp's native library, so a crash there is a
skipped row, not a dead benchmark.

The child converts a GGUF with llama.cpp's own quantize API (``op: convert``) or measures one
GGUF (``op: bench``): decode after the chat prompt's token ids (greedy, EOS never checked, the
same number of new tokens and threads), prompt tokens per second of each prefill prompt into an
empty context, and decode after a long context held in a q8_0 KV cache (flash attention on, which
llama.cpp needs for a quantized V).

Run as ``python -m kvcache.bench.llamacpp`` with a JSON request on stdin; prints JSON.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcache.bench.child import child_main, run_module
from kvcache.bench.rows import Row, step_bytes
from kvcache.bench.llamabench import Work, expected

if TYPE_CHECKING:
    from llama_cpp import Llama

FTYPES = {"F32": 0, "Q8_0": 7, "Q4_1": 3}  # llama_ftype values
GGML_TYPE_Q8_0 = 8


def installed() -> bool:
    """Whether llama-cpp-python can be found (without loading its native library here)."""
    return importlib.util.find_spec("llama_cpp") is not None


def convert(src: Path, ftype: str, out: Path) -> str | None:
    """Write ``src`` converted to ``ftype`` at ``out`` (in a child); None, or why it failed."""
    res = run_module("kvcache.bench.llamacpp", {"op": "convert", "src": str(src), "ftype": ftype, "out": str(out)},
                     "llama-cpp-python")
    return None if res.ok and out.is_file() else (res.note or f"no {ftype} file written")


def measure(model: Path, label: str, pair: str, work: Work, depth: bool) -> list[Row]:
    req = {"op": "bench", "model": str(model), "label": label, "pair": pair, "ids": work.ids, "new": work.new,
           "repeats": work.repeats, "threads": work.threads,
           "prefill": {str(n): p for n, p in work.prefill.items()},
           "depth_ids": work.depth_ids if depth else [], "depth_new": work.depth_new,
           "kv_f32_per_token": work.kv_f32_per_token}
    res = run_module("kvcache.bench.llamacpp", req, "llama-cpp-python")
    if not res.ok:
        rows = expected(label, pair, work, depth)
        for r in rows:
            r.note = res.note
        return rows
    return [Row.from_dict(d) for d in res.data]


# -- the child's side ---------------------------------------------------------------------------

def _convert(req: dict[str, Any]) -> dict[str, object]:
    import llama_cpp

    out = Path(req["out"])
    tmp = out.with_name(out.name + ".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[req["ftype"]]
    params.allow_requantize = True
    params.nthread = 0
    rc = llama_cpp.llama_model_quantize(req["src"].encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama.cpp could not convert {Path(req['src']).name} to {req['ftype']} (code {rc})")
    tmp.rename(out)
    return {"out": str(out)}


def _generate(llm: Llama, ids: list[int], new: int, fresh: bool = True) -> tuple[float, float, int]:
    """(time to first token, time for the rest, tokens made) of one greedy generation; ``fresh``
    starts from an empty context, else the context's matching prefix is kept."""
    if fresh:
        llm.reset()
    t0 = time.perf_counter()
    t_first, made = 0.0, 0
    for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        made += 1
        if made == 1:
            t_first = time.perf_counter()
        if made >= new:
            break
    return t_first - t0, time.perf_counter() - t_first, made


def _bench(req: dict[str, Any]) -> list[dict[str, object]]:
    from llama_cpp import Llama

    model, label, pair = Path(req["model"]), req["label"], req["pair"]
    ids, new, repeats, threads = list(req["ids"]), int(req["new"]), int(req["repeats"]), int(req["threads"])
    prefill = {int(n): p for n, p in req["prefill"].items()}
    longest = max([len(ids) + new, *prefill]) + 16
    common = dict(n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    llm = Llama(model_path=str(model), n_ctx=longest, **common)
    wbytes, kv16 = model.stat().st_size, int(req["kv_f32_per_token"]) / 2
    decode = Row("llama.cpp", label, "f16", pair, "decode", len(ids))
    _generate(llm, ids[:8], 4)  # warm-up
    for _ in range(repeats):
        ttft, rest, made = _generate(llm, ids, new)
        tok_s = (made - 1) / rest if rest > 0 else 0.0
        decode.ttft_s.append(ttft)
        decode.tok_s.append(tok_s)
        decode.gb_s.append(step_bytes(wbytes, kv16, len(ids), new) * tok_s / 1e9)
    rows = [decode]
    for n, p in prefill.items():
        row = Row("llama.cpp", label, "f16", pair, "prefill", n)
        for _ in range(repeats):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(p)
            row.tok_s.append(n / (time.perf_counter() - t0))
        rows.append(row)
    del llm
    depth_ids = list(req["depth_ids"])
    if depth_ids:
        rows.append(_depth(model, label, pair, depth_ids, int(req["depth_new"]), repeats, common,
                           int(req["kv_f32_per_token"])))
    return [vars(r) for r in rows]


def _depth(model: Path, label: str, pair: str, ids: list[int], new: int, repeats: int, common: dict,
           kv_f32: int) -> Row:
    from llama_cpp import Llama

    row = Row("llama.cpp", label, "q8_0", pair, "depth", len(ids))
    llm = Llama(model_path=str(model), n_ctx=len(ids) + new + 16, type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0,
                flash_attn=True, **common)
    llm.eval(ids)  # the context, once; each repeat reuses it (llama-cpp-python's prefix match)
    kv8 = kv_f32 * 34 / 128  # q8_0: 34 bytes per 32 values
    for _ in range(repeats):
        _, rest, made = _generate(llm, ids, new, fresh=False)
        tok_s = (made - 1) / rest if rest > 0 else 0.0
        row.tok_s.append(tok_s)
        row.gb_s.append(step_bytes(model.stat().st_size, kv8, len(ids), new) * tok_s / 1e9)
    return row


def _handle(req: dict[str, Any]) -> object:
    return _convert(req) if req.get("op") == "convert" else _bench(req)


if __name__ == "__main__":
    raise SystemExit(child_main(_handle))
