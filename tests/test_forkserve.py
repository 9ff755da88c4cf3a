"""The tests' way of starting `python -m kvcache` and `python -c` (tests/forkserve.py) behaves as a
fresh interpreter: the same output and exit status, the caller's environment, signals reaching the
command, and no command outliving a stand-in that was killed."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request

import forkserve

from conftest import fresh_home, run_kvcache
from kvcache.peers.process import free_port


def test_output_and_exit_status_are_a_fresh_interpreters():
    for args in (("--version",), ("generate", "--model", "no-such-model", "hi"), ("no-such-command",),
                 ("serve", "--port", "not-a-port")):
        forked, fresh = run_kvcache(*args), run_kvcache(*args, fresh=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args


def test_the_callers_environment_and_folder_are_the_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCACHE_HOME", str(fresh_home(tmp_path / "home")))  # its kernels the suite's: no compile
    got = subprocess.run(forkserve.command("env", "--no-digest"), capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert str(tmp_path / "home") in got.stdout, got.stdout
    (tmp_path / "bad.gguf").write_bytes(b"junk\n")  # a relative path is read from the caller's folder
    got = subprocess.run(forkserve.command("generate", "--model", "bad.gguf", "hi"), capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 2 and "bad.gguf is not a GGUF file" in got.stderr, got.stderr


def test_code_runs_as_python_c_runs_it_with_the_variant_the_environment_names():
    """``python -c CODE ARGS``: the same output, argv and exit status as a new interpreter's, and
    the kernels loaded afresh in the child, so that KVCACHE_KERNEL_VARIANT picks the variant."""
    import os
    import sys

    code = ("import sys\nfrom kvcache import kernels\nprint(sys.argv, kernels.variant())\n"
            "sys.exit(int(sys.argv[1]))\n")
    env = dict(os.environ, KVCACHE_KERNEL_VARIANT="generic")
    for status in ("0", "3"):
        forked = subprocess.run(forkserve.python_command("-c", code, status, "x y"), capture_output=True, text=True,
                                timeout=120, env=env)
        fresh = subprocess.run([sys.executable, "-c", code, status, "x y"], capture_output=True, text=True,
                               timeout=120, env=env)
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == (
            int(status), f"['-c', '{status}', 'x y'] generic\n"), (forked, fresh)
    failed = subprocess.run(forkserve.python_command("-c", "raise SystemExit('no such thing')"), capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode == 1 and failed.stderr.strip() == "no such thing"


def _serving(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _started(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(forkserve.command("serve", "--port", str(port)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _serving(port):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    return proc


def test_sigterm_reaches_the_server_and_its_status_comes_back():
    port = free_port()
    proc = _started(port)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert not _serving(port)


def test_a_killed_stand_in_takes_its_command_with_it():
    port = free_port()
    proc = _started(port)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _serving(port):
        assert time.monotonic() < deadline, "the forked server outlived its stand-in"
        time.sleep(0.1)

