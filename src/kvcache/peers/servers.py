"""Servers speaking OpenAI's API (``kvcache serve``, ``llama-server``) as peers: ``server(cmd, port,
label)`` starts one, waits for its ``/health`` and stops it; ``stream`` sends one streamed request and
returns its times, tokens and text, or its error."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvcache.peers.process import DEFAULT_TIMEOUT_S, stop_process

START_TIMEOUT_S = 300.0  # a server's time to answer /health


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
