"""EngineLoop: the scheduler on its own thread, for servers and concurrent callers.

Callers on any thread ``submit`` requests and ``abort`` them; the loop thread drains those
commands between steps, runs ``Scheduler.step`` while there is work and sleeps when there is none;
after ``IDLE_SHRINK_S`` with nothing to do it lets the pool give its spare pages back
(``Scheduler.idle``), once per idle spell.
Deltas and completions are delivered by callbacks on the loop thread (a server hands them to its
event loop with ``call_soon_threadsafe``). ``call`` runs a function on the loop thread between
steps (statistics, integrity checks) and returns its result.

Locking: one lock guards the inbox; the scheduler, runner and cache are touched only by the loop
thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcache.engine.request import Request, error_kind
from kvcache.engine.scheduler import Scheduler

IDLE_SHRINK_S = 1.0  # idle this long, the dynamic pool gives back what it does not use


class EngineLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inbox: list[tuple[str, Any]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._done: dict[str, Callable[[Request], None]] = {}
        self.step_s = 0.0  # time spent in steps (busy time)
        self.shrunk_bytes = 0  # given back by idle shrinks
        self._spare = False  # work ran since the last shrink
        self._idle_since = 0.0  # when the last step ended
        self._working_since: float | None = None  # when the loop last made progress while it had work; None: waiting
        self._thread = threading.Thread(target=self._run, name="kvcache-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request, on_done: Callable[[Request], None]) -> None:
        """Queue ``req``; ``on_done(req)`` runs on the loop thread when it finishes, fails (see
        ``req.error``) or is refused at admission."""
        self._post("add", (req, on_done))

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def call(self, fn: Callable[[], Any], timeout: float | None = 60) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result."""
        fut: Future = Future()
        self._post("call", (fn, fut))
        return fut.result(timeout)

    def stalled_for(self) -> float | None:
        """Seconds since the loop last made progress (finished a step or a command) while it had
        work; None while it waits for work. A step that hangs (a tier read that never returns, a
        kernel stuck) shows here and in the server's /health."""
        since = self._working_since
        return None if since is None else time.monotonic() - since

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _post(self, kind: str, payload: Any) -> None:
        with self._cv:
            self._inbox.append((kind, payload))
            self._cv.notify()

    def _run(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                if not self._inbox and not sched.has_work:
                    self._working_since = None
                while not self._inbox and not sched.has_work and not self._stop:
                    left = self._idle_since + IDLE_SHRINK_S - time.monotonic() if self._spare else None
                    if left is not None and left <= 0:
                        break
                    self._cv.wait(left)
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
                if self._working_since is None:
                    self._working_since = time.monotonic()
            for kind, payload in inbox:
                self._handle(kind, payload)
            if sched.has_work:
                t0 = time.perf_counter()
                try:
                    finished = sched.step()
                except Exception as e:  # a bug must not hang every client: fail what is running
                    finished = self._fail_all(f"internal error: {type(e).__name__}: {e}")
                    for req in finished:
                        req.error_kind = "internal"
                self.step_s += time.perf_counter() - t0
                self._working_since = time.monotonic()
                self._spare, self._idle_since = True, time.monotonic()
                for req in finished:
                    self._finish(req)
            elif self._spare and time.monotonic() - self._idle_since >= IDLE_SHRINK_S:
                self._spare = False
                try:
                    self.shrunk_bytes += sched.idle()
                except Exception:  # giving memory back is best effort; the pool stays as it was
                    pass

    def _handle(self, kind: str, payload: Any) -> None:
        sched = self.scheduler
        if kind == "add":
            req, on_done = payload
            try:
                sched.add(req)
                self._done[req.request_id] = on_done
            except Exception as e:
                req.error, req.error_kind = str(e), error_kind(e)
                on_done(req)
        elif kind == "abort":
            if sched.abort(payload):
                self._done.pop(payload, None)  # not reported: its client is gone
        elif kind == "call":
            fn, fut = payload
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _finish(self, req: Request) -> None:
        cb = self._done.pop(req.request_id, None)
        if cb is not None:
            cb(req)

    def _fail_all(self, message: str) -> list[Request]:
        sched = self.scheduler
        failed = []
        for req in list(sched.running) + list(sched.waiting):
            sched.abort(req.request_id)
            req.error = message
            failed.append(req)
        return failed
