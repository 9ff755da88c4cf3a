"""kernels/signatures.py's table against the C: every entry is a function a source of its library
defines, with the prototype's parameters (names, types, order) and return type, and every function
the sources export under ``kv_`` has an entry. The bindings generated from it run a kernel."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from kvcache import kernels
from kvcache.kernels import build
from kvcache.kernels.signatures import SIGNATURES, Signature, ctype


class Definition(NamedTuple):
    source: str  # the .c file's name
    ret: str  # normalised return type
    params: tuple[tuple[str, str], ...]  # (name, normalised type)
    exported: bool  # neither static nor KV_HIDDEN


def norm(c_type: str) -> str:
    """A C type in one spelling: words one space apart, the pointer stars together after them
    (``const float*`` and ``const  float *`` both read ``const float *``)."""
    words = re.findall(r"[A-Za-z_]\w*", c_type)
    stars = c_type.count("*")
    return " ".join(words) + (" " + "*" * stars if stars else "")


def _strip(text: str) -> str:
    """C text without comments, preprocessor lines (continuations included) and punctuation inside
    string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', lambda m: '"' + re.sub(r"\W", "", m.group()) + '"', text)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)


def _param(text: str) -> tuple[str, str]:
    m = re.fullmatch(r"(.*?)\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)", text.strip(), flags=re.S)
    if m is None:
        raise ValueError(f"cannot read the parameter {text.strip()!r}")
    return m.group(2), norm(m.group(1) + ("*" if m.group(3) else ""))  # an array parameter is a pointer


def definitions(path: Path) -> dict[str, list[Definition]]:
    """Every function defined at the top level of a C file: name -> its definitions (one per
    preprocessor branch that holds one)."""
    text, out = _strip(path.read_text()), {}
    depth, head = 0, []
    for ch in text:
        if depth == 0 and ch == "{":
            _definition("".join(head).strip(), path.name, out)
            head = []
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            head = []
        elif depth == 0:
            if ch == ";":
                head = []
            else:
                head.append(ch)
    return out


def _definition(head: str, source: str, out: dict[str, list[Definition]]) -> None:
    """Record ``head`` (the text before a top-level brace) when it is a function's declarator."""
    if not head.endswith(")"):
        return  # a struct, union, enum or initializer
    level = 0
    for i in range(len(head) - 1, -1, -1):  # the parenthesis that opens the parameter list
        level += {")": 1, "(": -1}.get(head[i], 0)
        if level == 0:
            break
    m = re.search(r"([A-Za-z_]\w*)\s*$", head[:i])
    if m is None or m.group(1) == "__attribute__":
        return
    name, prefix, inner = m.group(1), head[:m.start()], head[i + 1:-1].strip()
    words = re.findall(r"[A-Za-z_]\w*", prefix)
    private = "static" in words or "KV_HIDDEN" in words or "hidden" in prefix
    prefix = re.sub(r"__attribute__\s*\(\(.*?\)\)|\b(?:static|inline|extern|KV_HIDDEN)\b", " ", prefix)
    params = () if inner in ("", "void") else tuple(_param(p) for p in _split(inner))
    out.setdefault(name, []).append(Definition(source, norm(prefix), params, not private))


def _split(params: str) -> list[str]:
    """A parameter list split at its top-level commas."""
    parts, level, cur = [], 0, ""
    for ch in params:
        level += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and level == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def hidden(paths: list[Path]) -> set[str]:
    """Functions declared KV_HIDDEN anywhere in these files (a definition takes a prior
    declaration's visibility: cattn.h hides what cattn.c defines)."""
    return {m.group(1) for p in paths
            for m in re.finditer(r"\bKV_HIDDEN\b[^;{}()]*?\b([A-Za-z_]\w*)\s*\(", _strip(p.read_text()))}


def exported(paths: list[Path]) -> dict[str, list[Definition]]:
    """The exported functions of these C files (their headers beside them read for KV_HIDDEN
    declarations): name -> its definitions."""
    found: dict[str, list[Definition]] = {}
    for p in paths:
        for name, defs in definitions(p).items():
            found.setdefault(name, []).extend(d for d in defs if d.exported)
    gone = hidden([*paths, *sorted({h for p in paths for h in p.parent.glob("*.h")})])
    return {n: d for n, d in found.items() if d and n not in gone}


def check(entry: Signature) -> list[str]:
    """What is wrong with a table entry against the C sources of its library (nothing: [])."""
    where = f"{entry.symbol} ({entry.lib})"
    try:
        defs = exported(build.sources(entry.lib)).get(entry.symbol, [])
    except OSError as e:
        return [f"{where}: the library's sources cannot be read ({e})"]
    if not defs:
        return [f"{where}: no exported definition in {', '.join(p.name for p in build.sources(entry.lib))}"]
    errors = []
    for d in defs:
        at = f"{where}, {d.source}"
        if norm(entry.ret) != d.ret:
            errors.append(f"{at}: returns {d.ret!r}, the table says {norm(entry.ret)!r}")
        if len(entry.params) != len(d.params):
            errors.append(f"{at}: {len(d.params)} parameters, the table has {len(entry.params)}")
        for i, (want, (name, c_type)) in enumerate(zip(d.params, entry.params)):
            if want[0] != name:
                errors.append(f"{at}: parameter {i} is {want[0]!r}, the table says {name!r}")
            if want[1] != norm(c_type):
                errors.append(f"{at}: parameter {i} {want[0]!r} is {want[1]!r}, the table says {norm(c_type)!r}")
        for name, c_type in d.params[len(entry.params):]:
            errors.append(f"{at}: parameter {name!r} ({c_type}) is missing from the table")
        for name, c_type in entry.params[len(d.params):]:
            errors.append(f"{at}: parameter {name!r} ({c_type}) is not in the C")
    return errors


def test_every_entry_matches_its_c_definition():
    errors = [e for s in SIGNATURES.values() for e in check(s)]
    assert not errors, "\n".join(errors)


def unlisted(folder: Path) -> list[str]:
    """The ``kv_`` functions the C files of ``folder`` export that the table lacks."""
    found = exported(sorted(folder.glob("*.c")))
    assert any(n.startswith("kv_") for n in found), "the parser found no kernel"
    return sorted(n for n in found if n.startswith("kv_") and n not in SIGNATURES)


def test_every_exported_kernel_has_an_entry():
    assert unlisted(build.SOURCES) == [], "exported kernels missing from kernels/signatures.py"


def test_every_entry_is_in_a_loaded_library_and_binds():
    for s in SIGNATURES.values():
        assert s.lib in ("qgemm", "qattn", "pgemm"), s  # the libraries kernels/__init__.py loads
        ctype(s.ret, result=True)  # raises for a C type without a ctypes type
        for _, t in s.params:
            ctype(t)


def test_the_parser_reads_multi_line_and_hidden_definitions(tmp_path):
    c = tmp_path / "k.c"
    c.write_text("""#include <stdint.h>
#define KV_HIDDEN __attribute__((visibility("hidden")))
/* int kv_commented(int a) { */
typedef struct { int a; } S;
static const char *names[] = {"x", "y"};
static inline float helper(const float *x) { return x[0]; }
KV_HIDDEN int hidden(int n) { return n; }
const char *kv_name(void) { return names[0]; }
int64_t
kv_multi(int n,
         const float*x, int64_t ldx,
         float eps, uint8_t *out) {
    if (n) { return 1; }
    return 0;
}
void kv_inner(float *y) { y[0] = 0; }
""")
    (tmp_path / "k.h").write_text("KV_HIDDEN void kv_inner(float *y);\n")  # hidden by its declaration
    got = definitions(c)
    assert set(got) == {"helper", "hidden", "kv_name", "kv_multi", "kv_inner"}
    assert set(exported([c])) == {"kv_name", "kv_multi"}
    assert got["kv_name"] == [Definition("k.c", "const char *", (), True)]
    assert got["kv_multi"] == [Definition("k.c", "int64_t", (("n", "int"), ("x", "const float *"), ("ldx", "int64_t"),
                                                            ("eps", "float"), ("out", "uint8_t *")), True)]


def _entry(symbol: str) -> Signature:
    return SIGNATURES[symbol]


def test_an_edited_source_is_caught(tmp_path, monkeypatch):
    """A parameter added to a kernel's C, and a new exported kernel, fail the checks until the
    table follows."""
    for f in [*build.SOURCES.glob("*.c"), *build.SOURCES.glob("*.h")]:
        (tmp_path / f.name).write_text(f.read_text())
    membw = tmp_path / "membw.c"
    text = membw.read_text()
    assert "int64_t n, int n_threads)" in text
    membw.write_text(text.replace("int64_t n, int n_threads)", "int64_t n, int64_t stride, int n_threads)")
                     + "\nint kv_new_probe(int n) { return n; }\n")
    monkeypatch.setattr(build, "SOURCES", tmp_path)
    errors = check(_entry("kv_stream_sum"))
    assert any("kv_stream_sum" in e and "parameter 2 is 'stride'" in e for e in errors), errors
    assert any("kv_stream_sum" in e and "'n_threads'" in e and "missing" in e for e in errors), errors
    assert check(_entry("kv_q_linear")) == []
    assert unlisted(tmp_path) == ["kv_new_probe"]


def test_the_checker_reports_swapped_types():
    right = _entry("kv_packed_matmul")
    params = list(right.params)
    params[4], params[5] = (params[4][0], params[5][1]), (params[5][0], params[4][1])  # x: int64_t, ldx: pointer
    errors = check(right._replace(params=tuple(params)))
    assert any("kv_packed_matmul" in e and "'x'" in e and "'int64_t'" in e for e in errors), errors
    assert any("kv_packed_matmul" in e and "'ldx'" in e and "'const float *'" in e for e in errors), errors


def test_the_checker_reports_a_missing_parameter():
    right = _entry("kv_stream_sum")
    errors = check(right._replace(params=right.params[:-1]))
    assert any("kv_stream_sum" in e and "'n_threads'" in e and "missing" in e for e in errors), errors
    errors = check(right._replace(params=(right.params[1], right.params[0], right.params[2])))  # names swapped
    assert any("kv_stream_sum" in e and "parameter 0 is 'x'" in e for e in errors), errors


def test_the_checker_reports_a_wrong_return_type_and_library():
    right = _entry("kv_int8_peak")
    errors = check(right._replace(ret="int"))
    assert any("kv_int8_peak" in e and "returns 'int64_t', the table says 'int'" in e for e in errors), errors
    errors = check(right._replace(lib="pgemm"))
    assert any("kv_int8_peak (pgemm)" in e and "no exported definition" in e for e in errors), errors


def test_the_bindings_are_generated_from_the_table():
    lib = kernels.qgemm()
    if lib is None:
        pytest.skip("no native kernels here")
    fn = lib.kv_q_linear
    assert fn.argtypes == [ctype(t) for _, t in SIGNATURES["kv_q_linear"].params] and len(fn.argtypes) == 16
    assert lib.kv_stream_sum.restype is ctypes.c_float and lib.kv_int8_peak.restype is ctypes.c_int64
    assert lib.kv_q_isa().decode() == kernels.variant()


def test_stream_sum_through_the_bindings():
    if kernels.qgemm() is None:
        pytest.skip("no native kernels here")
    x = torch.arange(8192, dtype=torch.float32) % 7
    assert kernels.stream_sum(x) == pytest.approx(float(x.sum()), rel=1e-6)
