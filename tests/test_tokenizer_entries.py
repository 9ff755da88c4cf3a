"""GGUF files that share a tokenizer share its conversion (models/gguf_tokenizer.py): the second file
takes the entry its tokenizer keys name instead of converting, gets the same tokenizer.json and its
own chat template; an entry that does not check out is converted again and replaced."""

from __future__ import annotations

import json
import os
import subprocess

import forkserve

from conftest import fresh_home
from convert_matrix import rewrite_gguf

CONVERT = """
import sys
from pathlib import Path
from kvcache.models.gguf_convert import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), show_progress=False, weights=False)
print("converted" if "transformers.integrations.gguf.gguf_tokenizer_mapping" in sys.modules else "taken")
"""


def _convert(gguf, out, env) -> str:
    p = subprocess.run(forkserve.python_command("-c", CONVERT, str(gguf), str(out)), capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()[-1]


def test_a_shared_tokenizer_is_converted_once_and_a_damaged_entry_again(tmp_path):
    from kvcache.models.random_llama import parse_shape, write_f16

    _, shape = parse_shape("hidden=64,layers=2,heads=4,kv_heads=2,ffn=128")
    a = write_f16(shape, tmp_path / "a.gguf", progress=False)  # SmolLM2's real tokenizer
    b = rewrite_gguf(a, tmp_path / "b.gguf", drop=("tokenizer.chat_template",),
                     add={"tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    home = fresh_home(tmp_path / "home")
    env = {**os.environ, "KVCACHE_HOME": str(home)}
    assert _convert(a, tmp_path / "out-a", env) == "converted"
    (entry,) = (home / "tokenizers").iterdir()
    assert _convert(b, tmp_path / "out-b", env) == "taken"
    want = (tmp_path / "out-a" / "tokenizer.json").read_bytes()
    assert (tmp_path / "out-b" / "tokenizer.json").read_bytes() == want
    configs = [json.loads((tmp_path / d / "tokenizer_config.json").read_text()) for d in ("out-a", "out-b")]
    assert configs[1]["chat_template"] == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert configs[0]["chat_template"] != configs[1]["chat_template"]
    assert {k: v for k, v in configs[0].items() if k != "chat_template"} == \
        {k: v for k, v in configs[1].items() if k != "chat_template"}
    # a token renamed in the kept file: still JSON, no longer the file its record names
    kept = entry / "tokenizer.json"
    kept.write_bytes(kept.read_bytes().replace(b'"<|im_end|>"', b'"<|im_END|>"', 1))
    assert kept.read_bytes() != want
    # a writer killed mid-entry left its folder: the next writer sweeps it (its owner is gone)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = home / "tokenizers" / ".entry-killed"
    stale.mkdir()
    (stale / "owner.pid").write_text(str(dead.pid))
    assert _convert(b, tmp_path / "out-c", env) == "converted"
    assert (tmp_path / "out-c" / "tokenizer.json").read_bytes() == want and kept.read_bytes() == want
    assert [p.name for p in (home / "tokenizers").iterdir()] == [entry.name]  # replaced, no temporary left


def test_an_entry_record_of_the_wrong_shape_is_not_taken(tmp_path):
    """The record beside tokenizer.json is read back from disk: tokens of the wrong types are a miss."""
    from kvcache.models.gguf_tokenizer import _read_entry, _write_entry

    tokens = {"bos_token": "<s>", "eos_token": None, "eos_token_ids": [2, 7]}
    _write_entry(tmp_path / "e", b'{"model": {}}', tokens)
    assert _read_entry(tmp_path / "e") == (b'{"model": {}}', tokens)
    assert [p.name for p in tmp_path.iterdir()] == ["e"] and not (tmp_path / "e" / "owner.pid").exists()
    for bad in ({"bos_token": 5}, {"eos_token": ["</s>"]}, {"eos_token_ids": [True]}, {"eos_token_ids": 2}):
        record = json.loads((tmp_path / "e" / "entry.json").read_text())
        (tmp_path / "e" / "entry.json").write_text(json.dumps({**record, "tokens": {**tokens, **bad}}))
        assert _read_entry(tmp_path / "e") is None, bad


def test_the_entry_is_named_by_the_tokenizer_keys_and_the_architecture(tmp_path):
    """transformers picks its converter by the architecture: a file that says another one, with the
    same tokenizer keys, names another entry; another chat template names the same one."""
    from kvcache.models.gguf_reader import gguf_reader
    from kvcache.models.gguf_tokenizer import _entry_dir
    from kvcache.models.random_llama import parse_shape, write_f16

    _, shape = parse_shape("hidden=64,layers=2,heads=4,kv_heads=2,ffn=128")
    a = write_f16(shape, tmp_path / "a.gguf", progress=False)
    b = rewrite_gguf(a, tmp_path / "b.gguf", drop=("tokenizer.chat_template",), add={"tokenizer.chat_template": "x"})
    c = rewrite_gguf(a, tmp_path / "c.gguf", drop=("general.architecture",), add={"general.architecture": "mistral"})
    named = [_entry_dir(gguf_reader(f)) for f in (a, b, c)]
    assert None not in named and named[0] == named[1] != named[2]
