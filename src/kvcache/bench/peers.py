"""The peers kvcache is measured beside, behind one interface: how each is found, started in a
process of its own, and what its failure becomes (a row marked skipped, with the reason, never a
failed benchmark).

- child processes (transformers, llama-cpp-python, grammar engines, kvcache itself in a fresh
  process): ``run(cmd, ...)`` runs one command and returns an ``Outcome``: the JSON it printed last
  (a line starting with ``{`` or ``[``, or the whole of stdout when that parses), or a one-line note
  saying why there is none: the signal that killed it (``crashed: SIGSEGV``), its exit status with
  the last line of its error output, or the time limit it ran past. ``run_module`` sends a JSON
  request to ``python -m MODULE``, whose side is ``child_main``.
- transformers: ``transformers_model`` loads the fp32 folder kvcache converted, or says it is
  not installed.
- llama.cpp's tools (llama-bench, llama-quantize, llama-server): ``--llama-cpp-bin DIR``,
  ``$KVCACHE_LLAMA_CPP_BIN`` or what ``make llamacpp`` built (``<venv>/llama.cpp/bin``):
  ``check_bin``, ``find_tool``, ``llama_server``.
- servers speaking OpenAI's API (``kvcache serve``, ``llama-server``): ``server(cmd, port, label)``
  starts one, waits for its ``/health`` and stops it; ``stream`` sends one streamed request and
  returns its times, tokens and text, or its error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.errors import InvalidParams

DEFAULT_TIMEOUT_S = 3600.0
START_TIMEOUT_S = 300.0  # a server's time to answer /health
NO_TRANSFORMERS = "transformers not installed: skipped"
NO_SERVER = ("llama-server not built: `make llamacpp`, then `cmake --build .venv/llama.cpp/build --target "
             "llama-server`: skipped")


@dataclass(frozen=True)
class Outcome:
    data: Any = None  # the parsed JSON output, or None
    note: str = ""  # why there is no data ("" when there is)
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.data is not None


def signal_name(returncode: int) -> str | None:
    """``SIGSEGV`` for a process killed by signal 11 (return code -11), else None."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no error output"


def parse_json(stdout: str) -> Any:
    """The JSON a child printed: all of stdout when it parses, else its last JSON line; None if none."""
    text = stdout.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def run(cmd: list[str], label: str, stdin: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
        env: dict[str, str] | None = None, expect_json: bool = True, echo: str | None = None) -> Outcome:
    """Run ``cmd`` in a child process; ``label`` names it in notes (``llama-bench crashed: SIGSEGV``).
    Without ``expect_json`` a clean exit is enough (its data is then ``{}``). With ``echo``, each
    line the child writes to stderr is also written to this process's stderr as it comes, after
    that prefix (status lines of long runs)."""
    try:
        if echo is None:
            p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout,
                               env=env if env is not None else dict(os.environ))
        else:
            p = _run_echoed(cmd, stdin, timeout, env, echo)
    except subprocess.TimeoutExpired:
        return Outcome(note=f"{label} ran past {timeout:.0f} s and was stopped")
    except OSError as e:
        return Outcome(note=f"{label} could not start: {e.strerror or e}")
    sig = signal_name(p.returncode)
    if sig is not None:
        return Outcome(note=f"{label} crashed: {sig}", stderr=p.stderr)
    if p.returncode != 0:
        return Outcome(note=f"{label} failed (exit {p.returncode}): {_last_line(p.stderr or p.stdout)}",
                       stderr=p.stderr)
    data = parse_json(p.stdout) if expect_json else {}
    if data is None:
        return Outcome(note=f"{label} printed no result: {_last_line(p.stderr or p.stdout)}", stderr=p.stderr)
    return Outcome(data=data, stderr=p.stderr)


def _run_echoed(cmd: list[str], stdin: str | None, timeout: float, env: dict[str, str] | None,
                echo: str) -> subprocess.CompletedProcess:
    """``subprocess.run`` with captured output whose stderr lines are also echoed as they come."""
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env if env is not None else dict(os.environ))
    out: list[str] = []
    err: list[str] = []

    def drain_err() -> None:
        for line in p.stderr:  # type: ignore[union-attr]
            err.append(line)
            sys.stderr.write(echo + line)
            sys.stderr.flush()

    readers = [threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True),  # type: ignore[union-attr]
               threading.Thread(target=drain_err, daemon=True)]
    for t in readers:
        t.start()
    try:
        if stdin:
            p.stdin.write(stdin)  # type: ignore[union-attr]
        p.stdin.close()  # type: ignore[union-attr]
    except BrokenPipeError:
        pass
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    finally:
        for t in readers:
            t.join(timeout=5)
    return subprocess.CompletedProcess(cmd, p.returncode, "".join(out), "".join(err))


def run_module(module: str, request: dict[str, Any], label: str, timeout: float = DEFAULT_TIMEOUT_S,
               echo: str | None = None) -> Outcome:
    """``python -m module`` with ``request`` as JSON on its stdin (see ``child_main``)."""
    return run([sys.executable, "-m", module], label, stdin=json.dumps(request), timeout=timeout, echo=echo)


def child_main(handler: Callable[[dict[str, Any]], object]) -> int:
    """The child's side: read a JSON request from stdin, print the handler's result as one JSON line."""
    request = json.loads(sys.stdin.read() or "{}")
    result = handler(request)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# -- transformers ---------------------------------------------------------------------------------


def transformers_model(model_dir: str | Path) -> Any | None:
    """transformers' causal LM of ``model_dir`` in fp32, in eval mode (kvcache's fp32 folder,
    ``models.loading.fp32_folder``: the weights of kvcache's ``fp32`` mode); None when transformers
    is not installed (its rows then say ``NO_TRANSFORMERS``)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    import torch

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


# -- llama.cpp's tools ------------------------------------------------------------------------------


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


# -- servers speaking OpenAI's API --------------------------------------------------------------------


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> str | None:
    """None when ``url`` answers /health with 200; else why not (the process ended, or too slow)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            return f"exited with {proc.returncode}" + (f": {tail[0][:160]}" if tail else "")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.5)
    return f"not ready after {timeout:.0f} s"


@contextmanager
def server(cmd: list[str], port: int, label: str) -> Iterator[tuple[str | None, str]]:
    """Start ``cmd`` (a server listening on ``port``); yields (url or None, why not), and stops it."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-serve-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as out:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            except OSError as e:
                yield None, f"{label} did not start: {e}"
                return
            try:
                why = _wait_ready(url, proc, log, START_TIMEOUT_S)
                yield (None, f"{label} {why}") if why else (url, "")
            finally:
                stop_process(proc, 30)


def sse_events(url: str, body: dict, timeout: float) -> Iterator[dict]:
    """The JSON events of a streamed OpenAI response to ``body`` POSTed at ``url`` (its ``data:``
    lines up to ``[DONE]``); a failed connection or a bad status raises OSError."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


@dataclass
class Stream:
    """One streamed request's outcome (times from the request's sending)."""

    ttft_s: float | None = None  # the first non-empty text
    last_s: float | None = None  # the last non-empty text
    total_s: float = 0.0
    tokens: int = 0  # completion tokens: the usage's, else one a piece of text
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first."""
        if self.ttft_s is None or self.last_s is None or self.tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.tokens - 1)


def stream(url: str, body: dict, on_first: Callable[[], object] | None = None,
           timeout: float = DEFAULT_TIMEOUT_S) -> Stream:
    """POST ``body`` (streamed, greedy, EOS ignored, to the model ``default``) to ``url``
    (``.../v1/completions`` or ``.../chat/completions``); ``on_first`` is called when the first text
    arrives. A failure is an ``error`` text, never raised."""
    body = {"model": "default", "temperature": 0, "ignore_eos": True, **body, "stream": True,
            "stream_options": {"include_usage": True}}
    out, pieces, text = Stream(), 0, []
    t0 = time.perf_counter()
    try:
        for ev in sse_events(url, body, timeout):
            if "error" in ev:
                out.error = str(ev["error"])[:160]
            usage = ev.get("usage")
            if usage:
                out.tokens, out.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for ch in ev.get("choices", []):
                piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                if piece:
                    out.last_s = time.perf_counter() - t0
                    if out.ttft_s is None:
                        out.ttft_s = out.last_s
                        if on_first is not None:
                            on_first()
                    pieces += 1
                    text.append(piece)
    except (OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:160]
    out.total_s = time.perf_counter() - t0
    out.tokens, out.text = out.tokens or pieces, "".join(text)
    if not out.error and out.ttft_s is None:
        out.error = "no text came back"
    return out


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Ask ``proc`` to stop (SIGTERM); kill it when it has not within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
