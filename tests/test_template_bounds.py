"""A chat template runs bounded in time and size and cannot wedge the engine: a runaway render stops
on its own thread at its deadline, a value over the cap is refused before it is built (at compile
time too), every failure is one line naming the template, a template that cannot render a short
conversation refuses its model at load, and on a real server a runaway request is a 400 that
harms no other request and does not keep SIGTERM from stopping the server."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from kvcache.errors import InvalidParams, ModelLoadError
from kvcache.models.template_limits import MAX_SOURCE, text_limit
from kvcache.models.tokenizer import Tokenizer

from test_cli_errors import assert_one_line_error, run_cli
from test_server import Server, _model

CHAT = [{"role": "user", "content": "hi"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def tokenizer(template: str, timeout: float = 1.0, context: int | None = None) -> Tokenizer:
    backend = Backend(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    hf = {"max_position_embeddings": context} if context else {}
    return Tokenizer(backend, {"chat_template": template}, hf, template_timeout=timeout)


def failure(template: str, messages: list[dict] = CHAT, **kw) -> tuple[str, float]:
    """(the message of the InvalidParams a render raises, seconds it took)."""
    tok = tokenizer(template, **kw)
    t0 = time.monotonic()
    with pytest.raises(InvalidParams) as e:
        tok.apply_chat_template(messages)
    return str(e.value), time.monotonic() - t0


def on_a_thread(fn) -> tuple[object, float]:
    """What ``fn()`` returns or raises on a worker thread (as the server renders), and its seconds."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["value"] = e
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the render did not stop"
    return out["value"], out["s"]


# -- time --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    LOOPS,
    "{% set s = 'x' * 60000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",  # loops over a string
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "{% for x in range(2) recursive %}{% if loop.depth < 40 %}{{ loop(range(2)) }}{% endif %}{% endfor %}",
], ids=["nested ranges", "nested string loops", "exponential macro", "recursive loop"])
def test_a_runaway_render_stops_on_its_own_thread_at_its_deadline(template):
    tok = tokenizer(template, timeout=0.3)
    error, seconds = on_a_thread(lambda: tok.apply_chat_template(CHAT))
    assert isinstance(error, InvalidParams)
    assert str(error) == "chat template: rendering took more than 0.3 s (--template-timeout)"
    assert 0.3 <= seconds < 0.8


# -- size --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template, needle", [
    ("{% set x = 'x' * 2000000000 %}{{ x|length }}", "the operator * would make more than 4 MiB of text"),
    ("{{ ['y' * 1000] * 100000 }}", "the operator *"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "operator ~"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "operator +"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
     "printing a value"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l|tojson }}", "the filter tojson"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(60) %}{% set ns.l = [ns.l|join, ns.l|join] %}{% endfor %}",
     "the filter join"),
    ("{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
     "{% set ns.s = d(ns.s) %}{% endfor %}", "a call of d()"),
    ("{% macro m() %}{% for i in range(100000) %}" + "x" * 10000 + "{% endfor %}{% endmacro %}{% set y = m() %}",
     "the template wrote more than 64 MiB of text"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% set ns.s = t %}{% endfor %}", "of text"),
    ("{% filter upper %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endfilter %}", "of text"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered prompt exceeds 4 MiB of text"),
    ("{{ 'x'|center(2000000000) }}", "the filter center"),
    ("{{ ('a\n' * 1000)|indent(2000000) }}", "the filter indent"),
    ("{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}", "the filter replace"),
    ("{{ '%2000000000s'|format('x') }}", "the filter format"),
    ("{{ ('a ' * 1000000)|wordwrap(1) }}", "the filter wordwrap"),
    ("{{ [[[[[[[1]]]]]]]|tojson(indent=1000000000) }}", "the filter tojson"),
    ("{{ [1]|batch(100000000, 'x')|list|length }}", "the filter batch"),
    ("{{ [1]|slice(100000000)|list|length }}", "the filter slice"),
    ("{{ '%2000000000s' % 'x' }}", "the operator %"),
    ("{{ 'x'.ljust(2000000000) }}", "str.ljust()"),
    ("{{ '{:2000000000}'.format('x') }}", "str.format()"),
    ("{{ ('x' * 1000).translate({120: 'y' * 1000000}) }}", "str.translate()"),
    ("{{ ('-' * 1000000).join(['a'] * 10) }}", "str.join()"),
    ("{{ lipsum(100000000) }}", "lipsum()"),
    ("{{ 10 ** 100000000 }}", "the operator ** would make an integer of more than 65536 bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(100) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "integer"),
], ids=lambda v: v[:40] if isinstance(v, str) and "{" in v else None)
def test_a_value_over_the_cap_is_refused_before_it_is_built(template, needle):
    message, seconds = failure(template)
    assert message.startswith("chat template: ") and needle in message and "\n" not in message
    assert seconds < 0.9


def test_the_big_constant_is_not_built_when_the_template_compiles():
    """Jinja folds constant expressions while compiling: ``'x' * 2000000000`` allocated 2 GB there
    before this sandbox intercepted the operator."""
    code = ("import resource; from kvcache.models.templates import ChatTemplate, environment\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "environment().from_string(\"{% set x = 'x' * 2000000000 %}{{ x }}\")\n"
            "try:\n    ChatTemplate(\"{{ 'x' * 2000000000 }}\").render(messages=[])\n"
            "except Exception as e:\n    print(e)\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    refused, grown_mb = out.stdout.splitlines()
    assert "the operator * would make more than 4 MiB of text" in refused
    assert int(grown_mb) < 50, out.stdout


def test_the_output_cap_follows_the_context():
    assert text_limit(8192) == 256 << 10 and text_limit(32768) == 1 << 20
    assert text_limit(None) == text_limit(10**7) == 4 << 20 and text_limit(256) == 64 << 10
    tok = tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}", context=8192)
    assert len(tok.apply_chat_template([{"role": "user", "content": "a" * 200_000}])) == 200_000
    message, _ = failure(tok.chat_template, [{"role": "user", "content": "a" * 300_000}], context=8192)
    assert message == "chat template: the rendered prompt exceeds 256 KiB of text"


def test_recursion_ends_as_an_error_on_a_worker_thread():
    tok = tokenizer("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    error, _ = on_a_thread(lambda: tok.apply_chat_template(CHAT))
    assert isinstance(error, InvalidParams) and str(error).startswith("chat template: RecursionError:")
    assert str(error).endswith("(line 1)")


# -- every failure, one line -------------------------------------------------------------------------
@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__ }}",
     "chat template: not allowed by the sandbox: access to attribute '__class__' of 'str' object is unsafe."),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}",
     "chat template: not allowed by the sandbox: a chat template may not store '_x' on a namespace "
     "(names must not begin with _)"),
    ("hi\n{% for x in %}", "chat template: TemplateSyntaxError: Expected an expression, got 'end of statement block' "
                           "(line 2)"),
    ("hi\n{{ foo.bar }}", "chat template: UndefinedError: 'foo' is undefined (line 2)"),
    ("a\nb\n{{ 'a' + 1 }}", 'chat template: TypeError: can only concatenate str (not "int") to str (line 3)'),
    ("{{ raise_exception('tool calls need\nids of 9 characters') }}",
     "chat template: tool calls need ids of 9 characters"),
    ("x" * (MAX_SOURCE + 1), f"chat template: the template has {MAX_SOURCE + 1:,} characters; at most 128 KiB is "
                             "compiled"),
], ids=["sandbox", "namespace", "syntax", "undefined", "type", "raise_exception", "source size"])
def test_every_failure_is_one_line_that_names_the_template(template, message):
    assert failure(template)[0] == message


def test_a_template_that_does_not_compile_is_compiled_once(monkeypatch):
    import kvcache.models.templates as templates

    compiled = []
    monkeypatch.setattr(templates, "environment", lambda *a: compiled.append(1) or templates._BoundedEnvironment())
    tok = tokenizer("{% for %}")
    errors = []
    for _ in range(3):
        with pytest.raises(InvalidParams) as e:
            tok.apply_chat_template(CHAT)
        errors.append(str(e.value))
    assert compiled == [1] and len(set(errors)) == 1 and "TemplateSyntaxError" in errors[0]


def test_honest_templates_render_as_transformers_renders_them():
    """Everything the bounds intercept (loops, loop.length, macros, recursive loops, blocks, every
    checked operator, filter and str method) renders the same text as transformers' renderer."""
    from transformers import PreTrainedTokenizerFast

    template = (
        "{%- set ns = namespace(n=0, parts=[]) -%}"
        "{%- for m in messages -%}{{ loop.index }}/{{ loop.length }} {{ m.role|upper|center(12) }} "
        "{{ (m.content ~ '!') * 2 }}{% set ns.n = ns.n + m.content|length %}{% set ns.parts = ns.parts + [m.role] %}\n"
        "{% endfor -%}"
        "{{ ns.parts|join(', ') }} {{ '%s=%d' % ('n', ns.n) }} {{ '{}-{:>4}'.format('a', 3) }} {{ range(3) }} "
        "{{ range(5)|list }}\n{{ messages|tojson(indent=2) }} {{ [1, 2, 3, 4, 5]|batch(2, 0)|list }} "
        "{{ [1, 2, 3]|slice(2)|list }} {{ 'a\nb'|indent(4, true) }} {{ 'x'.ljust(5) }}| {{ 'ab'|replace('b', 'cd') }} "
        "{{ ([1] + [2]) * 2 }} {{ 2 ** 10 }} {{ 3 * 4 }} {{ [[1, 2], [3]]|sum(start=[]) }} {{ [1, 2]|sum }}\n"
        "{%- macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %} {{ r(5) }}\n"
        "{% for x in [1, [2, [3]]] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}{% endif %}"
        "{% endfor %}\n{% filter upper %}{{ 'shout' }}{% endfilter %} {% set blk %}b{{ 1 }}{% endset %}{{ blk }} "
        "{{ 'long words here'|wordwrap(5) }} {{ {'a': 1}|pprint }} {{ 12|string ~ 'x' }} {{ 'ab'|list }} "
        "{{ '%-6s|'|format('ab') }} {{ '-'.join(['a', 'b']) }} {{ 'a\tb'.expandtabs(4) }} {{ 'ab'.zfill(4) }}"
        "{% for i in range(3) if i != 1 %}{{ i }}{% else %}none{% endfor %}{% for i in [] %}{% else %}none{% endfor %}"
        "{% generation %}{{ 'gen' }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ loop.revindex }}{% break %}{% endfor %}"
    )
    messages = [{"role": "system", "content": "Sois bref."}, {"role": "user", "content": "Deux et deux ?"},
                {"role": "assistant", "content": "Quatre."}]
    backend = Backend(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    theirs = PreTrainedTokenizerFast(tokenizer_object=backend).apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert tokenizer(template).apply_chat_template(messages) == theirs


# -- at load: a short conversation -------------------------------------------------------------------
def test_a_template_that_cannot_render_a_short_chat_in_time_refuses_the_model():
    with pytest.raises(ModelLoadError, match=r"^chat template: rendering took more than 0.2 s \(--template-timeout\) "
                                             r"\(a short conversation rendered at load; the model is refused\)$"):
        tokenizer(LOOPS, timeout=0.2).check_chat_template()
    for bad in ("{% for %}", "{{ ''.__class__.__mro__ }}", "{{ 'x' * 2000000000 }}"):
        with pytest.raises(ModelLoadError, match="^chat template: "):
            tokenizer(bad).check_chat_template()


def test_a_template_that_refuses_the_system_turn_by_itself_keeps_its_model():
    no_system = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                 "{% for m in messages %}{{ m.content }}{% endfor %}")
    tokenizer(no_system).check_chat_template()  # the second conversation has no system turn
    tokenizer("{{ raise_exception('tools are required') }}").check_chat_template()  # its own refusal: kept
    tokenizer("{{ functions.x }}").check_chat_template()  # an error of its own code: each request gets its 400
    with pytest.raises(InvalidParams, match="System role not supported"):
        tokenizer(no_system).apply_chat_template([{"role": "system", "content": "s"}])


def test_a_time_limit_that_is_not_positive_is_refused():
    with pytest.raises(InvalidParams, match="positive"):
        tokenizer("{{ 1 }}", timeout=0).apply_chat_template(CHAT)
    assert_one_line_error(run_cli("generate", "hi", "--template-timeout", "0"), "--template-timeout must be a positive")


# -- a real server -------------------------------------------------------------------------------------
# loops when a message says so, writes past the sandbox or the cap when one says so: it passes the
# probe at load, so the same server serves the runaway requests and the healthy ones
HOSTILE = (
    "{% for m in messages %}"
    "{% if m['content'] == 'loop forever' %}" + LOOPS + "{% endif %}"
    "{% if m['content'] == 'escape' %}{{ m.__class__.__mro__ }}{% endif %}"
    "{% if m['content'] == 'grow' %}{{ 'x' * 2000000000 }}{% endif %}"
    "<{{ m['role'] }}> {{ m['content'] }} </turn> {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)


def _model_with_template(tiny_dir, tmp_path, template: str, name: str) -> str:
    src = tiny_dir("llama")[0]
    folder = tmp_path / name
    shutil.copytree(src, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return str(folder)


def _chat(server: Server, content: str) -> tuple[int, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return server.post("/v1/chat/completions", json.dumps(body).encode())


def test_the_library_renders_under_the_same_bounds(tiny_dir, tmp_path):
    from kvcache import LLM, SamplingParams

    llm = LLM(_model_with_template(tiny_dir, tmp_path, HOSTILE, "hostile"), template_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(InvalidParams, match=r"^chat template: rendering took more than 0.3 s \(--template-timeout\)$"):
        llm.generate([[{"role": "user", "content": "loop forever"}]], SamplingParams(max_tokens=2))
    assert time.monotonic() - t0 < 1
    assert llm.generate([[{"role": "user", "content": "t5 t6"}]], SamplingParams(max_tokens=2))[0].token_ids
    with pytest.raises(ModelLoadError, match="rendering took more than 0.3 s"):
        LLM(_model_with_template(tiny_dir, tmp_path, LOOPS, "refused"), template_timeout=0.3)


def test_runaway_requests_harm_no_other_request_and_sigterm_still_stops_the_server(tiny_dir, tmp_path):
    s = Server(_model_with_template(tiny_dir, tmp_path, HOSTILE, "hostile"), "--kv", "dynamic,page_size=4",
               "--template-timeout", "0.5", "--served-model-name", "tiny")
    try:
        assert _model(s) == "tiny"
        contents = ["loop forever", "t5 t6 t7"] * 4 + ["escape", "grow"]
        with ThreadPoolExecutor(len(contents)) as pool:
            t0 = time.monotonic()
            replies = list(pool.map(lambda c: _chat(s, c), contents))
            took = time.monotonic() - t0
        for content, (code, body) in zip(contents, replies):
            if content == "t5 t6 t7":
                assert code == 200 and body["choices"][0]["message"]["content"] is not None, body
                continue
            assert code == 400 and body["error"]["param"] == "messages", body
            assert body["error"]["message"] == {
                "loop forever": "chat template: rendering took more than 0.5 s (--template-timeout)",
                "escape": "chat template: not allowed by the sandbox: access to attribute '__class__' of 'dict' "
                          "object is unsafe.",
                "grow": "chat template: the operator * would make more than 64 KiB of text",
            }[content]
        assert took < 10
        assert s.get("/health")[0] == 200 and _chat(s, "t8 t9")[0] == 200
        # SIGTERM while runaway renders hold worker threads: the server still stops, cleanly
        pending = [threading.Thread(target=_chat, args=(s, "loop forever"), daemon=True) for _ in range(6)]
        for t in pending:
            t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
    log = s.proc.stdout.read() if s.proc.stdout else ""
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("template, needle", [
    (LOOPS, "chat template: rendering took more than 0.3 s (--template-timeout)"),
    ("{% set x = 'x' * 2000000000 %}{{ x }}", "chat template: the operator * would make more than 64 KiB of text"),
], ids=["runaway", "two gigabytes"])
def test_a_model_whose_template_fails_a_short_chat_is_refused_by_serve(tiny_dir, tmp_path, template, needle):
    model = _model_with_template(tiny_dir, tmp_path, template, "refused")
    t0 = time.monotonic()
    proc = run_cli("serve", "--model", model, "--template-timeout", "0.3", "--port", "1")
    assert_one_line_error(proc, needle)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith("(a short conversation rendered at load; the model is refused)")
    assert time.monotonic() - t0 < 30
