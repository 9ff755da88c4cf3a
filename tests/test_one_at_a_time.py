"""Processes that start together make a kernel library or a converted model once: the later one
waits for the first one's lock and finds its result (kvcache.paths.one_at_a_time)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import forkserve

from kvcache.paths import one_at_a_time

# the child counts how often it made the thing itself, then prints where it found it
CHILD = """
import sys
from kvcache.kernels import build
from kvcache.models import loading
made = []
for mod, name in ((build, "_compile"), (loading, "_convert"), (loading, "_convert_fp32")):
    real = getattr(mod, name)
    setattr(mod, name, lambda *a, real=real, **k: made.append(1) or real(*a, **k))
print("ready", flush=True)
if sys.argv[1] == "kernel":
    where = build.build("pgemm", build.GENERIC)
elif sys.argv[1] == "fp32":
    resolved = loading.resolve_model(None)
    loading.ensure_fp32(resolved, show_progress=False)
    where = resolved.path / "model.safetensors"
else:
    from kvcache.models.bundled import default_gguf
    where = loading.ensure_converted(default_gguf(), show_progress=False)
print(len(made), where)
"""


def _start(what: str, home: Path) -> subprocess.Popen:
    return subprocess.Popen(forkserve.python_command("-c", CHILD, what), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "KVCACHE_HOME": str(home)})


def _waits_then_takes_ours(child: subprocess.Popen, lock: Path, make) -> str:
    with one_at_a_time(lock):
        assert child.stdout.readline() == "ready\n"  # about to ask for the thing
        time.sleep(1.0)  # time enough to make its own, were it not waiting
        made = make()
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-2000:]
    count, where = out.split()
    assert count == "0" and where == str(made)  # found what this process made
    return where


def test_a_kernel_another_process_is_compiling_is_compiled_once(tmp_path, monkeypatch):
    from kvcache.kernels import build

    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    cc = build.compiler()
    out = build.library_path("pgemm", build.GENERIC, cc)
    child = _start("kernel", tmp_path)
    _waits_then_takes_ours(child, out.with_name(f".{out.name}.lock"),
                           lambda: build._compile("pgemm", build.GENERIC, cc, out))


def test_a_model_another_process_is_converting_is_converted_once(tmp_path, monkeypatch):
    from kvcache.models import loading
    from kvcache.models.bundled import default_gguf

    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    target = loading._converted_dir(default_gguf())
    target.parent.mkdir(parents=True)
    child = _start("model", tmp_path)

    def convert() -> Path:
        loading._convert(default_gguf(), target, show_progress=False)
        return target

    _waits_then_takes_ours(child, target.parent / f".{target.name}.lock", convert)
    assert (target / "kvcache.json").is_file() and not list(target.parent.glob(".converting-*"))


def test_fp32_weights_another_process_is_writing_are_written_once(tmp_path, monkeypatch):
    from kvcache.models import loading

    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    resolved = loading.resolve_model(None)  # converted (config, tokenizer) by this process first
    child = _start("fp32", tmp_path)

    def write() -> Path:
        loading._convert_fp32(resolved, show_progress=False)
        return resolved.path / "model.safetensors"

    _waits_then_takes_ours(child, resolved.path.parent / f".{resolved.path.name}.fp32.lock", write)
