"""A GGUF file's tokenizer -> tokenizer.json + tokenizer_config.json (done once, at conversion).

transformers' GGUF tokenizer converters build the `tokenizers` object; at run time kvcache loads
only tokenizer.json with the `tokenizers` library.

Files that share a tokenizer (one model's quantizations, a model under another chat template) share
its conversion: the tokenizer keys' bytes in the file (every ``tokenizer.ggml.*`` value: tokens,
merges, types, scores, special ids, pre-tokenizer) and its architecture (transformers picks the
converter by it), this module's format and transformers' version name an entry under ``$KVCACHE_HOME/tokenizers/`` (tokenizer.json and what the config takes from
it), written once, atomically, and checked by its SHA-256 before it is used: an entry that does not
check out is converted again and replaced. A Qwen vocabulary (151k tokens) took 5-8 s to convert.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kvcache.errors import ModelLoadError
from kvcache.paths import OWNER, cache_home, scratch

ENTRY_FORMAT = 1  # bump when what an entry holds, or how it is made, changes

# Gemma GGUF files carry no chat template; this renders Gemma's documented turn format.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{% if loop.index0 == 1 or (loop.first and m['role'] != 'system') %}{{ ns.system }}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_tokenizer(gguf_path: Path, meta: dict[str, Any], out_dir: Path, reader: Any = None) -> None:
    """tokenizer.json and tokenizer_config.json of ``gguf_path`` into ``out_dir``; with the file's
    ``reader``, from the shared entry of its tokenizer when one checks out (else made and kept)."""
    entry = _entry_dir(reader) if reader is not None else None
    made = _read_entry(entry) if entry is not None else None
    if made is None:
        made = _convert(gguf_path, meta)
        if entry is not None:
            _write_entry(entry, *made)
    text, tokens = made
    (out_dir / "tokenizer.json").write_bytes(text)
    arch = meta.get("general.architecture")
    template = meta.get("tokenizer.chat_template") or (GEMMA_TEMPLATE if arch in ("gemma2", "gemma3") else None)
    config = {
        # the generic fast tokenizer: transformers' AutoTokenizer would otherwise pick the
        # architecture's own class (CodeLlama's for llama), which insists on an "<unk>" token
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        **tokens,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _convert(gguf_path: Path, meta: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """(tokenizer.json's bytes, the config's bos_token, eos_token and eos_token_ids) converted by
    transformers from the file."""
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        raise ModelLoadError("converting a GGUF tokenizer needs transformers: pip install transformers") from None
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tok = _from_gguf(gguf_path) or AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path.name}: cannot read its tokenizer ({type(e).__name__}: {e})") from None
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    tokens = {
        "bos_token": tok.convert_ids_to_tokens(int(bos_id)) if bos_id is not None else None,
        "eos_token": tok.convert_ids_to_tokens(int(eos_id)) if eos_id is not None else None,
        "eos_token_ids": _end_of_turn_ids(tok, eos_id, [meta.get("tokenizer.ggml.eot_token_id"),
                                                        meta.get("tokenizer.ggml.eom_token_id")]),
    }
    return tok.backend_tokenizer.to_str(pretty=True).encode(), tokens


def _entry_dir(reader: Any) -> Path | None:
    """The shared entry of the file's tokenizer: a SHA-256 of its architecture's and every
    tokenizer key's bytes as the file holds them, this format and transformers' version. None where
    the bytes cannot be had."""
    try:
        import transformers

        data = reader.data
        base = data.__array_interface__["data"][0]
        h = hashlib.sha256(f"{ENTRY_FORMAT}|{transformers.__version__}".encode())
        keys = sorted(k for k in reader.fields if k.startswith("tokenizer.ggml."))
        if "tokenizer.ggml.tokens" not in keys or "general.architecture" not in reader.fields:
            return None
        for key in ["general.architecture", *keys]:
            field = reader.fields[key]
            last = field.parts[-1]
            end = last.__array_interface__["data"][0] - base + last.nbytes
            if not 0 <= field.offset < end <= data.nbytes:
                return None
            h.update(key.encode() + b"\0")
            h.update(memoryview(data[field.offset:end]).cast("B"))
    except Exception:  # noqa: BLE001 - a reader of another shape: convert, keep nothing
        return None
    return cache_home() / "tokenizers" / h.hexdigest()[:32]


def _read_entry(entry: Path) -> tuple[bytes, dict[str, Any]] | None:
    """An entry's tokenizer.json and tokens when its record names that file's SHA-256, else None."""
    try:
        record = json.loads((entry / "entry.json").read_text())
        text = (entry / "tokenizer.json").read_bytes()
        tokens = record["tokens"]
        ok = (record.get("format") == ENTRY_FORMAT and record.get("sha256") == hashlib.sha256(text).hexdigest()
              and isinstance(tokens, dict) and set(tokens) == {"bos_token", "eos_token", "eos_token_ids"}
              and all(t is None or isinstance(t, str) for t in (tokens["bos_token"], tokens["eos_token"]))
              and isinstance(tokens["eos_token_ids"], list)
              and all(isinstance(i, int) and not isinstance(i, bool) for i in tokens["eos_token_ids"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (text, tokens) if ok else None


def _write_entry(entry: Path, text: bytes, tokens: dict[str, Any]) -> None:
    """Keep a conversion as an entry: written in a folder of its own, then renamed into place (an
    entry that did not check out is replaced). A failure costs the next conversion its time only."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = scratch(entry.parent, ".entry-")  # a killed writer's are swept by the next one
    except OSError:
        return
    try:
        (tmp / "tokenizer.json").write_bytes(text)
        record = {"format": ENTRY_FORMAT, "sha256": hashlib.sha256(text).hexdigest(), "tokens": tokens}
        (tmp / "entry.json").write_text(json.dumps(record))
        (tmp / OWNER).unlink()
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_gguf(gguf_path: Path) -> Any:
    """The fast tokenizer AutoTokenizer makes of the file, built from transformers' GGUF tokenizer
    reader and converter directly: AutoTokenizer also parses the whole file for a model config
    (Gemma 3's 262k-token file: 16 s instead of 4.6). None where this transformers lacks them."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        return None
    arch, tokenizer, config = get_gguf_tokenizer(str(gguf_path))
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _end_of_turn_ids(tok: Any, eos_id: Any, file_ids: list[Any]) -> list[int]:
    """EOS, the file's end-of-turn and end-of-message ids, and the chat templates' end-of-turn
    tokens that exist in this vocabulary."""
    ids = [int(eos_id)] if eos_id is not None else []
    ids += [int(i) for i in file_ids if i is not None and int(i) not in ids]
    vocab = tok.get_vocab()
    for name in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>"):
        if name in vocab and vocab[name] not in ids:
            ids.append(vocab[name])
    return ids
