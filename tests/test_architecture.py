"""The import rules of docs/architecture.md, checked on every import statement of the package (the ones
inside functions too: the code imports lazily in many places)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jitllm"

PARTS = {
    "core": "jitllm.core",
    "ir": "jitllm.ir",
    "lowering": "jitllm.lowering",
    "runtime": "jitllm.runtime",
    "tokenizer": "jitllm.tokenizer",
    "convert": "jitllm.convert",
    "api": ("jitllm.model", "jitllm.checked_model", "jitllm.chat", "jitllm.speed", "jitllm.batch_bench", "jitllm.verify",
            "jitllm.random_model", "jitllm.default_model", "jitllm.perplexity"),
    "server": "jitllm.server",
    "cli": ("jitllm.cli", "jitllm.cli_commands", "jitllm.commands", "jitllm.__main__"),
}

MAY_IMPORT = {
    "core": {"core"},
    "ir": {"core", "ir"},
    "lowering": {"core", "ir", "lowering"},
    "runtime": {"core", "ir", "lowering", "runtime"},
    "tokenizer": {"core", "tokenizer"},
    "convert": {"core", "ir", "tokenizer", "convert"},
    "api": {"core", "ir", "lowering", "runtime", "tokenizer", "convert", "api"},
    "server": set(PARTS) - {"cli"},
    "cli": set(PARTS),
}
"""What each part may import: IR knows no compiler or device, lowering no live state, the runtime no CLI or
server, the server (jitllmd's HTTP API) everything but the CLI, which alone imports it; the core imports
nothing else of jitllm. The bare package `jitllm` (its version) is open to all."""


def part_of(module: str) -> str | None:
    for part, prefixes in PARTS.items():
        for prefix in (prefixes,) if isinstance(prefixes, str) else prefixes:
            if module == prefix or module.startswith(prefix + "."):
                return part
    return None


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every jitllm import in the file, relative ones resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "jitllm":  # `from jitllm import x`: x may be a module of its own
                found += [(node.lineno, f"jitllm.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, m) for line, m in found if m == "jitllm" or m.startswith("jitllm.")]


def test_every_module_belongs_to_a_part():
    orphans = [module_name(p) for p in PACKAGE.rglob("*.py")
               if module_name(p) != "jitllm" and part_of(module_name(p)) is None]
    assert orphans == []


def test_imports_follow_the_rules():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = part_of(module_name(path))
        if own is None:
            continue
        for line, module in imported_modules(path):
            target = part_of(module)
            if module != "jitllm" and (target is None or target not in MAY_IMPORT[own]):
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {own} imports {module} ({target})")
    assert broken == []


@pytest.mark.parametrize("source, expected", [
    ("import jitllm.runtime.engine.executor\n", [(1, "jitllm.runtime.engine.executor")]),
    ("def f():\n    from jitllm.lowering import cache\n", [(2, "jitllm.lowering")]),
    ("from jitllm import model\n", [(1, "jitllm.model")]),
    ("from ..runtime import planner\n", [(1, "jitllm.runtime")]),
])
def test_the_checker_sees_lazy_and_relative_imports(tmp_path, source, expected):
    """The checker itself: imports inside functions, `from jitllm import x` and relative imports count."""
    probe = tmp_path / "jitllm" / "lowering" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    assert imported_modules(probe, tmp_path / "jitllm") == expected


def test_targets_are_asked_not_probed():
    """A target's abilities are read from its declared caps: no hasattr/getattr on a target and no test of
    its name outside its own file (lowering/targets/)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "targets":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and node.args and "target" in ast.unparse(node.args[0])):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Attribute) and side.attr == "name" and "target" in ast.unparse(side.value)
                    for side in (node.left, *node.comparators)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_compile_verb_lists_every_registered_target():
    from jitllm.commands.compile import TARGET_NAMES
    from jitllm.lowering.targets import TARGETS

    assert TARGET_NAMES == tuple(TARGETS)


def test_the_wtype_choices_are_every_weight_type():
    from jitllm.commands.common import WEIGHT_TYPES as CHOICES
    from jitllm.core.layouts import WEIGHT_TYPES

    assert CHOICES == WEIGHT_TYPES


def test_the_kv_cache_type_choices_are_every_kv_type():
    from jitllm.commands.common import KV_TYPES
    from jitllm.ir.config import KV_DTYPES

    assert KV_TYPES == tuple(KV_DTYPES)


def test_tvm_tensors_stay_inside_the_backends_that_use_tvm():
    """The runtime holds tensors as opaque values: only runtime/backends/ imports TVM."""
    found = []
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        if path.parent.name == "backends":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] in ("tvm", "tvm_ffi")]
    assert found == []


def test_block_kinds_are_asked_through_their_type():
    """Nothing compares a block kind's name: code asks its BlockType (jitllm.ir.blocks.block_type) what it
    carries and what it is."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(ast.unparse(side).endswith("kind.kind")
                                                     for side in (node.left, *node.comparators)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_speed_presets_name_registered_targets_and_backends():
    from jitllm.lowering.targets import TARGETS
    from jitllm.runtime.backends import BACKENDS
    from jitllm.speed import TARGET_PRESETS

    for preset in TARGET_PRESETS.values():
        assert preset.target in TARGETS and (preset.backend in BACKENDS or preset.backend == "host"), preset
