"""The package's module layering, read from the source with ``ast`` (CPU only, imports nothing of the package).

The engine (``StoredCompiledGraph.load`` / ``load_native``) imports the load paths
lazily; the load paths sit above it and never import ``engine`` back at run time
(``StoredCompiledGraph`` is named in annotations only, under ``TYPE_CHECKING``). What
both load paths share lives in ``_loadpath`` (torch-free) and ``_torch_weights``,
below them, so the load paths import one another in one direction only.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "torch_compiled_graphs"

#: The modules of the two load paths and what they share.
LOAD_PATHS = (
    "runner",
    "native",
    "_native_loader",
    "dropin",
    "capture",
    "binding",
    "weights_set",
    "lora",
    "_loadpath",
    "_torch_weights",
)


class Import(NamedTuple):
    """One import statement's target: a module of the package (``engine``) or an
    outside top-level package (``torch``)."""

    target: str
    internal: bool
    type_checking: bool
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _modules() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}


def imports_of(source: str, modules: set[str]) -> list[Import]:
    """Every import in ``source`` (module level and inside functions), with whether it
    sits under ``if TYPE_CHECKING:`` (its ``else:`` branch runs)."""
    out: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch_compiled_graphs" and len(parts) > 1:
                    out.append(Import(parts[1], True, type_checking, node.lineno))
                else:
                    out.append(Import(parts[0], parts[0] == "torch_compiled_graphs", type_checking, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.split(".")[0] != "torch_compiled_graphs":
                out.append(Import(module.split(".")[0], False, type_checking, node.lineno))
            else:
                # `from .x import y`, `from torch_compiled_graphs.x import y`, `from . import x`
                inner = module.split(".")[1:] if node.level == 0 else module.split(".") if module else []
                if inner and inner[0]:
                    out.append(Import(inner[0], True, type_checking, node.lineno))
                else:
                    for alias in node.names:
                        if alias.name in modules:
                            out.append(Import(alias.name, True, type_checking, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(ast.parse(source), False)
    return out


def runtime_imports(name: str) -> list[Import]:
    source = (PACKAGE / f"{name}.py").read_text(encoding="utf-8")
    return [i for i in imports_of(source, _modules()) if not i.type_checking]


def test_the_load_path_modules_exist() -> None:
    # A renamed or removed module would make the checks below vacuous.
    missing = [name for name in LOAD_PATHS if not (PACKAGE / f"{name}.py").is_file()]
    assert not missing, missing


@pytest.mark.parametrize("name", LOAD_PATHS)
def test_no_load_path_imports_the_engine_at_run_time(name: str) -> None:
    back = [i.line for i in runtime_imports(name) if i.internal and i.target == "engine"]
    assert not back, f"{name}.py imports engine outside `if TYPE_CHECKING:` at line(s) {back}"


def test_loadpath_imports_no_torch_and_only_torch_free_modules_of_the_package() -> None:
    found = imports_of((PACKAGE / "_loadpath.py").read_text(encoding="utf-8"), _modules())
    torch = [i.line for i in found if not i.internal and i.target in ("torch", "safetensors", "numpy")]
    assert not torch, f"_loadpath.py imports torch (or a tensor library) at line(s) {torch}"
    internal = {i.target for i in found if i.internal and not i.type_checking}
    assert internal <= {"errors", "outputs", "_native"}, internal


def test_the_load_paths_import_one_another_without_a_cycle() -> None:
    """Function-level imports count: a lazy import back is still a circle of modules."""
    graph = {
        name: sorted({i.target for i in runtime_imports(name) if i.internal and i.target in LOAD_PATHS} - {name})
        for name in LOAD_PATHS
    }
    done: set[str] = set()

    def walk(name: str, path: list[str]) -> None:
        if name in path:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise AssertionError(f"the load paths import one another in a circle: {cycle}")
        if name in done:
            return
        for target in graph[name]:
            walk(target, [*path, name])
        done.add(name)

    for name in LOAD_PATHS:
        walk(name, [])


def test_the_checker_sees_imports_in_every_place_they_can_hide() -> None:
    modules = {"engine", "runner", "errors"}
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from .errors import BindingError
if TYPE_CHECKING:
    from .engine import StoredCompiledGraph
else:
    from . import engine
import torch_compiled_graphs.engine
def f():
    from .engine import Engine
    import torch.utils
class C:
    def g(self):
        if typing.TYPE_CHECKING:
            from torch_compiled_graphs import runner
        from torch_compiled_graphs.engine import x
"""
    found = imports_of(source, modules)
    runtime_engine = sorted(i.line for i in found if i.internal and i.target == "engine" and not i.type_checking)
    assert runtime_engine == [9, 10, 12, 18]
    assert [(i.target, i.line) for i in found if i.type_checking] == [("engine", 7), ("runner", 17)]
    assert ("torch", False, False, 13) in found and ("errors", True, False, 5) in found
    assert ("os", False, False, 3) in found
