"""Model loading: GGUF dequantization, conversion cache, and every way a model path can be bad."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import gemma_installed
from kvcache.errors import ModelLoadError, UnsupportedArchitecture
from kvcache.models.gguf_convert import convert_gguf, dequantize, open_gguf
from kvcache.models.loading import resolve_model

# type -> max abs error allowed for N(0, 1) data (the format's own precision)
TYPES = {"F32": 0.0, "F16": 2e-3, "BF16": 1.6e-2, "Q8_0": 3e-2, "Q4_0": 0.4, "Q4_1": 0.3}


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (arr, kind) in tensors.items():
        qt = Q[kind]
        if kind == "F32":
            w.add_tensor(name, arr.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", list(TYPES))
def test_dequantize_each_type(tmp_path, kind):
    rng = np.random.default_rng(0)
    arr = rng.standard_normal((8, 64)).astype(np.float32)
    write_gguf(tmp_path / "t.gguf", "llama", {"blk.0.ffn_up.weight": (arr, kind)})
    reader = open_gguf(tmp_path / "t.gguf")
    (t,) = reader.tensors
    assert t.tensor_type.name == kind
    out = dequantize(t)
    assert out.shape == (8, 64) and out.dtype == np.float32
    err = np.abs(out - arr).max()
    assert err <= TYPES[kind] + 1e-7, err
    if kind != "F32":
        assert err > 0  # really quantized, not passed through


def test_unsupported_architecture_in_gguf(tmp_path):
    write_gguf(tmp_path / "m.gguf", "mamba", {"blk.0.x.weight": (np.ones((2, 32), np.float32), "F32")})
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture 'mamba'"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    txt = tmp_path / "notes.gguf"
    txt.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(txt))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="is not a model"):
        resolve_model(str(other))
    empty = tmp_path / "folder"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(empty))
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(str(empty))


def test_truncated_gguf_is_refused(tmp_path):
    from kvcache.models.bundled import default_gguf

    data = default_gguf().read_bytes()
    # inside the header's counts, inside the vocabulary's strings, in the tensors, at the last byte
    for size in (12, 5000, len(data) // 2, len(data) - 1):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match=r"is truncated") as e:
            resolve_model(str(cut))
        assert "reshape" not in str(e.value) and "index" not in str(e.value), e.value  # our words, not numpy's
    assert not list((tmp_path).glob("**/model.safetensors"))


def test_hub_id_offline_is_a_clear_error(tmp_path):
    code = ("from kvcache.models.loading import resolve_model\n"
            "try:\n    resolve_model('someorg/some-model')\nexcept Exception as e:\n    print(type(e).__name__, e)")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert out.startswith("ModelLoadError") and "not available" in out and "someorg/some-model" in out


@pytest.fixture(scope="module")
def pair():
    """(our Gemma 3 270M, transformers' load of the same GGUF)."""
    from transformers import AutoModelForCausalLM

    from conftest import gguf_parsed_fast
    from kvcache import LLM
    from kvcache.models.bundled import gemma_gguf

    path = gemma_gguf()
    with gguf_parsed_fast():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return LLM("gemma3-270m", weights="fp32"), hf


@pytest.mark.gemma
@pytest.mark.skipif(not gemma_installed(), reason="Gemma 3 270M packages not installed (make gemma)")
class TestGemma:

    def test_config_has_hybrid_windows(self, pair):
        llm, _ = pair
        windows = llm.config.layer_windows
        assert len(windows) == 18
        assert [w for i, w in enumerate(windows) if (i + 1) % 6] == [512] * 15
        assert [w for i, w in enumerate(windows) if (i + 1) % 6 == 0] == [None] * 3

    def test_weights_equal_transformers(self, pair):
        """Covers Q4_K, Q6_K, Q5_0 and Q8_0 tensors of the real file."""
        llm, hf = pair
        from kvcache.models.loading import fp32_folder, load_weights

        _, ours = load_weights(fp32_folder("gemma3-270m"))
        ref = hf.state_dict()
        for name, t in ours.items():
            torch.testing.assert_close(t, ref[name].float(), atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")

    def test_prompt_longer_than_window_matches_hf_logits(self, pair):
        llm, hf = pair
        ids = llm.encode("The history of lighthouses. " * 90)
        assert len(ids) > 600
        with torch.no_grad():
            first = hf(torch.tensor([ids]), use_cache=True)
        ref = first.logits[0, -1]
        seq = llm.runner.new_sequence()
        got = llm.runner.step([seq], [ids])[0]
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)
        nxt = int(got.argmax())
        with torch.no_grad():  # transformers' own next step over its cache of the prompt
            ref2 = hf(torch.tensor([[nxt]]), past_key_values=first.past_key_values, use_cache=True).logits[0, -1]
        torch.testing.assert_close(llm.runner.step([seq], [[nxt]])[0], ref2, atol=1e-3, rtol=1e-4)
        stats = llm.kv_stats()  # hybrid: sliding layers gave their out-of-window pages back
        sliding = [s for s in stats.per_layer if s.window == 512]
        full = [s for s in stats.per_layer if s.window is None]
        assert len(sliding) == 15 and len(full) == 3
        assert sliding[0].pages_used <= 512 // 16 + 2 < full[0].pages_used == -(-(len(ids) + 1) // 16)
        llm.runner.free(seq)
        llm.check_integrity()


def test_config_missing_a_value(tmp_path):
    from kvcache.models.config import ModelConfig

    with pytest.raises(ModelLoadError, match="lacks 'num_hidden_layers'"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2})


def test_smollm3s_nope_layers_are_read_or_refused_in_one_line():
    """SmolLM3's layers without RoPE: its no_rope_layers (1 where RoPE is used), else one every
    no_rope_layer_interval layers, as transformers fills it in; a list that does not fit is refused."""
    from kvcache.models.config import ModelConfig

    base = {"model_type": "smollm3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 8,
            "vocab_size": 32, "intermediate_size": 96}
    assert ModelConfig.from_hf(base).rope_layers == (True, True, True, False) * 2
    assert ModelConfig.from_hf({**base, "no_rope_layer_interval": 2}).rope_layers == (True, False) * 4
    given = ModelConfig.from_hf({**base, "no_rope_layers": [0, 1, 1, 1, 1, 1, 1, 1]})
    assert [given.has_rope(i) for i in range(8)] == [False] + [True] * 7
    assert ModelConfig.from_hf({**base, "model_type": "llama"}).rope_layers == ()  # every layer
    for bad in ({"no_rope_layers": [1, 0]}, {"no_rope_layers": [2] * 8}, {"no_rope_layer_interval": 0}):
        with pytest.raises(ModelLoadError, match="no_rope_layer") as e:
            ModelConfig.from_hf({**base, **bad})
        assert "\n" not in str(e.value)


def test_an_attention_soft_cap_is_honoured_for_gemma_and_refused_elsewhere():
    from kvcache.errors import UnsupportedArchitecture
    from kvcache.models.config import ModelConfig

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 32,
            "intermediate_size": 96, "attn_logit_softcapping": 50.0}
    assert ModelConfig.from_hf({**base, "model_type": "gemma2"}).attn_softcap == 50.0
    assert ModelConfig.from_hf({**base, "model_type": "gemma3_text", "attn_logit_softcapping": None}).attn_softcap is None
    with pytest.raises(UnsupportedArchitecture, match="llama with attn_logit_softcapping is not supported"):
        ModelConfig.from_hf({**base, "model_type": "llama"})
    with pytest.raises(ModelLoadError, match="a soft cap must be positive"):
        ModelConfig.from_hf({**base, "model_type": "gemma2", "attn_logit_softcapping": -1.0})


def test_converted_tokenizer_loads_in_transformers_as_ours():
    """transformers' AutoTokenizer reads the converted folder (what kvpress's KVzip loads) and
    encodes as kvcache's own tokenizer does; the architecture's class would want an <unk>."""
    from transformers import AutoTokenizer

    from kvcache.models.tokenizer import Tokenizer

    folder = resolve_model(None).path
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    theirs, ours = AutoTokenizer.from_pretrained(str(folder)), Tokenizer.from_dir(folder)
    for text in ("\n\nRepeat the previous context exactly.", "The pass key is 60494. Remember it."):
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)


def test_a_tokenizer_file_is_parsed_once_until_it_changes(tmp_path):
    """Loads of one tokenizer.json share its parse; a file rewritten (another size or time) or
    damaged is read again, and the damage is one clear error."""
    import os

    from conftest import write_tiny_tokenizer
    from kvcache.models.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    a, b = Tokenizer.from_dir(tmp_path), Tokenizer.from_dir(tmp_path)
    assert a.backend is b.backend and a is not b
    tj = tmp_path / "tokenizer.json"
    data = json.loads(tj.read_text())
    data["model"]["vocab"]["t3"], data["model"]["vocab"]["t4"] = 4, 3  # two ids swapped: the same size
    tj.write_text(json.dumps(data))
    st = tj.stat()
    os.utime(tj, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a later modification time, as an edit gives
    c = Tokenizer.from_dir(tmp_path)
    assert c.backend is not a.backend and c.encode("t3") == [4] and a.encode("t3") == [3]
    tj.write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json cannot be read"):
        Tokenizer.from_dir(tmp_path)
