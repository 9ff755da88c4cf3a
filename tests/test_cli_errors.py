"""Bad input: one clear line naming the problem, exit status 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_kvcache
from kvcache import SamplingParams
from kvcache.errors import InvalidParams


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The console command as a user runs it (forked from the tests' helper: tests/forkserve.py)."""
    return run_kvcache(*args, stdin=stdin, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr
    assert needle in lines[-1], proc.stderr
    assert lines[-1].startswith("kvcache: ") or lines[-1].startswith("usage") or "error:" in lines[-1]


def test_missing_model_path(tmp_path):
    assert_one_line_error(run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf")), "nope.gguf")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_model_that_names_nothing_is_refused_before_torch_loads(tmp_path, command):
    """A mistyped --model costs no torch import (seconds): the refusal comes first, in one line."""
    code = ("import sys\nfrom kvcache.cli import main\n"
            f"rc = main([{command!r}, '--model', {str(tmp_path / 'nope')!r}])\n"
            "print(rc, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["2", "False"], (p.stdout, p.stderr)
    assert p.stderr.strip() == f"kvcache: model not found: {tmp_path / 'nope'} (no such file or folder)"


def test_file_that_is_not_a_model(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n" * 100)
    assert_one_line_error(run_cli("generate", "hi", "--model", str(bad)), "notes.gguf")


def test_truncated_gguf(tmp_path):
    from kvcache.models.bundled import default_gguf

    src = Path(default_gguf()).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[: len(src) // 2])
    proc = run_cli("generate", "hi", "--model", str(cut))
    assert_one_line_error(proc, "cut.gguf is truncated")
    assert "reshape" not in proc.stderr


def test_unsupported_architecture(tmp_path):
    import json

    d = tmp_path / "weird"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 10}))
    (d / "model.safetensors").write_bytes(b"")
    assert_one_line_error(run_cli("generate", "hi", "--model", str(d)), "mamba")


def test_bad_kv_spec_and_sampling_values():
    """Through the command: a --kv spec, a sampling value (the options become SamplingParams, whose
    every refusal is checked below) and a bench suite."""
    assert_one_line_error(run_cli("generate", "hi", "--kv", "turbo"), "turbo")
    assert_one_line_error(run_cli("generate", "hi", "--temperature", "-1"), "temperature")
    assert_one_line_error(run_cli("bench", "nosuchsuite"), "nosuchsuite")


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"), ({"n": 0}, "n must be"),
    ({"stop": [""]}, "stop"), ({"seed": "x"}, "seed"),
])
def test_sampling_params_validation(kwargs, needle):
    with pytest.raises(InvalidParams, match=needle):
        SamplingParams(**kwargs)


def test_prompt_longer_than_static_capacity():
    long_prompt = "word " * 300
    proc = run_cli("generate", long_prompt, "--kv", "static,max_tokens=64")
    assert_one_line_error(proc, "64")


def test_prompt_longer_than_context(smollm):
    from kvcache.errors import ContextOverflow

    with pytest.raises(ContextOverflow, match="does not fit the context"):
        smollm.generate([list(range(100, 100 + 8200))], SamplingParams(max_tokens=1))
    smollm.check_integrity()
    assert smollm.kv_stats().pages_in_use == 0


def test_serve_refuses_bad_settings_before_loading():
    assert_one_line_error(run_cli("serve", "--port", "70000"), "--port must be between 1 and 65535")
    assert_one_line_error(run_cli("serve", "--max-batch-tokens", "0"), "max_batch_tokens")
    assert_one_line_error(run_cli("serve", "--document-step-work", "-1"), "--document-step-work must be 0 (never capped) or more")
    assert_one_line_error(run_cli("serve", "--kv", "static,bogus=1"), "unknown --kv option")


def test_chat_resume_of_a_missing_file(tmp_path):
    assert_one_line_error(run_cli("chat", "--resume", str(tmp_path / "gone.kv"), stdin=""), "does not exist")
