"""The client conformance suite's fixtures: one real `kvcache serve` on the bundled model for the
whole session, a recording transport per test (client_wire.Wire), and a guard that fails a test
whose client tried to reach anything but 127.0.0.1.

Every client is pointed at the local server with a dummy key; tracing and telemetry are switched
off before any client library is imported. Rates that only model quality decides are printed and,
when KVCACHE_CLIENTS_REPORT names a file, appended to it as JSON lines (docs/clients.md's table)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time

import pytest

# before the client libraries are imported: no tracing, no telemetry, no key or base URL from outside
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # litellm would fetch its price list at import
os.environ["LITELLM_TELEMETRY"] = "False"
for _name in ("LANGSMITH_API_KEY", "LANGCHAIN_API_KEY", "LANGSMITH_ENDPOINT", "OPENAI_BASE_URL",
              "OPENAI_API_BASE", "LOGFIRE_TOKEN"):
    os.environ.pop(_name, None)

# tests/clients is a package (its __init__.py), so this file is clients.conftest and never hides the
# suite's own tests/conftest.py; its helper modules are imported by their plain names from here
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from client_wire import KEY, Wire  # noqa: E402
from client_server import LoggedServer  # noqa: E402


def _loopback(host) -> bool:
    if host in (None, "localhost", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail the test if anything in it looked up or connected to an address off this machine."""
    tried: list[str] = []
    real_getaddrinfo = socket.getaddrinfo
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host, *a, **kw):
        if not _loopback(host):
            tried.append(f"lookup of {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"the client suite reaches 127.0.0.1 only ({host})")
        return real_getaddrinfo(host, *a, **kw)

    def guard(address) -> None:
        if isinstance(address, tuple) and not _loopback(address[0]):
            tried.append(f"connection to {address!r}")
            raise OSError(101, f"the client suite reaches 127.0.0.1 only ({address!r})")

    def connect(self, address):
        guard(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        guard(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield tried
    assert not tried, f"a client tried to reach the network: {tried}"


@pytest.fixture(scope="session")
def _servers():
    """The suite's servers, each started when a test first needs it and kept to the session's end:
    a worker runs the suite module by module, each module over both models, and a parametrized
    session fixture would be torn down and started again at every switch of model."""
    started: dict[str, LoggedServer] = {}
    yield started
    for s in started.values():
        s.close()


@pytest.fixture(scope="module", params=["smollm2", "qwen-tokens"])
def server(request, _servers):
    """`kvcache serve` with its defaults, on the bundled SmolLM2-135M-Instruct and on a tiny random
    model that carries Qwen2.5's real tokenizer and chat template (tests/qwen_tiny.py): its tool tags
    are single special tokens and its template renders the tools itself, where SmolLM2 writes tags as
    text in kvcache's default format. What the tiny model says is noise: on it a test checks what the
    server owes (calls, shapes, streams), never an answer's sense."""
    if request.param not in _servers:
        if request.param == "smollm2":
            s = LoggedServer()
        else:
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from qwen_tiny import tiny_qwen

            s = LoggedServer(model=str(tiny_qwen()))
        s.name = request.param
        _servers[request.param] = s
    return _servers[request.param]


@pytest.fixture
def wire(server, request):
    """The recording transport of one test; a failure report shows its exchanges and the server log."""
    w = Wire()
    request.node.exchanges = w
    request.node.server_log = server.log
    start = time.monotonic()
    yield w
    ignored = sorted({e.ignored for e in w.exchanges if e.ignored})
    print(f"{len(w.chats())} chat requests in {time.monotonic() - start:.1f}s"
          + (f"; fields the server ignored: {', '.join(ignored)}" if ignored else ""))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and report.failed and hasattr(item, "exchanges"):
        report.sections.append(("exchanges (what the client sent, what came back)", item.exchanges.summary()))
        report.sections.append(("server log (last lines)", "\n".join(list(item.server_log)[-30:])))
    return report


@pytest.fixture
def openai_client(server, wire):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120, http_client=wire.http_client())


@pytest.fixture
def async_openai_client(server, wire):
    import openai

    return openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120,
                              http_client=wire.async_http_client())


@pytest.fixture
def record_rate(request):
    """record_rate(ok, total, note): a success rate that model quality decides, printed and kept."""

    def record(ok: int, total: int, note: str) -> None:
        row = {"test": request.node.nodeid, "ok": ok, "total": total, "note": note}
        print(f"RATE {row['test']}: {ok}/{total} ({note})")
        path = os.environ.get("KVCACHE_CLIENTS_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return record
