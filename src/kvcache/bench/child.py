"""Peers run in child processes: whatever a peer does (a segfault in its native code, an abort, a
hang), the benchmark reports it as a skipped row and goes on.

``run(cmd, ...)`` runs one command and returns a ``Outcome``: the JSON it printed last (a line
starting with ``{`` or ``[``, or the whole of stdout when that parses), or a one-line note saying
why there is none: the signal that killed it (``crashed: SIGSEGV``), its exit status with the last
line of its error output, or the time limit it ran past.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
        env: dict[str, str] | None = None, expect_json: bool = True) -> Outcome:
    """Run ``cmd`` in a child process; ``label`` names it in notes (``llama-bench crashed: SIGSEGV``).
    Without ``expect_json`` a clean exit is enough (its data is then ``{}``)."""
    try:
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout,
                           env=env if env is not None else dict(os.environ))
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


def run_module(module: str, request: dict[str, Any], label: str, timeout: float = DEFAULT_TIMEOUT_S) -> Outcome:
    """``python -m module`` with ``request`` as JSON on its stdin (see ``child_main``)."""
    return run([sys.executable, "-m", module], label, stdin=json.dumps(request), timeout=timeout)


def child_main(handler: Callable[[dict[str, Any]], object]) -> int:
    """The child's side: read a JSON request from stdin, print the handler's result as one JSON line."""
    request = json.loads(sys.stdin.read() or "{}")
    result = handler(request)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0
