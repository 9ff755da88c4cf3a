"""llama.cpp's own tools as the peer: ``llama-bench`` measures, ``llama-quantize`` converts.

Each GGUF gets one ``llama-bench -o json`` run (a child process): prompt tests (``-p``) for the
chat prompt's length (its time is the row's TTFT) and for each prefill length, and a generation
test (``-n``) of the same number of new tokens as kvcache (llama-bench generates from an empty
context; at a few dozen tokens of context the KV is a negligible part of a step). The long-context
row is a second run with ``-d DEPTH -ctk q8_0 -ctv q8_0``: decode after DEPTH tokens held in an
8-bit KV cache. A run that crashes, fails or prints no JSON gives rows with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvcache.bench.child import run
from kvcache.bench.rows import Row, step_bytes


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


def tool(bin_dir: Path, name: str) -> Path | None:
    p = bin_dir / name
    return p if p.is_file() and os.access(p, os.X_OK) else None


def convert(bin_dir: Path, src: Path, ftype: str, out: Path) -> str | None:
    """Write ``src`` converted to ``ftype`` at ``out`` with llama-quantize; None, or why it failed."""
    exe = tool(bin_dir, "llama-quantize")
    if exe is None:
        return f"no llama-quantize in {bin_dir}: {ftype} conversion skipped"
    tmp = out.with_name(out.name + ".tmp")
    res = run([str(exe), "--allow-requantize", str(src), str(tmp), ftype], "llama-quantize", timeout=1800,
              expect_json=False)
    if not res.ok or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        return res.note or f"llama-quantize wrote no {ftype} file"
    tmp.rename(out)
    return None


def _row(label: str, pair: str, cache: str, test: str, tokens: int) -> Row:
    return Row("llama.cpp", label, cache, pair, test, tokens)


def expected(label: str, pair: str, work: Work, depth: bool) -> list[Row]:
    """The rows one GGUF gives, empty (to carry a note when they cannot be measured)."""
    rows = [_row(label, pair, "f16", "decode", work.prompt_len)]
    rows += [_row(label, pair, "f16", "prefill", n) for n in work.prefill]
    if depth and work.depth_ids:
        rows.append(_row(label, pair, "q8_0", "depth", len(work.depth_ids)))
    return rows


def measure(bin_dir: Path, model: Path, label: str, pair: str, work: Work, depth: bool) -> list[Row]:
    exe = bin_dir / "llama-bench"
    rows = expected(label, pair, work, depth)
    decode, prefill = rows[0], {r.tokens: r for r in rows if r.test == "prefill"}
    lengths = sorted({work.prompt_len, *work.prefill})
    base = [str(exe), "-m", str(model), "-t", str(work.threads), "-r", str(work.repeats), "-o", "json"]
    res = run(base + ["-p", ",".join(map(str, lengths)), "-n", str(work.new)], "llama-bench")
    if not res.ok:
        for r in rows:
            r.note = res.note
        return rows
    wbytes = model.stat().st_size
    for t in res.data if isinstance(res.data, list) else []:
        n_prompt, n_gen = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        ts = [float(x) for x in t.get("samples_ts", [])]
        ns = [float(x) for x in t.get("samples_ns", [])]
        if n_gen and not n_prompt:
            decode.tok_s = ts
            kv16 = work.kv_f32_per_token / 2
            decode.gb_s = [step_bytes(wbytes, kv16, 0, work.new) * x / 1e9 for x in ts]
        elif n_prompt and not n_gen:
            if n_prompt == work.prompt_len:
                decode.ttft_s = [x / 1e9 for x in ns]
            if n_prompt in prefill:
                prefill[n_prompt].tok_s = ts
    for r in rows:
        if r.test != "depth" and not r.tok_s:
            r.note = "llama-bench gave no result for this test"
    if depth and work.depth_ids:
        rows[-1] = _depth(base, model, rows[-1], work)
    return rows


def _depth(base: list[str], model: Path, row: Row, work: Work) -> Row:
    d = len(work.depth_ids)
    args = ["-p", "0", "-n", str(work.depth_new), "-d", str(d), "-ctk", "q8_0", "-ctv", "q8_0"]
    res = run(base + args, "llama-bench")
    if not res.ok:
        row.note = res.note
        return row
    for t in res.data if isinstance(res.data, list) else []:
        if int(t.get("n_gen", 0)) and int(t.get("n_depth", 0)) == d:
            row.tok_s = [float(x) for x in t.get("samples_ts", [])]
            kv8 = work.kv_f32_per_token * 34 / 128  # q8_0: 34 bytes per 32 values
            row.gb_s = [step_bytes(model.stat().st_size, kv8, d, work.depth_new) * x / 1e9 for x in row.tok_s]
    if not row.tok_s:
        row.note = "llama-bench gave no result at this depth"
    return row
