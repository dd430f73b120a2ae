"""A chat template is code from a model file: one that loops or allocates without end stops at its bounds
(time, the size of what it makes) with one JitllmError line, at compile time or while rendering, and the
CLI says so in one line. (Without the bounds, most of these run for hours or take gigabytes.)"""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner
from test_hardening_cli import assert_one_line_error, rewritten

from jitllm.cli import main
from jitllm.core.errors import JitllmError
from jitllm.tokenizer import template_limits
from jitllm.tokenizer.chat_template import compile_template, render_template

SECONDS = 0.3

HOSTILE = {
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "runs for more than 0.3 s"),
    "loops over a long text": ("{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                               "runs for more than 0.3 s"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "repetition": ("{{ 'x' * 10**10 }}", "repeats a value"),
    "a width": ("{{ 'x'|center(3000000000) }}", "with a number larger than"),
    "a method's width": ("{{ 'x'.ljust(3000000000) }}", "with a number larger than"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "makes a value of more than"),
    "a power": ("{{ 7 ** 100000000 }}", "integer of more than"),
    "squaring": ("{% set ns = namespace(v=3) %}{% for i in range(40) %}{% set ns.v = ns.v * ns.v %}{% endfor %}",
                 "integer of more than"),
    "a % width": ("{{ '%999999999s' % 'x' }}", "width larger than"),
    "a format width": ("{{ '{:>999999999}'.format('x') }}", "width larger than"),
    "the format filter": ("{{ '%999999999s'|format(m) }}", "width larger than"),
    "replace": ("{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}", "too large together"),
    "join": ("{% set s = 'x' * 4000000 %}{{ ([s] * 1000)|join }}", "makes a value of more than"),
    "output": ("{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}", "writes more than"),
}


@pytest.fixture(autouse=True)
def _short_deadline(monkeypatch):
    monkeypatch.setattr(template_limits, "MAX_SECONDS", SECONDS)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_template_past_its_bounds_stops_in_one_line(name):
    source, needle = HOSTILE[name]
    start = time.monotonic()
    with pytest.raises(JitllmError, match="chat template") as e:
        render_template(compile_template(source), messages=[], m="x")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - start < SECONDS + 2


def test_the_bounds_leave_a_long_conversation_alone():
    """A conversation of 4 MiB less a little renders whole (the real templates' tests render the rest)."""
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    messages = [{"role": "user", "content": "word " * 20_000}] * 40
    assert len(render_template(compile_template(chatml), messages=messages)) > 3_900_000


def test_the_cli_says_so_in_one_line(tiny_model, tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(cache_dir))
    looping = rewritten(tiny_model, tmp_path / "looping.jlm", lambda meta: meta.update(chat_template=HOSTILE[
        "nested ranges"][0]))
    result = CliRunner().invoke(main, ["run", "-devices", "cpu", "-chat", str(looping), "hi"])
    assert_one_line_error(result, "chat template stopped: it runs for more than 0.3 s")
