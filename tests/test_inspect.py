"""kvcache inspect: shapes against the model config, attention weights, the prefix-reuse check."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_kvcache

from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner
from kvcache.errors import InvalidParams
from kvcache.inspect.capture import attention_weights, capture, check_indices, gqa_groups, prefix_reuse

A = "The lighthouse keeper climbed the stairs at dusk and looked at the sea."
B = "The lighthouse keeper climbed the stairs at dusk and looked at the sky."


def test_capture_shapes_and_weights(smollm):
    ids = smollm.encode(A)
    seen = capture(smollm.model, ids, [0, 29])
    cfg = smollm.config
    assert set(seen) == {0, 29}
    assert seen[29].q.shape == (len(ids), cfg.num_heads, cfg.head_dim) == (len(ids), 9, 64)
    assert seen[29].k.shape == seen[29].v.shape == (len(ids), 3, 64)
    w = attention_weights(smollm.model, seen[29], 29, 4)
    assert torch.allclose(w.sum(-1), torch.ones(len(ids)))
    assert float(w.triu(1).abs().max()) == 0.0  # causal: nothing from the future
    assert gqa_groups(smollm.model) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(InvalidParams, match="layer 30 does not exist"):
        check_indices(smollm.model, [30], [0])
    with pytest.raises(InvalidParams, match="head 9 is out of range"):
        check_indices(smollm.model, [0], [9])


def test_prefix_reuse_check_can_tell(smollm):
    a, b = smollm.encode(A), smollm.encode(B)
    exact = prefix_reuse(ModelRunner(smollm.model, parse_kv_spec("dynamic")), a, b)
    assert exact.prefix == 12 and exact.total == len(b) and exact.max_diff < 1e-4
    assert exact.kv_saved == pytest.approx(12 / len(b))
    lossy = prefix_reuse(ModelRunner(smollm.model, parse_kv_spec("int8,residual=0,page_size=8,group_size=8")), a, b)
    assert lossy.max_diff > 1e-3  # the check sees a lossy reuse
    with pytest.raises(InvalidParams, match="share no prefix"):
        prefix_reuse(ModelRunner(smollm.model, parse_kv_spec("dynamic")), [1, 2], [3, 4])


def test_inspect_command(tmp_path):
    out, tensors = tmp_path / "r.json", tmp_path / "t.safetensors"
    png = tmp_path / "png"
    r = run_kvcache("inspect", A, "--layers", "0,-1", "--heads", "0,4", "--reuse", B, "--save", str(tensors),
                    "--json", str(out), "--png", str(png), "--weights", "fp32", timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert len(report["layers"]) == 30 and report["layers"][0]["shape"] == [1, 3, report["tokens"], 64]
    assert report["reuse"]["max_diff"] < 1e-4
    assert sorted(p.name for p in png.iterdir()) == sorted(
        [f"attention-layer{x}-head{h}.png" for x in (0, 29) for h in (0, 4)]
        + [f"{m}-layer{x}.png" for m in "kv" for x in (0, 29)])
    from safetensors.torch import load_file

    saved = load_file(str(tensors))
    assert saved["layer29.head4.attention"].shape == (report["tokens"], report["tokens"])
    bad = run_kvcache("inspect", "hi", "--layers", "30", timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == "kvcache: layer 30 does not exist: the model has layers 0..29"
    bad = run_kvcache("inspect", "hi", "--heads", "x", timeout=300)
    assert bad.returncode == 2 and "--heads takes comma-separated integers" in bad.stderr
