"""Run-time tokenizer: tokenizer.json through the `tokenizers` library, chat templates through
models/templates.py (Jinja's sandbox, bounded in time and size)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcache.errors import InvalidParams, ModelLoadError
from kvcache.models.template_limits import DEFAULT_TIMEOUT, text_limit
from kvcache.recent import Recent


class Tokenizer:
    """A model's tokenizer and chat template. The template renders within ``template_timeout``
    seconds and writes at most ``template_chars`` characters (a cap tied to the model's context:
    models/template_limits.py), or fails with one ``InvalidParams``."""

    def __init__(self, backend: Any, config: dict[str, Any], hf_config: dict[str, Any],
                 template_timeout: float | None = None) -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.template_timeout = DEFAULT_TIMEOUT if template_timeout is None else template_timeout
        self.template_chars = text_limit(hf_config.get("max_position_embeddings", hf_config.get("n_positions")))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        ids = list(config.get("eos_token_ids") or [])
        for name in filter(None, [self.eos_token, "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>",
                                  "<|return|>", "<|call|>"]):
            tid = backend.token_to_id(name)
            if tid is not None and tid not in ids and (name == self.eos_token or self._in_template(name)):
                ids.append(tid)
        eos = hf_config.get("eos_token_id")
        for tid in eos if isinstance(eos, list) else [eos]:
            if isinstance(tid, int) and tid not in ids:
                ids.append(tid)
        if self._in_template("<|return|>") and self._in_template("<|call|>"):
            # gpt-oss's harmony format: a reply ends at <|return|> or <|call|>, while <|end|> only ends
            # one of its messages (its analysis before the final answer), as llama.cpp reads it
            end = backend.token_to_id("<|end|>")
            ids = [t for t in ids if t != end]
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self._template = None

    def _in_template(self, name: str) -> bool:
        return bool(self.chat_template) and name in self.chat_template  # type: ignore[operator]

    @classmethod
    def from_dir(cls, path: str | Path, template_timeout: float | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        backend = _backend(Backend, tj)
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        if not config.get("chat_template") and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        hf_config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        return cls(backend, config, hf_config, template_timeout)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL while it works (the one-text call holds it: a 6 MB text
        # stalled every other thread for seconds); the ids are the same
        return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """Text of ``ids``; with ``skip_special_tokens``, special tokens are left out except those in ``keep``."""
        ids = list(ids)
        if not skip_special_tokens or not keep or keep.isdisjoint(ids):
            return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        out, run = [], []
        for t in ids:
            if t in keep:
                out += [str(self.backend.decode(run, skip_special_tokens=True)) if run else "",
                        str(self.backend.decode([t], skip_special_tokens=False))]
                run = []
            else:
                run.append(t)
        if run:
            out.append(str(self.backend.decode(run, skip_special_tokens=True)))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: object) -> str:
        """The conversation as the model's template writes it; ``extra``: more variables for the
        template (``tools`` for a template that renders them)."""
        if not self.chat_template:
            raise InvalidParams("this model has no chat template: pass plain text, without --chat")
        if self._template is None:
            from kvcache.models.templates import ChatTemplate

            self._template = ChatTemplate(self.chat_template, self.template_timeout, self.template_chars)
        return self._template.render(messages=_template_messages(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the templated conversation (the template writes any BOS itself)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def check_chat_template(self) -> None:
        """Render a short conversation (system, user, assistant, user) as a model's load does: a
        template that passes a bound on it (time, size), or that the sandbox or Jinja's parser
        refuses, refuses the model (``ModelLoadError``). A template that fails it by itself (its
        ``raise_exception``, such as "system role not supported", or an error of its own code) is
        tried again without the system turn, and is kept either way: each request it fails gets
        its 400, and no request waits on it."""
        from kvcache.models.templates import PROBES, TemplateError

        if not self.chat_template:
            return
        for messages in PROBES:
            try:
                self.apply_chat_template(messages)
                return
            except TemplateError as e:
                if not e.own:
                    raise ModelLoadError(f"{e} (a short conversation rendered at load; the model is refused)") from None


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped (a
    template tests for a missing key, and would print "None"), and a message's reasoning under
    ``reasoning_content`` and ``thinking`` both."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, window: int = 6, keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.keep = keep  # special token ids written into the text (Tokenizer.decode)
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are fully emitted context
        self.emitted_text = ""
        self.window = window

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids[self.prefix :], keep=self.keep)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        delta = text[len(self.emitted_text) :]
        if len(self.ids) - self.prefix > self.window:
            # keep a short context window (spacing of word-piece decoders depends on it)
            self.prefix = len(self.ids) - 1
            self.emitted_text = self.tokenizer.decode(self.ids[self.prefix :], keep=self.keep)
        else:
            self.emitted_text = text
        return delta


_parsed = Recent(4)  # tokenizer files a process keeps parsed (a server's model and draft, a test's few models)


def _backend(backend_type: Any, tj: Path) -> Any:
    """``tokenizers.Tokenizer.from_file(tj)``, parsed once a process for each version of the file
    (its path, inode, size and modification time): a load of Gemma 3's 262k-token vocabulary
    takes a second, and a process (a test run, a server reloading, a draft beside its target) may
    load one model many times. The object is shared: kvcache never changes a tokenizer once made
    (padding and truncation stay off; llguidance's view is made from a copy)."""
    try:
        st = tj.stat()
        key = (str(tj.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ModelLoadError(f"{tj} cannot be read ({e.strerror})") from None

    def parse() -> Any:
        try:
            return backend_type.from_file(str(tj))
        except Exception as e:
            raise ModelLoadError(f"{tj} cannot be read ({e})") from None

    return _parsed.get(key, parse)
