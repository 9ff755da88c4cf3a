"""Peers in child processes: ``run(cmd, ...)`` runs one command and returns an ``Outcome``: the JSON
it printed last (a line starting with ``{`` or ``[``, or the whole of stdout when that parses), or a
one-line note saying why there is none: the signal that killed it (``crashed: SIGSEGV``), its exit
status with the last line of its error output, or the time limit it ran past. ``run_module`` sends a
JSON request to ``python -m MODULE``, whose side is ``child_main``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 3600.0


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


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Ask ``proc`` to stop (SIGTERM); kill it when it has not within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the resident set of this process, for the memory probes ------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples the resident set on a thread between start() and stop()."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every_s)

    def __enter__(self) -> "PeakRss":
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
