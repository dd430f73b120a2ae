"""A faster lookup of the TVMScript parser from inside a macro call (TVM 0.27).

Every `T.macro` call made while a `T.prim_func` is parsed finds the running parser by walking the call
stack for a frame whose globals hold it. TVM walks it with `inspect.getouterframes`, which also reads a
line of source for every frame and resolves each frame's module through `inspect.getmodule` -- a scan of
`sys.modules` for frames of evaluated code. Its cost grows with the stack's depth and the number of
modules loaded: under pytest (deep stacks, torch and transformers imported) it took 54 of a CUDA kernel
test's 70 s (cProfile; the slowest of those tests took 143 s in a full run, 6 s with this lookup); from
the CLI's shallow stack a compile takes the same time either way. Walking the frames' `f_back` links visits
the same frames in the same order and reads only their globals: the parser found, and so the TIR built,
is the same (the generated CUDA of 128 kinds and the TIR of 120 CPU kernels are byte-identical)."""

from __future__ import annotations

import sys

from tvm.script.parser.core.parser import ScriptMacro

TVM_FIND_PARSER_DEF = ScriptMacro._find_parser_def
"""TVM's own lookup (the tests compare the two)."""


def _find_parser_def(self: ScriptMacro):
    frame = sys._getframe(0)
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def install() -> None:
    """Replace TVM's stack walk for every macro (those already defined included: it is a method)."""
    ScriptMacro._find_parser_def = _find_parser_def
