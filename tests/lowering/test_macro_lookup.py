"""The macro lookup that replaces TVM's stack walk finds the same parser, so kernels parse to the same TIR."""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.script.parser.core.parser import ScriptMacro

import jitllm.lowering.kernels  # noqa: F401  (installs the lookup)
from jitllm.lowering.kernels import macro_lookup


def _kernel_with_macros():
    @T.macro
    def scaled(y, x, i, s):
        y[i] = x[i] * s

    @T.macro
    def twice(y, x, i):
        scaled(y, x, i, T.float32(2))  # a macro inside a macro: the lookup runs from deeper frames

    @T.prim_func
    def kernel(x: T.Buffer((16,), "float32"), y: T.Buffer((16,), "float32")):
        for i in range(16):
            twice(y, x, i)

    return kernel.script()


def _deep(depth: int, fn):
    return fn() if depth == 0 else _deep(depth - 1, fn)


def test_importing_the_kernels_installs_the_lookup():
    assert ScriptMacro._find_parser_def is macro_lookup._find_parser_def


def test_the_lookup_parses_macros_as_tvms_own_walk_does(monkeypatch):
    ours = _deep(50, _kernel_with_macros)
    monkeypatch.setattr(ScriptMacro, "_find_parser_def", macro_lookup.TVM_FIND_PARSER_DEF)
    theirs = _deep(50, _kernel_with_macros)
    assert ours == theirs and "x[i] * T.float32(2.0)" in ours


def test_a_macro_called_outside_a_parse_is_still_refused():
    try:
        macro_lookup._find_parser_def(None)
    except RuntimeError as e:
        assert "__current_script_parser__ not available" in str(e)
    else:
        raise AssertionError("a lookup outside a parse found a parser")
