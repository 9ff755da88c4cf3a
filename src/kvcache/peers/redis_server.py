"""A throwaway local redis-server (Debian's ``redis-server`` binary): the Redis tier of ``bench prefix``
runs against it when no --redis URL is given, and the test suite's ``redis_url`` fixture starts one too."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvcache.peers.process import free_port, stop_process


@contextmanager
def local_redis(timeout: float = 10.0) -> Iterator[str | None]:
    """Start redis-server on 127.0.0.1 on a free port, without persistence, and yield its URL;
    yields None when no redis-server is installed. Stopped on exit."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvcache-redis-") as d:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_process(proc, 5)
