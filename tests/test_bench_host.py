"""The host a figure was taken on: ``kvcache env``, ``kvcache --version`` and the bench reports name
the CPU, its SIMD features and the kernel variant in use."""

from __future__ import annotations

import json
import os

from conftest import run_kvcache

from kvcache import kernels
from kvcache.envinfo import FEATURES, cpu
from kvcache.kernels.build import cpu_info


def test_env_names_the_cpu_its_features_and_the_kernel_variant():
    p = run_kvcache("env", "--no-digest", timeout=300)  # the host's lines (the digest: test_variants.py)
    assert p.returncode == 0, p.stderr
    lines = {ln.split("  ", 1)[0].strip(): ln.split("  ", 1)[1].strip() for ln in p.stdout.splitlines()}
    assert lines["kernel variant"].split()[0] == kernels.variant()
    assert lines["cpu"] == cpu_info()[0]
    flags = cpu_info()[1]
    for f in FEATURES:  # each feature is listed, marked (no) where the CPU lacks it
        assert (f"{f} (no)" in lines["cpu features"]) == (f not in flags)
    assert lines["torch"].startswith(__import__("torch").__version__)


def test_version_prints_the_same_host_line():
    p = run_kvcache("--version", timeout=300)
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    name, feats = cpu()
    assert line.startswith("kvcache ") and " · Python " in line and " · torch " in line
    assert line.endswith(f"{name} · {' '.join(feats)} · kernels {kernels.variant()}")


def test_the_variant_follows_what_this_process_loads():
    env = dict(os.environ, KVCACHE_KERNEL_VARIANT="generic")
    p = run_kvcache("--version", env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("kernels generic")
    env = dict(os.environ, KVCACHE_NO_KERNELS="1")
    p = run_kvcache("env", "--no-digest", env=env, timeout=300)
    assert p.returncode == 0 and "off (KVCACHE_NO_KERNELS=1)" in p.stdout, p.stderr[-2000:]


def test_bench_reports_name_the_host(tmp_path):
    p = run_kvcache("bench", "growth", "--max-context", "512", "--out", str(tmp_path), timeout=300)
    assert p.returncode == 0, p.stderr
    report = (tmp_path / "growth.md").read_text()
    name, feats = cpu()
    assert f"| cpu | {name} |" in report and f"| kernel variant | {kernels.variant()} |" in report
    assert "| cpu features | " + " ".join(feats) in report
    meta = json.loads((tmp_path / "growth.json").read_text())["meta"]
    assert meta["kernel_variant"] == kernels.variant() and meta["cpu_features"] == feats
