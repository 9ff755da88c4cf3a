"""Structured outputs: a ``Constraint`` (a JSON schema, any JSON object, a regex, a list of choices,
or a Lark / GBNF grammar) is compiled once per model and text, and each constrained sample carries
its own matcher, which gives the tokens allowed next as a bitmask.

The grammar engine is llguidance (PyPI, no dependencies). ``Grammars.compile`` builds the grammar
once, checks it (a bad schema or grammar, one that matches no text, one over the size limits raises
``InvalidParams`` naming the problem) and keeps it by the constraint's hash; every sample then
starts from a copy of that first matcher, so a cached constraint costs a copy, not a compile.

``MaskWorker`` (engine/masks.py) computes the next token's masks for a step's constrained samples on
a worker thread while the forward pass runs (llguidance releases the GIL while it computes a mask).
JSON schemas are read as engine/schema.py closes them (declared properties only, bounded
whitespace); schemas, grammars and regexes nested deeper than ``MAX_DEPTH`` levels are refused.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcache.engine.masks import MaskWorker
from kvcache.engine.nesting import MAX_DEPTH, MAX_SCHEMA_JSON_DEPTH, grammar_syntax, text_depth
from kvcache.engine.schema import bounded_whitespace, closed_schema
from kvcache.errors import InvalidParams
from kvcache.recent import Recent

if TYPE_CHECKING:  # torch is imported where a mask is made: a request's parameters are checked without it
    import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
MAX_CONSTRAINT_BYTES = 64 << 10  # a schema or grammar larger than this is refused
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled constraints kept per model
# JSON as json.dumps writes it: ", " and ": ", no other whitespace (a small model given free
# whitespace may write newlines until max_tokens)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What a constrained sample's text must be. Build it with the class methods."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParams(f"unknown constraint kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise InvalidParams(f"a {self.kind} constraint must be text, got {type(self.text).__name__}")
        size = len(self.text.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidParams(f"the {_noun(self.kind)} has {size} bytes, over the limit of {MAX_CONSTRAINT_BYTES}")

    @classmethod
    def json_schema(cls, schema: Any) -> "Constraint":
        """Text that is JSON valid under ``schema`` (a dict, or its JSON text), with objects closed to
        their declared properties and whitespace bounded (engine/schema.py)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(_shallow(schema, "json", "JSON schema", MAX_SCHEMA_JSON_DEPTH))
            except json.JSONDecodeError as e:
                raise InvalidParams(f"the JSON schema is not valid JSON: {e.msg} at character {e.pos}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return cls("json_schema", json.dumps(bounded_whitespace(closed_schema(schema)), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if not isinstance(pattern, str) or not pattern:
            raise InvalidParams("a regex constraint must be a non-empty string")
        return cls("regex", _shallow(pattern, "regex", "regex"))

    @classmethod
    def choice(cls, choices: Any) -> "Constraint":
        """Exactly one of ``choices`` (non-empty strings)."""
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidParams("choices must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidParams(f"{len(choices)} choices, over the limit of {MAX_CHOICES}")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A grammar: GBNF (llama.cpp's, rules written ``name ::= ...``) or Lark (llguidance's)."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidParams("a grammar must be a non-empty string")
        return cls(grammar_syntax(text), _shallow(text, grammar_syntax(text), "grammar"))

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    def source(self) -> str:
        """The grammar llguidance reads."""
        import llguidance

        m = llguidance.LLMatcher
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return m.grammar_from_regex(self.text)
        if self.kind == "choice":
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.text)))
        if self.kind == "gbnf":
            try:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                return m.grammar_from_lark(gbnf_to_lark(self.text))
            except Exception as e:  # the converter raises its own errors for bad GBNF
                raise InvalidParams(f"the grammar is not valid GBNF: {_line(e)}") from None
        return m.grammar_from_lark(self.text)


def _shallow(text: str, syntax: str, noun: str, limit: int = MAX_DEPTH) -> str:
    if text_depth(text, syntax) > limit:
        raise InvalidParams(f"the {noun} is nested deeper than {MAX_DEPTH} levels")
    return text


def _noun(kind: str) -> str:
    return {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}.get(kind, "grammar")


def _line(e: object) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


class Compiled:
    """A checked constraint: ``matcher()`` gives a fresh matcher at the start of the text."""

    def __init__(self, constraint: Constraint, first: Any, compile_s: float) -> None:
        self.constraint, self._first, self.compile_s = constraint, first, compile_s

    def matcher(self) -> Any:
        return self._first.deep_copy()


class Grammars:
    """Constraints compiled for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer_source, self.vocab_size = tokenizer, vocab_size
        self._ll: Any = None
        self._cache: OrderedDict[str, Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (cache misses)
        self.hits = 0
        self._worker: MaskWorker | None = None

    def worker(self) -> MaskWorker:
        """The thread that computes masks beside the forward (one per model, started on first use)."""
        with self._lock:
            if self._worker is None:
                self._worker = MaskWorker(self.words)
            return self._worker

    @property
    def words(self) -> int:
        """int32 words in one token mask."""
        return (self.vocab_size + 31) // 32

    def tokenizer(self, what: str = "a constraint") -> Any:
        """llguidance's tokenizer (built once); a tokenizer it cannot read (a WordPiece one) makes
        every constraint an InvalidParams naming that."""
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = _ll_tokenizer(self._tokenizer_source, self.vocab_size)
                except Exception as e:  # llguidance's ValueError for a decoder it does not know
                    self._ll = e
            if isinstance(self._ll, Exception):
                raise InvalidParams(f"{what} cannot be used with this model: the grammar engine cannot read its "
                                    f"tokenizer ({_line(self._ll)})")
            return self._ll

    def compile(self, constraint: Constraint) -> Compiled:
        """The checked constraint, compiled on first use (thread-safe; a miss compiles outside the lock)."""
        key = constraint.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self._build(constraint)
        with self._lock:
            self._cache[key] = compiled
            self.compiles += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, constraint: Constraint) -> Compiled:
        import time

        import llguidance

        tok = self.tokenizer(f"the {_noun(constraint.kind)}")
        t0 = time.perf_counter()
        try:
            source = constraint.source()
            m = llguidance.LLMatcher(tok, source, log_level=0, limits=_limits())
        except InvalidParams:
            raise
        except Exception as e:  # llguidance raises ValueError for some bad inputs, and others
            raise InvalidParams(f"the {_noun(constraint.kind)} cannot be used: {_line(e)}") from None
        if m.is_error():
            raise InvalidParams(f"the {_noun(constraint.kind)} cannot be used: {_line(m.get_error())}")
        import torch

        mask = torch.zeros(self.words, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if m.is_error():
            raise InvalidParams(f"the {_noun(constraint.kind)} cannot be used: {_line(m.get_error())}")
        if not bool(mask.any()):
            raise InvalidParams(f"the {_noun(constraint.kind)} matches no text: no token can start it")
        return Compiled(constraint, m, time.perf_counter() - t0)

    def stats(self) -> dict[str, int]:
        return {"compiled": self.compiles, "cache_hits": self.hits, "cached": len(self._cache)}


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def grammars_for(tokenizer: Any, vocab_size: int) -> Grammars:
    """The one ``Grammars`` of a tokenizer object and vocabulary: every scheduler of a model (one
    per ``LLM.generate`` call, the server's) shares its compiled constraints."""
    with _SHARED_LOCK:
        per = _SHARED.setdefault(tokenizer, {})
        if vocab_size not in per:
            per[vocab_size] = Grammars(tokenizer, vocab_size)
        return per[vocab_size]


def _limits() -> Any:
    import llguidance

    # below llguidance's defaults for the grammar's size: a request may not make the engine spend
    # seconds building one; lexer states bound the memory one grammar takes
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000, verbose_errors=False)


_ll_views = Recent(4)


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the model's tokenizer (``kvcache.models.tokenizer.Tokenizer``), made
    once a process for each parsed tokenizer (models/tokenizer.py shares one for every load of a
    file; making the view serializes and parses the whole vocabulary three times). The entry holds
    the backend, so the id in its key stays that backend's while it is kept."""
    backend = tokenizer.backend
    key = (id(backend), vocab_size, tuple(tokenizer.eos_token_ids))
    return _ll_views.get(key, lambda: (backend, _make_ll_tokenizer(tokenizer, vocab_size)))[1]


def _make_ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    import llguidance

    backend = tokenizer.backend
    try:
        copy = type(backend).from_str(backend.to_str())
        copy.no_padding()
        copy.no_truncation()
        source = copy.to_str()
    except Exception:  # pragma: no cover - tokenizers objects all serialize
        source = backend.to_str()
    eos = list(tokenizer.eos_token_ids) or None
    return llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmasks [R, W] -> allowed [R, vocab] (bool): token t is bit t % 32 of word t // 32
    (little-endian words, so byte t // 8, bit t % 8)."""
    import numpy as np
    import torch

    words = bitmask.contiguous().numpy()
    if words.dtype.byteorder == ">" or (words.dtype.byteorder == "=" and np.little_endian is False):
        words = words.byteswap()
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)[:, :vocab]
