"""Every lowering module a target's artifacts are generated from is in its cache key's sources: a kernel
module imported from a target's sources (directly or through another) but not listed would let an edit to
it reuse stale artifacts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jitllm.lowering.cache import FORMAT_SOURCES
from jitllm.lowering.targets import TARGETS

ROOT = Path(__import__("jitllm.lowering", fromlist=["x"]).__file__).parent
EXEMPT = {"kernels/macro_lookup.py"}
"""Finds TVMScript's parser for a macro call: it changes no generated code."""


def lowering_imports(path: Path) -> set[str]:
    """Files under lowering/ that `path` imports (relative to lowering/)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("jitllm.lowering."):
                rel = Path(*name.split(".")[2:])
                for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
                    if (ROOT / candidate).is_file():
                        found.add(candidate.as_posix())
    return found


def covered(file: str, sources: tuple[str, ...]) -> bool:
    return any(file == s or file.startswith(s.rstrip("/") + "/") for s in sources)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_targets_key_covers_every_kernel_module_it_reaches(name):
    target = TARGETS[name]
    sources = tuple(target.sources) + FORMAT_SOURCES[target.caps.artifact]
    todo = [p.relative_to(ROOT).as_posix() for s in target.sources for p in
            ((ROOT / s).rglob("*.py") if (ROOT / s).is_dir() else [ROOT / s])]
    seen: set[str] = set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        todo += [f for f in lowering_imports(ROOT / file) if f.startswith("kernels/")]
    missing = sorted(f for f in seen if not covered(f, sources) and f not in EXEMPT
                     and not f.endswith("__init__.py"))
    assert not missing, f"{name}: its cache key leaves out {missing}"
