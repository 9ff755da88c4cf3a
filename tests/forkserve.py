"""`python -m kvcache ...` (and `python -c CODE ...`) for the tests, started without paying for torch's
import every time.

The suite starts the console command a few hundred times (servers, CLI runs), and each fresh
interpreter spends 1-2 s of CPU importing torch, fastapi and friends before kvcache's first line.
Here one helper process per pytest worker imports those libraries (and nothing of kvcache), then
forks a child for each run: the child takes the caller's stdin/stdout/stderr, working folder,
environment and arguments, imports kvcache afresh and runs its `__main__` exactly as the console
command does (or the code of a `-c`), exit status and signals included. What kvcache reads from
the environment at its import (the kernel variant, KVCACHE_AMX, KVCACHE_HOME) is read in the child;
what torch reads at its own import (ATEN_CPU_CAPABILITY) is the helper's, so such runs start fresh.

The caller sees an ordinary `subprocess.Popen` of a tiny stdlib-only stand-in (this file run as
a script with `--run`): the stand-in hands its three streams to the helper, forwards the signals
it is sent (FORWARDED) to the forked child, and exits as the child did (with the same signal where the child
was killed). If the stand-in itself is killed (SIGKILL), the helper kills the child.

Tests of start-up itself (signals during imports, what a command imports, first compiles) start a
real interpreter instead: see `run_kvcache(..., fresh=True)` and `Server(..., fresh=True)`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

# third-party modules kvcache's commands import; none reads kvcache's settings at import time
PREIMPORT = ("numpy", "torch", "fastapi", "uvicorn", "pydantic", "starlette", "httpx", "jinja2", "tokenizers",
             "psutil", "yaml")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH)


def _send(sock: socket.socket, kind: bytes, value: int) -> None:
    sock.sendall(kind + struct.pack("!q", value))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


# --- the helper ---------------------------------------------------------------------------------

def _serve(path: str) -> tuple[list[int], dict]:
    """Accept runs until one forks; in the child, return that run's streams and request."""
    import importlib
    import threading

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import gc

    gc.collect()
    gc.freeze()  # what the imports made stays out of every child's collections (and its copy-on-write)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the pytest worker is gone: so is the helper
                import shutil

                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                os._exit(0)
            continue
        conn.settimeout(None)
        try:
            size = struct.unpack("!I", _recv_exact(conn, 4))[0]
            msg, fds, _, _ = socket.recv_fds(conn, size, 3)
            while len(msg) < size:
                msg += _recv_exact(conn, size - len(msg))
            request = json.loads(msg)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            return fds, request
        for fd in fds:
            os.close(fd)
        threading.Thread(target=_watch, args=(conn, pid), daemon=True).start()


def _become(fds: list[int], request: dict) -> None:
    """The forked child takes the caller's streams, folder, environment and arguments."""
    import io

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    for sig in FORWARDED:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fresh process draws its own seed
        sys.modules["numpy"].random.seed()
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def stream(fd: int, line: bool) -> io.TextIOWrapper:
        raw = open(fd, "wb", buffering=0, closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8",
                                errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=line, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
    sys.stdout = sys.__stdout__ = stream(1, os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, True)
    sys.argv = [request["args"][0], *request["args"][2:]]  # as python sets it for -m MODULE and -c CODE
    sys.path[0] = request["cwd"]


def _watch(conn: socket.socket, pid: int) -> None:
    """Signals from the stand-in go to the child; the child's end goes back. A stand-in that is gone
    takes its child with it."""
    import selectors
    import threading

    done = threading.Event()

    def reap() -> None:
        _, status = os.waitpid(pid, 0)
        try:
            _send(conn, b"X", status)
        except OSError:
            pass
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    while not done.is_set():
        if not sel.select(0.2):
            continue
        try:
            data = _recv_exact(conn, 9)
        except (OSError, EOFError):
            if not done.is_set():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        if data[:1] == b"S":
            try:
                os.kill(pid, struct.unpack("!q", data[1:])[0])
            except ProcessLookupError:
                pass
    done.wait(30)
    conn.close()


# --- the stand-in -------------------------------------------------------------------------------

def _stand_in(address: str, args: list[str]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    msg = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    sock.sendall(struct.pack("!I", len(msg)))
    socket.send_fds(sock, [msg], [0, 1, 2])
    for fd in (0, 1, 2):  # the child holds them now; their ends must close when it does
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd)
        os.close(null)

    def forward(sig, _frame) -> None:
        _send(sock, b"S", sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    data = _recv_exact(sock, 9)
    status = struct.unpack("!q", data[1:])[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# --- the caller's side --------------------------------------------------------------------------

_helper = None


def address() -> str:
    """The socket of this process's helper, started at the first call."""
    global _helper
    if _helper is None:
        import atexit
        import subprocess
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="kvcache-fork-"), "s")
        _helper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path],
                                   stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if _helper.stdout.readline().strip() != "ready":
            raise RuntimeError("the test fork helper did not start")
        atexit.register(_stop_helper, _helper, path)
        _helper.path = path
    return _helper.path


def _stop_helper(helper, path: str) -> None:
    import shutil

    helper.kill()
    helper.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def python_command(*args: str) -> list[str]:
    """The argv that runs ``python -m MODULE ...`` or ``python -c CODE ...`` through the helper (for
    subprocess.Popen/run)."""
    if len(args) < 2 or args[0] not in ("-m", "-c"):
        raise ValueError(f"give -m MODULE or -c CODE, not {args[:2]!r}")
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "--run", address(), *args]


def command(*args: str) -> list[str]:
    """The argv that runs `python -m kvcache *args` through the helper (for subprocess.Popen/run)."""
    return python_command("-m", "kvcache", *args)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        fds, request = _serve(sys.argv[2])
        _become(fds, request)
        how, what = request["args"][:2]
        if how == "-c":  # as `python -c CODE` runs it
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            import runpy

            runpy.run_module(what, run_name="__main__", alter_sys=True)  # as `python -m MODULE` does
    elif sys.argv[1] == "--run":
        _stand_in(sys.argv[2], sys.argv[3:])
