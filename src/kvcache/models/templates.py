"""Chat templates: rendered as transformers renders them, inside bounds of time and size.

A template comes with the model file and runs in Jinja's immutable sandbox, set up as transformers
sets it up (its tojson, loop controls, ``raise_exception``, ``strftime_now``, ``dict``, namespaces,
the ``{% generation %}`` block). The sandbox blocks code execution but not time or memory, so
every render here also has (models/template_limits.py, models/template_checks.py):

- a deadline (``--template-timeout``, 1 s by default), checked at every loop iteration, call,
  operator and piece of output, so that a runaway render stops on its own thread within about the
  deadline (a thread cannot be killed);
- a cap on the text: the prompt it writes, each value it builds (``'x' * 2000000000`` is refused
  before it is allocated, and is not folded at compile time either), and all the text written into
  macros and blocks together;
- a cap on the source compiled (128 KiB: compiling costs seconds beyond it).

Every failure is one ``TemplateError`` (an ``InvalidParams``): "chat template: <why>", with the
template's line where there is one. ``PROBES`` is the short conversation a model's load renders
(``Tokenizer.check_chat_template``), so that a template that cannot render one in time refuses its
model instead of every request.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, pass_context

from kvcache.errors import InvalidParams
from kvcache.models import template_checks as checks
from kvcache.models import template_limits as limits
from kvcache.models.template_limits import Exceeded, size_label, tick

LOOP_ITEMS = "kvcache_loop_items"  # the filter every {% for %} iterates through


class TemplateError(InvalidParams):
    """A chat template failed. ``own``: the template refused by itself (its ``raise_exception``,
    or an error of its own code such as a missing key), as opposed to reaching a bound, the
    sandbox or a syntax error."""

    def __init__(self, message: str, own: bool = False) -> None:
        super().__init__(message)
        self.own = own


class ChatTemplate:
    """One template source, compiled once (on first use), rendered under its bounds by any thread."""

    def __init__(self, source: str, timeout: float = limits.DEFAULT_TIMEOUT, max_chars: int = limits.MAX_TEXT) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise InvalidParams(f"the chat template's time limit must be a positive number of seconds, got {timeout!r} "
                                "(--template-timeout)")
        self.source, self.timeout, self.max_chars = source, float(timeout), max_chars
        self._lock = threading.Lock()
        self._compiled: Any = None
        self._failure: TemplateError | None = None

    def render(self, **variables: Any) -> str:
        """The template's text for ``variables``; a ``TemplateError`` when it fails or passes a bound."""
        template = self._template()
        limits.begin(self.timeout, self.max_chars)
        pieces, size = [], 0
        stream = template.generate(**variables)
        try:
            for piece in stream:
                size += len(piece)
                if size > self.max_chars:
                    raise Exceeded(f"the rendered prompt exceeds {size_label(self.max_chars)} of text")
                pieces.append(piece)
        except TemplateError:
            raise
        except Exception as e:  # every failure, in one line
            raise _error(e) from None
        finally:
            stream.close()
            limits.end()
        return "".join(pieces)

    def _template(self) -> Any:
        with self._lock:
            if self._compiled is None and self._failure is None:
                if len(self.source) > limits.MAX_SOURCE:
                    self._failure = TemplateError(f"chat template: the template has {len(self.source):,} characters; "
                                                  f"at most {size_label(limits.MAX_SOURCE)} is compiled")
                else:
                    try:
                        self._compiled = environment(self.max_chars).from_string(self.source)
                    except Exception as e:
                        self._failure = _error(e)
            if self._failure is not None:  # a new exception each time: none keeps every request's frames
                raise TemplateError(str(self._failure), self._failure.own)
            return self._compiled


# A short conversation every chat template must render at load; the second one, without a system
# turn, for templates that refuse a system role by themselves.
PROBES = (
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello."},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name a colour."}],
)


def _error(e: BaseException) -> TemplateError:
    """``e``, raised by compiling or rendering a template, as one line that names its cause."""
    if isinstance(e, TemplateError):
        return e
    if isinstance(e, Exceeded):
        return TemplateError(f"chat template: {e}")
    if isinstance(e, SecurityError):
        return TemplateError(f"chat template: not allowed by the sandbox: {_line(str(e))}")
    if isinstance(e, TemplateSyntaxError):
        return TemplateError(f"chat template: TemplateSyntaxError: {_line(e.message or '')} (line {e.lineno})")
    where = _template_line(e)
    message = _line(str(e))
    return TemplateError(f"chat template: {type(e).__name__}" + (f": {message}" if message else "")
                         + (f" (line {where})" if where else ""), own=not isinstance(e, (RecursionError, MemoryError)))


def _line(text: str, most: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 3] + "..."


def _template_line(e: BaseException) -> int | None:
    """The template's line where ``e`` was raised (Jinja rewrites its frames to the template's)."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# -- the environment ---------------------------------------------------------------------------------
class _Loop:
    """What a ``{% for %}`` iterates: the items, with the deadline checked before each."""

    __slots__ = ("_items", "_it")

    def __init__(self, items: Any) -> None:
        self._items, self._it = items, iter(items)

    def __iter__(self) -> "_Loop":
        return self

    def __next__(self) -> Any:
        tick()
        return next(self._it)

    def __len__(self) -> int:  # loop.length: a TypeError makes Jinja count the items instead
        return len(self._items)


@pass_context  # never folded at compile time
def _loop_items(_context: Any, items: Any) -> _Loop:
    return _Loop(items)


class _BoundedCode(CodeGenerator):
    """Jinja's code generator with the bounds' calls written in: every ``{% for %}`` iterates
    through ``_Loop``, every piece of output (at any level) goes through ``kv_emit`` and every
    value printed through ``kv_value``, every ``~`` through ``kv_concat``."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in list(node.find_all(nodes.For)):
            loop.iter = nodes.Filter(loop.iter, LOOP_ITEMS, [], [], None, None, lineno=loop.iter.lineno)
            loop.iter.set_environment(self.environment)
        super().visit_Template(node, frame)

    def _output_const_repr(self, group: Any) -> str:
        return f"environment.kv_emit({super()._output_const_repr(group)})"

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.kv_emit(")
        super()._output_child_pre(node, frame, finalize)
        self.write("environment.kv_value(")

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write(")")
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.kv_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        if frame.eval_ctx.volatile:
            self.write("), (markup_join if context.eval_ctx.volatile else str_join))")
        else:
            self.write("), markup_join)" if frame.eval_ctx.autoescape else "), str_join)")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the operators that build big values intercepted (which also
    keeps Jinja from folding them at compile time) and every call checked."""

    code_generator_class = _BoundedCode
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    max_chars = limits.MAX_TEXT

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        checks.check_binop(operator, left, right, self.max_chars)
        return self.binop_table[operator](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (as Jinja's)
        tick()
        args = checks.check_method(__obj, args, kwargs, __self.max_chars)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str):
            name = getattr(__obj, "name", None) or getattr(__obj, "__name__", "a function")  # a macro's, a function's
            limits.refuse_over(len(result), __self.max_chars, f"a call of {name}()")
        return result

    def kv_emit(self, piece: str) -> str:
        limits.add_work(len(piece))
        return piece

    def kv_value(self, value: Any) -> Any:
        if not isinstance(value, str):  # a string is counted as it is written; a container's text is made here
            limits.refuse_over(limits.measure(value)[0], self.max_chars, "printing a value")
        return value

    def kv_concat(self, parts: tuple, join: Any) -> str:
        tick()
        limits.refuse_over(sum(limits.chars_of(p) for p in parts), self.max_chars, "the operator ~")
        return join(parts)


def environment(max_chars: int = limits.MAX_TEXT) -> Any:
    """The sandbox set up as transformers sets it up for chat templates, with the bounds of a
    ``max_chars`` text cap."""

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.max_chars = max_chars
    env.filters["tojson"] = _tojson
    for name, check in checks.FILTER_CHECKS.items():
        env.filters[name] = _checked_filter(env.filters[name], check, max_chars)
    env.filters[LOOP_ITEMS] = _loop_items
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace
    lipsum = env.globals["lipsum"]
    env.globals["lipsum"] = lambda *a, **k: (checks.check_lipsum(max_chars, *a, **k), lipsum(*a, **k))[1]
    return env


def _checked_filter(filter_: Any, check: Any, max_chars: int) -> Any:
    """``filter_`` with ``check`` run on its arguments (by name) first and its text result capped."""
    import inspect

    passed = getattr(filter_, "jinja_pass_arg", None)
    params = list(inspect.signature(filter_).parameters.values())
    if passed is not None and params and params[0].name in ("context", "eval_ctx", "environment"):
        params = params[1:]
    signature = inspect.Signature(params)

    def checked(*args: Any, **kwargs: Any) -> Any:
        head, values = (args[:1], args[1:]) if passed is not None else ((), args)
        try:
            bound = signature.bind(*values, **kwargs)
        except TypeError:
            return filter_(*args, **kwargs)  # its own error
        bound.apply_defaults()
        check(max_chars, bound.arguments)
        result = filter_(*head, *bound.args, **bound.kwargs)
        if isinstance(result, str):
            limits.refuse_over(len(result), max_chars, "a filter")
        return result

    if passed is not None:
        checked.jinja_pass_arg = passed  # type: ignore[attr-defined]
    return checked


class _TemplateDict:
    """``dict(...)`` in a template: a plain dict, nothing else of the type reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _namespace(*args: Any, **kwargs: Any) -> Any:
    """Jinja's namespace, refusing attribute names that begin with an underscore."""

    class Checked(Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            _check_attr(name)
            super().__setitem__(name, value)

    ns = Checked(*args, **kwargs)
    for name in dict(*args, **kwargs):
        _check_attr(name)
    return ns


def _check_attr(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not store {name!r} on a namespace (names must not begin with _)")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson filter: JSON with the keys in their order, non-ASCII and <>&' as they
    are (Jinja's own sorts keys and escapes them for HTML)."""
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: Any) -> None:
    raise TemplateError(f"chat template: {_line(str(message))}", own=True)
