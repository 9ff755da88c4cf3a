"""A GGUF file's tokenizer -> tokenizer.json + tokenizer_config.json (done once, at conversion).

transformers' GGUF tokenizer converters build the `tokenizers` object; at run time kvcache loads
only tokenizer.json with the `tokenizers` library.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvcache.errors import ModelLoadError

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


def write_tokenizer(gguf_path: Path, meta: dict[str, Any], out_dir: Path) -> None:
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
    tok.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    arch = meta.get("general.architecture")
    template = meta.get("tokenizer.chat_template") or (GEMMA_TEMPLATE if arch in ("gemma2", "gemma3") else None)
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    config = {
        # the generic fast tokenizer: transformers' AutoTokenizer would otherwise pick the
        # architecture's own class (CodeLlama's for llama), which insists on an "<unk>" token
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "bos_token": tok.convert_ids_to_tokens(int(bos_id)) if bos_id is not None else None,
        "eos_token": tok.convert_ids_to_tokens(int(eos_id)) if eos_id is not None else None,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "eos_token_ids": _end_of_turn_ids(tok, eos_id, [meta.get("tokenizer.ggml.eot_token_id"),
                                                        meta.get("tokenizer.ggml.eom_token_id")]),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


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
