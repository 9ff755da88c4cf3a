"""A model file is checked against itself before anything is sized by it, and a failed load leaves
nothing behind: a tensor whose shape disagrees with the file's hyper-parameters refuses the file in
one line naming it (no traceback, no converted folder), and the ``.converting-*`` folders a killed
process left are removed by the next conversion, while a live one's is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import run_kvcache  # noqa: E402


def _copy_with(src: Path, out: Path, change) -> Path:
    """``src`` rewritten with ``change(name, array)`` applied to each tensor."""
    import gguf

    from kvcache.models.gguf_reader import gguf_reader
    from kvcache.models.random_weights import copy_fields

    r = gguf_reader(src)
    w = gguf.GGUFWriter(str(out), str(r.fields["general.architecture"].contents()))
    copy_fields(w, {k: f for k, f in r.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"})
    for t in r.tensors:
        a = np.array(t.data)
        a = a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a
        w.add_tensor(t.name, change(t.name, a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny() -> Path:
    from qwen_tiny import tiny_qwen

    return tiny_qwen()  # in the user cache, before a test points KVCACHE_HOME elsewhere


@pytest.fixture
def home(tmp_path, monkeypatch):
    from conftest import fresh_home

    monkeypatch.setenv("KVCACHE_HOME", str(fresh_home(tmp_path / "home")))
    return tmp_path / "home"


def test_a_tensor_that_disagrees_with_the_hyper_parameters_refuses_the_file(tiny, tmp_path, home):
    bad = _copy_with(tiny, tmp_path / "bad.gguf",
                     lambda name, a: a[:50] if name == "blk.1.ffn_norm.weight" else a)
    p = run_kvcache("generate", "--model", str(bad), "-n", "2", "hi", timeout=300,
                    env={**os.environ, "KVCACHE_HOME": str(home)})
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert "post_attention_layernorm" in line and "[50]" in line and "needs [64]" in line, line
    left = [x.name for x in (home / "models").iterdir()] if (home / "models").exists() else []
    assert left == [], left  # no converted folder, no .converting-* folder


def test_stale_conversion_folders_are_swept(home):
    from kvcache.models.loading import _converting
    from kvcache.paths import OWNER, STALE_S

    models = home / "models"
    models.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, alive, fresh, old = (models / f".converting-{n}" for n in ("gone", "alive", "fresh", "old"))
    for d in (gone, alive, fresh, old):
        d.mkdir()
    (gone / OWNER).write_text(str(dead.pid))
    (alive / OWNER).write_text(str(os.getpid()))
    os.utime(old, (time.time() - STALE_S - 10, time.time() - STALE_S - 10))
    tmp = _converting(models)
    assert not gone.exists() and not old.exists()  # a killed owner's, and an unmarked one long untouched
    assert alive.exists() and fresh.exists()  # a live owner's, and one being made right now
    assert (tmp / OWNER).read_text() == str(os.getpid())


@pytest.mark.parametrize("key, value, words", [
    ("attention.head_count", 0, "must be a positive integer"),
    ("attention.head_count_kv", 3, "does not divide head_count 4"),
    ("attention.layer_norm_rms_epsilon", -1.0, "must be a positive finite number"),
    ("rope.freq_base", float("nan"), "must be a positive finite number"),
    ("block_count", 0, "must be a positive integer"),
])
def test_hyper_parameters_that_would_divide_by_zero_or_compute_noise_are_refused(key, value, words):
    from kvcache.models.gguf_check import check

    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": 4, "qwen2.attention.head_count_kv": 2,
            "qwen2.block_count": 1, f"qwen2.{key}": value}
    lines = [line for line in check(meta, [], None).lines("f.gguf") if words in line]
    assert lines and f"qwen2.{key}" in lines[0], check(meta, [], None).lines("f.gguf")


def test_shapes_are_checked_before_any_tensor_is_read(tiny, tmp_path):
    """A Q bias of 30 values where 64 are needed was numpy's "cannot reshape array" at conversion."""
    from kvcache.errors import ModelLoadError
    from kvcache.models.gguf_convert import convert_gguf

    bad = _copy_with(tiny, tmp_path / "bad.gguf", lambda name, a: a[:30] if name == "blk.0.attn_q.bias" else a)
    with pytest.raises(ModelLoadError, match=r"self_attn\.q_proj\.bias has shape \[30\] .* needs \[64\]"):
        convert_gguf(bad, tmp_path / "out", show_progress=False, weights=True)
    assert not (tmp_path / "out").exists()


def test_every_weight_shape_is_checked_against_the_configuration():
    from kvcache.errors import ModelLoadError
    from kvcache.models.config import ModelConfig
    from kvcache.models.shapes import check_shapes

    cfg = ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 256})
    good = {"model.embed_tokens.weight": (100, 64), "model.norm.weight": (64,),
            "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.self_attn.q_proj.weight": (64, 64),
            "model.layers.0.self_attn.q_proj.bias": (64,), "model.layers.0.self_attn.k_proj.weight": (32, 64),
            "model.layers.0.self_attn.v_proj.bias": (32,), "model.layers.0.self_attn.o_proj.weight": (64, 64),
            "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.down_proj.weight": (64, 128),
            "lm_head.weight": (100, 64), "model.layers.0.something_new.weight": (7,)}
    check_shapes(cfg, good)
    for name, shape in good.items():
        if "something_new" in name:
            continue
        wrong = {**good, name: tuple(x + 1 for x in shape)}
        with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
            check_shapes(cfg, wrong)
