"""Grammar engines as peers of the one kvcache runs: llguidance (kvcache's own) and xgrammar, each in
a child process (a crash or a missing package is a skipped row). Given the model's tokenizer file,
a JSON schema and its JSON options, and the token ids of a valid JSON text: tokenizer setup, schema
compile, the first mask, and the mean and max time of one token mask as later requests see it.

The child is ``python -m kvcache.peers.grammar_engines`` with a JSON request on stdin: one row.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from kvcache.peers.process import child_main, run_module

ENGINES = ("llguidance", "xgrammar")
ENGINE_TIMEOUT_S = 600.0


def engine_row(engine: str, tokenizer_file: str, vocab: int, eos: list[int], ids: list[int], threads: int,
               schema: str, json_options: dict[str, object], walks: int) -> dict[str, object]:
    """One engine's row, measured in a child process (or skipped with the reason): ``schema`` a JSON
    schema's text, ``ids`` a valid JSON text's token ids, walked ``walks`` times."""
    req = {"engine": engine, "tokenizer_file": tokenizer_file, "vocab_size": vocab, "eos": eos, "ids": ids,
           "schema": schema, "json_options": json_options, "walks": walks, "threads": threads}
    out = run_module("kvcache.peers.grammar_engines", req, engine, timeout=ENGINE_TIMEOUT_S)
    return out.data if out.ok and isinstance(out.data, dict) else _engine_skipped(engine, out.note)


def _engine_skipped(engine: str, note: str) -> dict[str, object]:
    return {"engine": engine, "version": None, "tokenizer_s": None, "compile_s": None, "first_mask_us": None,
            "cold_mean_us": None, "mask_mean_us": None, "mask_max_us": None, "advance_us": None, "tokens": 0,
            "accepted": None, "note": note}


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _walk(engine: str, new_matcher: Any, mask: Any, advance: Any, eos_allowed: Any, ids: list[int],
          walks: int) -> dict[str, object]:
    """Mask, then advance by each token of ``ids``, from a fresh matcher, ``walks`` times; the first
    walk is cold. After the last token the text must be complete (EOS allowed)."""
    first_mask, cold, warm, adv = 0.0, [], [], []
    accepted = True
    for w in range(walks):
        m = new_matcher()
        for i, tok in enumerate([*ids, None]):
            t0 = time.perf_counter()
            mask(m)
            d = time.perf_counter() - t0
            if w == 0 and i == 0:
                first_mask = d
            (cold if w == 0 else warm).append(d)
            if tok is None:
                accepted = accepted and bool(eos_allowed(m))
                break
            t0 = time.perf_counter()
            ok = advance(m, tok)
            adv.append(time.perf_counter() - t0)
            if not ok:
                accepted = False
                break
    warm = warm or cold
    return {"first_mask_us": first_mask * 1e6, "cold_mean_us": statistics.mean(cold) * 1e6,
            "mask_mean_us": statistics.mean(warm) * 1e6, "mask_max_us": max(warm) * 1e6,
            "advance_us": statistics.mean(adv) * 1e6 if adv else None, "tokens": len(ids), "accepted": accepted,
            "note": "" if accepted else f"{engine} refused the JSON text"}


def _bit(words: Any, tok: int) -> bool:
    return bool((int(words[tok // 32]) >> (tok % 32)) & 1)


def _llguidance(req: dict[str, Any]) -> dict[str, object]:
    import ctypes

    try:
        import llguidance
        import tokenizers
    except ImportError as e:
        return _engine_skipped("llguidance", f"{e.name} not installed: skipped")
    vocab, eos = int(req["vocab_size"]), [int(t) for t in req["eos"]]
    t0 = time.perf_counter()
    backend = tokenizers.Tokenizer.from_file(req["tokenizer_file"])
    backend.no_padding()
    backend.no_truncation()
    tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos or None)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(req["schema"], defaults=req["json_options"])
    first = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    if first.is_error():
        return _engine_skipped("llguidance", f"llguidance refused the schema: {first.get_error()}")
    words = (vocab + 31) // 32
    buf = (ctypes.c_int32 * words)()
    ptr = ctypes.addressof(buf)
    walked = _walk("llguidance", first.deep_copy, lambda m: m.unsafe_compute_mask_ptr(ptr, words * 4),
                   lambda m, t: m.consume_token(t), lambda m: any(_bit(buf, e) for e in eos),
                   [int(t) for t in req["ids"]], int(req["walks"]))
    return {"engine": "llguidance", "version": _version("llguidance"), "tokenizer_s": tokenizer_s,
            "compile_s": compile_s, **walked}


def _xgrammar(req: dict[str, Any]) -> dict[str, object]:
    try:
        import xgrammar as xgr
    except ImportError:
        return _engine_skipped("xgrammar", "xgrammar not installed (pip install 'kvcache[xgrammar]'): skipped")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return _engine_skipped("xgrammar", "xgrammar reads the tokenizer through transformers, not installed: "
                                           "skipped")
    vocab, eos = int(req["vocab_size"]), [int(t) for t in req["eos"]]
    opts = req["json_options"]
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=req["tokenizer_file"])
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos or None)
    tokenizer_s = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, max_threads=max(1, int(req["threads"])), cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        req["schema"], any_whitespace=bool(opts.get("whitespace_flexible", False)),
        separators=(str(opts.get("item_separator", ", ")), str(opts.get("key_separator", ": "))))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    row = bitmask[0]
    walked = _walk("xgrammar", lambda: xgr.GrammarMatcher(compiled), lambda m: m.fill_next_token_bitmask(bitmask, 0),
                   lambda m, t: m.accept_token(t), lambda m: any(_bit(row, e) for e in eos),
                   [int(t) for t in req["ids"]], int(req["walks"]))
    return {"engine": "xgrammar", "version": _version("xgrammar"), "tokenizer_s": tokenizer_s,
            "compile_s": compile_s, **walked}


def _engine_child(req: dict[str, Any]) -> dict[str, object]:
    engine = req.get("engine")
    if engine == "llguidance":
        return _llguidance(req)
    if engine == "xgrammar":
        return _xgrammar(req)
    return _engine_skipped(str(engine), f"unknown grammar engine {engine!r}")


if __name__ == "__main__":
    sys.exit(child_main(_engine_child))
