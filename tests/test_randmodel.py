"""kvcache.bench.randmodel: a tiny random-weight GGUF with the real SmolLM2 tokenizer loads in kvcache."""

from __future__ import annotations

import pytest

from kvcache.bench.randmodel import main
from kvcache.models.random_llama import SHAPES, ShapeError, parse_shape, write_f16

TINY = "hidden=64,layers=2,heads=4,kv_heads=2,ffn=128"


def test_parse_shape() -> None:
    assert parse_shape("1b") == ("1b", SHAPES["1b"])
    name, s = parse_shape(TINY)
    assert name == "h64-l2-a4-kv2-ff128"
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.ffn, s.dim, s.tied) == (64, 2, 4, 2, 128, 16, True)
    assert parse_shape("1b,layers=2")[1].layers == 2
    for bad in ("bogus", "hidden=64,layers=2", "hidden=64,layers=2,heads=3,kv_heads=2,ffn=128", "1b,color=3"):
        with pytest.raises(ShapeError):
            parse_shape(bad)


def test_main_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))  # no cached file may answer
    assert main(["--shape", "bogus"]) == 2
    assert main(["--shape", "1b", "--ftype", "Q4_0", "--llama-cpp-bin", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_tiny_random_gguf_loads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcache

    from conftest import fresh_home

    monkeypatch.setenv("KVCACHE_HOME", str(fresh_home(tmp_path / "home")))  # the converted folder goes there
    _, shape = parse_shape(TINY)
    path = write_f16(shape, tmp_path / "tiny.gguf", seed=0, progress=False)
    llm = kvcache.LLM(str(path), prefix=False)
    c = llm.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.head_dim) == (
        64, 2, 4, 2, 128, 16)
    assert c.vocab_size == 49152 and c.tie_embeddings
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.encode(text)
    assert 5 < len(ids) < 20
    assert llm.tokenizer.decode(ids) == text
    out = llm.generate(text, kvcache.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
