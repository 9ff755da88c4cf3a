"""llama.cpp beside ``kvcache bench context --long``: llama-bench on the same GGUF, in child processes.

Decode at depth: one run per KV type, ``llama-bench -p 0 -n NEW -d N1,N2,.. -fa 1 -ctk X -ctv X``
(it prefills each depth once, untimed, and restores that state for its repeats). Prefill: one
run ``-p 512 -n 0 -fa 1`` (with its warm-up) and one ``-p N1,N2,.. -n 0 -fa 1 --no-warmup -r 1``
(a warm-up would run each long prompt twice), f16 KV, llama-bench's defaults otherwise. A run
that cannot start, crashes or prints no JSON leaves its rows skipped with the reason; a
missing llama-bench skips them all, naming what is missing.

The bytes a llama.cpp step reads are counted as ``bench decode`` counts them: the GGUF file's
size (a tied model's file holds each weight once), plus the KV at its type's block size.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcache.bench.child import run
from kvcache.bench.longctx_table import REFERENCE, DepthRow
from kvcache.bench.rows import Tick
from kvcache.errors import InvalidParams

# bytes per K or V value of each llama.cpp KV type (blocks of 32 values with an fp16 scale)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                 "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
LONG_TIMEOUT_S = 4 * 3600.0


def parse_kv_types(text: str) -> list[str]:
    """``--peers`` of the long mode: llama.cpp KV types ('' runs no llama.cpp)."""
    types = list(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    for t in types:
        if t not in KV_TYPE_BYTES:
            raise InvalidParams(f"--peers: unknown llama.cpp KV type {t!r}; choose from {', '.join(KV_TYPE_BYTES)} "
                                "('' runs no llama.cpp)")
    return types


def find_bench(arg: str | None) -> tuple[Path | None, str]:
    """(llama-bench's path, "") or (None, why it is not there): never an error."""
    from kvcache.bench.llamapeer import default_bin

    where = Path(arg).expanduser() if arg else default_bin()
    if where is None:
        return None, "no llama-bench: build llama.cpp's tools with `make llamacpp` or pass --llama-cpp-bin DIR"
    exe = where / "llama-bench"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return None, f"no executable llama-bench in {where} (`make llamacpp` builds one)"
    return exe, ""


def expected(types: list[str], contexts: list[int], new: int) -> list[DepthRow]:
    """Every llama.cpp row, empty."""
    rows = [DepthRow("llama.cpp", "f16", "prefill", n) for n in [REFERENCE, *contexts]]
    rows += [DepthRow("llama.cpp", t, "decode", c, new=new) for t in types for c in contexts]
    return rows


def measure(exe: Path | None, why: str, model: Path | None, types: list[str], contexts: list[int], new: int,
            repeats: int, threads: int, kv_values_per_token: int, tick: Tick | None = None) -> list[DepthRow]:
    """llama.cpp's prefill and decode rows; ``kv_values_per_token``: K and V values of one token
    over all layers (2 x layers x KV heads x head dim)."""
    rows = expected(types, contexts, new)
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
    runs = [(["-p", str(REFERENCE), "-n", "0", "-r", str(repeats)], [prefill[REFERENCE]]),
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
