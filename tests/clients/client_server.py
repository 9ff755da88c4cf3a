"""`kvcache serve` on the bundled model for the client suite: test_server.Server whose output is
read as it comes (kept for failure reports; a full pipe would stall the server)."""

from __future__ import annotations

import collections
import threading

from test_server import Server


class LoggedServer(Server):
    def __init__(self, *flags: str, model: str | None = None) -> None:
        from kvcache.models.bundled import default_gguf

        self.model_path = model or str(default_gguf())
        super().__init__(self.model_path, *flags)
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        threading.Thread(target=self._drain, daemon=True).start()
        self.model = self.client().models.list().data[0].id
        self.url = self.base + "/v1"

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())


def need(module: str):
    """A client library of the suite, imported when a test first asks for it (collection stays light
    for `make test`, which deselects the suite); skipped where the extra is not installed."""
    import pytest

    return pytest.importorskip(module, reason="the client suite needs kvcache[clients] (make setup-test)")
