"""API keys that cannot fail open: empty keys refused at start, keys from files and the environment,
/metrics behind a key, priority for admins only, cache statistics per tenant."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest

from kvcache.errors import InvalidParams
from kvcache.server.auth import Auth, gather_keys

from conftest import run_kvcache
from test_server import Server


@pytest.mark.parametrize("keys", [["k1", ""], ["k 1"]])
def test_an_empty_key_is_refused_at_start(tiny_dir, keys):
    """`kvcache serve` with a bad --api-key (empty after a good one, or with a space): one line,
    exit 2; the keys serve gathers, each bad way (gather_keys, below and in the next test)."""
    args = [a for k in keys for a in ("--api-key", k)]
    p = run_kvcache("serve", "--model", str(tiny_dir("llama")[0]), "--port", "1", *args, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "key" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("keys,needle", [([""], "empty"), (["k1", ""], "empty"), (["  "], "empty"),
                                         (["k 1"], "whitespace"), ([" k1"], "whitespace")])
def test_bad_command_line_keys_are_refused(keys, needle):
    with pytest.raises(InvalidParams, match=needle):
        gather_keys(keys, [], "KVCACHE_TEST_NO_SUCH_KEY")


def test_an_empty_key_from_the_environment_or_a_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_API_KEY", "")
    with pytest.raises(InvalidParams, match="empty"):
        gather_keys(["k1"], [], "KVCACHE_API_KEY")
    monkeypatch.delenv("KVCACHE_API_KEY")
    f = tmp_path / "keys"
    f.write_text("# no keys here\n\n")
    with pytest.raises(InvalidParams, match="holds no key"):
        gather_keys([], [str(f)], "KVCACHE_API_KEY")
    with pytest.raises(InvalidParams, match="cannot read key file"):
        gather_keys([], [str(tmp_path / "missing")], "KVCACHE_API_KEY")
    with pytest.raises(InvalidParams, match="empty"):
        Auth(["k1"], [""])


def test_auth_matches_whole_keys_only():
    auth = Auth(["alpha", "beta"], ["root"])
    assert auth.caller("Bearer alpha").admin is False and auth.caller("bearer root").admin is True
    assert auth.caller("Bearer alpha").salt != auth.caller("Bearer beta").salt
    for bad in (None, "", "Bearer", "Bearer ", "Bearer alph", "Bearer alphaa", "Basic alpha", "alpha"):
        assert auth.caller(bad) is None, bad
    assert Auth().caller(None).admin  # an open server trusts everyone alike


@pytest.fixture(scope="module")
def keyed(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    users, admins = d / "users", d / "admins"
    users.write_text("# tenants\ntenant-a-7Qx\n")
    admins.write_text("root-3Zt\n")
    for f in (users, admins):
        f.chmod(0o600)
    s = Server(str(tiny_dir("llama")[0]), "--kv", "dynamic,page_size=4", "--api-key-file", str(users),
               "--admin-key-file", str(admins), "--policy", "priority",
               env={"KVCACHE_API_KEY": "tenant-b-9Kp"}, admin="root-3Zt")
    yield s
    s.close()


def test_keys_from_a_file_and_the_environment_do_not_show_in_ps(keyed):
    model = keyed.client("tenant-a-7Qx").models.list().data[0].id
    assert keyed.client("tenant-b-9Kp").models.list().data[0].id == model
    with pytest.raises(openai.AuthenticationError):
        keyed.client("other").models.list()
    cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes()
    assert b"tenant-a-7Qx" not in cmdline and b"tenant-b-9Kp" not in cmdline and b"root-3Zt" not in cmdline


def test_the_api_description_and_its_pages_need_a_key(keyed, tiny_dir):
    open_server = Server(str(tiny_dir("llama")[0]))
    try:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert keyed.get(path)[0] == 401, path
            code, body = keyed.get(path, "tenant-a-7Qx")
            assert code == 200 and ("openapi" in body or "/openapi.json" in body), path
            assert open_server.get(path)[0] == 200, path  # an open server shows them to everyone
    finally:
        open_server.close()
    spec = json.loads(keyed.get("/openapi.json", "tenant-a-7Qx")[1])
    assert "/v1/chat/completions" in spec["paths"] and "/docs" not in spec["paths"]


def test_metrics_need_a_key(keyed, tiny_dir):
    assert keyed.get("/metrics")[0] == 401
    assert keyed.get("/metrics", "tenant-a-7Qx")[0] == 200
    public = Server(str(tiny_dir("llama")[0]), "--api-key", "k1", "--metrics-public")
    try:
        code, text = public.get("/metrics")
        assert code == 200 and "kvcache_requests_total" in text
        assert public.get("/v1/models")[0] == 401  # only the metrics are public
    finally:
        public.close()


def test_priority_is_for_admin_keys(keyed):
    body = json.dumps({"model": _model_of(keyed), "prompt": "t5 t6", "max_tokens": 2, "priority": 5}).encode()
    code, err = keyed.post("/v1/completions", body, key="tenant-a-7Qx")
    assert code == 403 and err["error"]["param"] == "priority" and err["error"]["type"] == "permission_error"
    code, ok = keyed.post("/v1/completions", body, key="root-3Zt")
    assert code == 200 and ok["choices"][0]["text"] is not None
    huge = json.dumps({"model": _model_of(keyed), "prompt": "t5", "priority": 10**30}).encode()
    assert keyed.post("/v1/completions", huge, key="root-3Zt")[0] == 400


def _model_of(server: Server) -> str:
    return server.client("tenant-a-7Qx").models.list().data[0].id


def test_cache_stats_show_a_tenant_only_its_own_share(keyed):
    model = _model_of(keyed)
    prompt = " ".join(f"t{i}" for i in range(40, 72))
    keyed.client("tenant-b-9Kp").completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    mine = json.loads(keyed.get("/v1/cache/stats", "tenant-b-9Kp")[1])
    theirs = json.loads(keyed.get("/v1/cache/stats", "tenant-a-7Qx")[1])
    assert set(mine) == {"tenant"} and mine["tenant"]["cached_tokens"] >= 32
    assert theirs["tenant"]["cached_tokens"] < mine["tenant"]["cached_tokens"]
    assert keyed.get("/v1/cache/stats?check=true", "tenant-a-7Qx")[0] == 403
    full = keyed.stats()  # the admin's view, integrity checked on request
    assert full["integrity"] == "ok" and full["kv"]["pages_total"] > 0
    plain = json.loads(keyed.get("/v1/cache/stats", "root-3Zt")[1])
    assert plain["integrity"].startswith("not checked")


def test_key_file_readable_by_others_gets_a_warning(tmp_path, capsys):
    f = tmp_path / "keys"
    f.write_text("k1\n")
    os.chmod(f, 0o644)
    assert gather_keys([], [str(f)], "KVCACHE_NO_SUCH_VARIABLE") == ["k1"]
    assert "readable by other users" in capsys.readouterr().err

