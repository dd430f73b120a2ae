"""Chat templates rendered as transformers' apply_chat_template renders them.

A template is untrusted code from a model file, so it runs in jinja2's immutable sandbox, with what
transformers gives templates: trim_blocks/lstrip_blocks, loop controls, the `{% generation %}` block,
raise_exception, strftime_now and a tojson that takes json.dumps's arguments and escapes no HTML.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jitllm.core.errors import JitllmError

# What a template's own Python code can raise while rendering (a loop over a missing list, ...).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError)


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


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise JitllmError(f"chat template does not compile: {_one_line(e)}") from None


def render_template(template: jinja2.Template, **variables: Any) -> str:
    """The rendered text; whatever the template raises becomes one JitllmError line."""
    try:
        return template.render(**variables)
    except jinja2.TemplateError as e:
        raise JitllmError(f"chat template: {_one_line(e)}") from None
    except _RENDER_ERRORS as e:
        raise JitllmError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
