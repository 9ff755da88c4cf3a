"""llama.cpp's own tools as peers: ``--llama-cpp-bin DIR``, ``$KVCACHE_LLAMA_CPP_BIN`` or what ``make
llamacpp`` built (``<venv>/llama.cpp/bin``). ``check_bin`` and ``find_tool`` find them, ``quantize``
runs llama-quantize, ``llama_server``/``llama_server_cmd`` start llama-server (the serve and spec
suites), ``llama_perplexity`` reads a text with llama-perplexity (``kvcache eval --compare-weights``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcache.errors import InvalidParams
from kvcache.peers.process import run

NO_SERVER = ("llama-server not built: `make llamacpp`, then `cmake --build .venv/llama.cpp/build --target "
             "llama-server`: skipped")


def tool(bin_dir: Path, name: str) -> Path | None:
    """``bin_dir/name`` when it is an executable file, else None."""
    p = bin_dir / name
    return p if p.is_file() and os.access(p, os.X_OK) else None


def default_bin() -> Path | None:
    """$KVCACHE_LLAMA_CPP_BIN, else ``make llamacpp``'s folder when it holds llama-bench."""
    env = os.environ.get("KVCACHE_LLAMA_CPP_BIN")
    if env:
        return Path(env)
    here = Path(sys.prefix) / "llama.cpp" / "bin"
    return here if tool(here, "llama-bench") else None


def check_bin(arg: str | None) -> Path | None:
    """The folder of llama.cpp's tools to use, or None; a folder without llama-bench is refused."""
    where = Path(arg).expanduser() if arg else default_bin()
    if where is None:
        return None
    flag = "--llama-cpp-bin" if arg else "KVCACHE_LLAMA_CPP_BIN"
    if not where.is_dir():
        raise InvalidParams(f"{flag} {where}: not a folder")
    if tool(where, "llama-bench") is None:
        raise InvalidParams(f"{flag} {where}: no executable llama-bench there (`make llamacpp` builds one)")
    return where


def quantize(bin_dir: Path, src: Path, ftype: str, out: Path) -> str | None:
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


def find_tool(arg: str | None, name: str) -> tuple[Path | None, str]:
    """(the tool's path, "") or (None, why it is not there): never an error."""
    where = Path(arg).expanduser() if arg else default_bin()
    if where is None:
        return None, f"no {name}: build llama.cpp's tools with `make llamacpp` or pass --llama-cpp-bin DIR"
    exe = tool(where, name)
    return (exe, "") if exe else (None, f"no executable {name} in {where} (`make llamacpp` builds one)")


def llama_server(arg: str | None, gguf: Path | None) -> tuple[Path | None, str]:
    """(llama-server's path, "") to serve ``gguf``, or (None, why it is skipped); a folder given
    without llama-bench is refused (``check_bin``)."""
    where = check_bin(arg)
    binary = tool(where, "llama-server") if where else None
    if gguf is None:
        return None, "no GGUF file for this model: skipped"
    return (binary, "") if binary else (None, NO_SERVER)


def llama_server_cmd(binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx: int,
                     lookup: int | None = None) -> list[str]:
    """llama-server with ``slots`` slots sharing ``ctx`` tokens; ``lookup``: its n-gram prompt
    lookup proposing at most that many tokens a forward."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
           str(threads), "-np", str(slots), "-c", str(ctx), "--no-webui", "--log-disable"]
    if lookup:
        cmd += ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(lookup)]
    return cmd


def llama_perplexity(bin_dir: str, gguf: str, text: str, ctx: int, n_chunks: int, threads: int,
                     tries: int = 3) -> tuple[float | None, str]:
    """(perplexity, note) of llama.cpp's llama-perplexity on ``text``; None with a note when it
    cannot be had (missing binary, a crash, an unreadable report). A run that ends without its
    report (seen on a busy host: exit 0 and no output past loading) is tried again, ``tries`` in all."""
    exe = Path(bin_dir) / "llama-perplexity"
    if not exe.is_file():
        return None, f"no llama-perplexity in {bin_dir}"
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
    note = ""
    try:
        for _ in range(tries):
            value, note = _one_perplexity_run(exe, gguf, f.name, ctx, n_chunks, threads)
            if value is not None or "signal" in note:
                return value, note
    finally:
        Path(f.name).unlink(missing_ok=True)
    return None, note


def _one_perplexity_run(exe: Path, gguf: str, text_file: str, ctx: int, n_chunks: int,
                        threads: int) -> tuple[float | None, str]:
    """One llama-perplexity run. Its log is written by a thread that can lose the last lines when
    the process exits, so it is asked for one chunk more than is wanted: the running estimate after
    chunk ``n_chunks`` ("[N]value", the perplexity of the first N chunks) is printed while the extra
    chunk still computes. A text of exactly ``n_chunks`` chunks gives its final estimate instead."""
    try:
        p = subprocess.run([str(exe), "-m", gguf, "-f", text_file, "-c", str(ctx), "--chunks", str(n_chunks + 1),
                            "-t", str(threads), "-b", str(ctx)], capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"llama-perplexity did not run: {e}"
    if p.returncode < 0:
        return None, f"llama-perplexity died of signal {-p.returncode}"
    out = p.stdout + p.stderr
    running = re.findall(rf"\[{n_chunks}\]([0-9.]+)", out)
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    only_n = re.search(rf"perplexity over {n_chunks} chunks", out)
    if p.returncode == 0 and running:
        return float(running[-1]), ""
    if p.returncode == 0 and final and only_n:
        return float(final.group(1)), ""
    last = out.strip().splitlines()[-1][:200] if out.strip() else "no output"
    return None, f"llama-perplexity failed (exit {p.returncode}): {last}"
