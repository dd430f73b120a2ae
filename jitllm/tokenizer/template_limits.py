"""Bounds on what a chat template (code from a model file) may spend: time, and the size of the values and
the text it makes.

jinja2's sandbox keeps a template from reaching Python's internals, not from looping or allocating without
end. Here every line the template's code runs checks a deadline (a trace function while it renders), every
value a function returns and the text it writes are measured, and the operations that can make a large value
out of small ones in one step (`*`, `**`, `%`, str.format widths, int arguments such as center's width, and
two large operands of one call, as replace and join take) are refused before they run.
"""

from __future__ import annotations

import re
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

MAX_SECONDS = 2.0
"""Wall-clock time a template may take to compile and render."""
MAX_SIZE = 4 << 20
"""Characters (or items) of the text a template writes and of any value it makes on the way: 4 Mi, more than
any context holds as text."""
MAX_PRODUCT = 16 * MAX_SIZE
"""Of one call's two largest text or list arguments, the product at most (a replace or join makes up to that)."""
MAX_INT_BITS = 1 << 16
"""Bits of an integer a template may make with * or **."""

_DIGITS = re.compile(r"\d+")
_TEMPLATE_CODE = "<template>"
"""The file name of the Python code jinja2 compiles a template from a string into."""


class TemplateLimit(BaseException):
    """A template went past a bound. A BaseException, so that no `except Exception` in the code the template
    runs through can swallow it; the renderer turns it into a JitllmError."""


def size(value: Any) -> int:
    """Characters of a text; items of a list, tuple or dict, with the characters of the texts a list holds."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(item) for item in value if isinstance(item, str))
    if isinstance(value, dict):
        return len(value)
    return 0


def check_size(value: Any, what: str = "a value") -> None:
    if size(value) > MAX_SIZE:
        raise TemplateLimit(f"makes {what} of more than {MAX_SIZE} characters")


def check_arguments(name: str, args: tuple, kwargs: dict) -> None:
    """Before a call or filter runs: no integer argument (a width, a count) above MAX_SIZE, and its two
    largest text or list arguments no larger than MAX_PRODUCT together."""
    values = [*args, *kwargs.values()]
    if any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_SIZE for v in values):
        raise TemplateLimit(f"calls {name} with a number larger than {MAX_SIZE}")
    sizes = sorted((size(v) for v in values), reverse=True)[:2]
    if len(sizes) == 2 and sizes[0] * sizes[1] > MAX_PRODUCT:
        raise TemplateLimit(f"calls {name} on operands too large together ({sizes[0]} and {sizes[1]})")


def check_format(text: str) -> None:
    """A format string (for %, str.format or the format filter) whose widths and precisions are bounded."""
    if any(int(m.group()) > MAX_SIZE for m in _DIGITS.finditer(text)):
        raise TemplateLimit(f"formats with a width larger than {MAX_SIZE}")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Before `*`, `**` or `%` runs: the size of the product, the bits of the power, the format's widths."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and isinstance(seq, (str, list, tuple)) and len(seq) * n > MAX_SIZE:
                raise TemplateLimit(f"repeats a value to more than {MAX_SIZE} characters")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"makes an integer of more than {MAX_INT_BITS} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * left.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"makes an integer of more than {MAX_INT_BITS} bits")
    elif operator == "%" and isinstance(left, str):
        check_format(left)


class Budget:
    """The deadline of one compile or render, checked on every line of Python it runs (sys.settrace)."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + MAX_SECONDS

    def _trace(self, frame, event: str, arg: Any):
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"runs for more than {MAX_SECONDS:g} s")
        if event == "call" and frame.f_code.co_filename != _TEMPLATE_CODE:
            frame.f_trace_lines = False  # (jinja2's and Python's own functions: their calls and returns suffice)
        elif event == "return":
            check_size(arg)
        return self._trace

    @contextmanager
    def running(self) -> Iterator[None]:
        previous = sys.gettrace()
        sys.settrace(self._trace)
        try:
            yield
        finally:
            sys.settrace(previous)
