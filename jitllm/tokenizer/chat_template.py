"""Chat templates rendered as transformers' apply_chat_template renders them.

A template is untrusted code from a model file, so it runs in jinja2's immutable sandbox, with what
transformers gives templates: trim_blocks/lstrip_blocks, loop controls, the `{% generation %}` block,
raise_exception, strftime_now and a tojson that takes json.dumps's arguments and escapes no HTML; and within
the bounds of template_limits (time, the size of what it makes), as the sandbox sets none.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jitllm.core.errors import JitllmError

from .template_limits import MAX_SIZE, Budget, TemplateLimit, check_arguments, check_binop, check_format

# What a template's own Python code can raise while rendering (a loop over a missing list, ...).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                  RecursionError, MemoryError)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; a render
    keeps the text as it is."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the operations that make large values in one step checked first."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's signature)
        check_arguments("a function", args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            check_format(obj)
        return super().getattr(obj, attribute)


def _bounded_filter(name: str, func: Callable) -> Callable:
    """A filter whose arguments are checked before it runs (wraps keeps jinja2's pass_context marks)."""

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        check_arguments(f"the {name} filter", args, kwargs)
        if name == "format" and args and isinstance(args[0], str):
            check_format(args[0])
        return func(*args, **kwargs)

    return bounded


def compile_template(source: str) -> jinja2.Template:
    # (optimized=False: the optimizer folds constant expressions at compile time, outside the render's checks)
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock],
                          optimized=False)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, func) for name, func in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        with Budget().running():
            return env.from_string(source)
    except jinja2.TemplateError as e:
        raise JitllmError(f"chat template does not compile: {_one_line(e)}") from None
    except TemplateLimit as e:
        raise JitllmError(f"chat template does not compile: it {e}") from None


def render_template(template: jinja2.Template, **variables: Any) -> str:
    """The rendered text; whatever the template raises, and a template past its bounds, becomes one
    JitllmError line."""
    pieces: list[str] = []
    written = 0
    try:
        with Budget().running():
            for piece in template.generate(**variables):
                written += len(piece)
                if written > MAX_SIZE:
                    raise TemplateLimit(f"writes more than {MAX_SIZE} characters")
                pieces.append(piece)
    except TemplateLimit as e:
        raise JitllmError(f"chat template stopped: it {e}") from None
    except jinja2.TemplateError as e:
        raise JitllmError(f"chat template: {_one_line(e)}") from None
    except _RENDER_ERRORS as e:
        raise JitllmError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
    return "".join(pieces)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
