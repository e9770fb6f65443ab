"""The build matrix file (TOML): recipes with a parameter grid, targets, the remote and the
fleet's toolchain lock. Every combination of a recipe's grid and targets is one cell.

Parsing needs Python 3.11's ``tomllib`` (or the ``tomli`` package on 3.10). Nothing here
imports torch: recipes are imported and called only by the planner and the cell step.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BuildError

__all__ = ["MATRIX_FORMAT", "MAX_CELLS", "Cell", "Matrix", "load_lock", "load_matrix", "parse_matrix"]

#: The matrix file's format version (the ``format`` member).
MATRIX_FORMAT = 1

#: Most cells a matrix may describe unless its ``max_cells`` says otherwise: a grid is a
#: product, so a few hundred bytes can describe 10**10 cells; they are counted before
#: any is made and a larger matrix is refused (``build.matrix_too_large``).
MAX_CELLS = 10_000

_TARGET = re.compile(r"cpu|cpu-[a-z0-9_.-]+|sm_[0-9]+a?")
_CALLABLE = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_TOP = {"format", "remote", "toolchain", "targets", "store", "max_cells", "recipes", "local", "ray", "k8s"}
_RECIPE = {"name", "callable", "targets", "grid", "params", "variants"}
#: The graph variants a recipe may list (``variants = ["default", "shim-v1"]``; docs/keys.md).
_VARIANTS = ("default", "shim-v1")
_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class Cell:
    """One cell: a recipe called with one combination of its grid, for one target."""

    index: int
    recipe: str
    callable: str
    target: str
    params: dict[str, Any]
    #: The graph variant minted: ``default`` or ``shim-v1`` (the libtorch-free variant).
    variant: str = "default"

    @property
    def name(self) -> str:
        """``recipe[k=v,...]@target``, with ``+variant`` for a variant other than the
        default; unique in its matrix."""
        inner = ",".join(f"{k}={json.dumps(v)}" for k, v in self.params.items())
        suffix = "" if self.variant == "default" else f"+{self.variant}"
        return f"{self.recipe}[{inner}]@{self.target}{suffix}"

    @property
    def gpu(self) -> bool:
        """Whether the cell needs a GPU (an ``sm_NN`` target)."""
        return self.target.startswith("sm_")

    @property
    def machine(self) -> str:
        """The kind of machine the cell needs: ``cpu``, ``cpu-<level>`` or ``gpu sm_NN``."""
        return f"gpu {self.target}" if self.gpu else self.target


@dataclass(frozen=True)
class Matrix:
    """A parsed matrix file: its cells, the lock and the executors' sections."""

    path: Path
    text: str
    remote: str | None
    toolchain_path: Path
    store: str | None
    cells: tuple[Cell, ...]
    local: dict[str, Any] = field(default_factory=dict)
    ray: dict[str, Any] = field(default_factory=dict)
    k8s: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """SHA-256 of the file's bytes (16 hex): names the Jobs the k8s executor renders."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:16]

    def cell(self, index: int) -> Cell:
        """The cell at ``index`` (``build.index_out_of_range`` outside the matrix)."""
        if not 0 <= index < len(self.cells):
            raise BuildError(
                f"cell index {index} is outside the matrix ({len(self.cells)} cells, 0 to {len(self.cells) - 1})",
                "build.index_out_of_range",
            )
        return self.cells[index]

    def lock(self) -> dict[str, str]:
        """The toolchain lock's block."""
        return load_lock(self.toolchain_path)


def _invalid(path: Path, message: str) -> BuildError:
    return BuildError(f"{path}: {message}", "build.matrix_invalid")


def _toml_module() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # Python 3.10
        import tomli  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError as exc:
        raise BuildError(
            "reading a build matrix needs Python 3.11 (tomllib) or the tomli package", "build.matrix_invalid"
        ) from exc
    return tomli


def _toml(text: str, path: Path) -> dict[str, Any]:
    toml = _toml_module()
    try:
        data: dict[str, Any] = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise _invalid(path, f"not valid TOML: {exc}") from exc
    return data


def _targets(value: object, path: Path, where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _invalid(path, f"{where} must be a non-empty list of targets ('cpu', 'cpu-<level>', 'sm_NN')")
    out: list[str] = []
    for t in value:
        if not isinstance(t, str) or not _TARGET.fullmatch(t):
            raise _invalid(path, f"{where}: {t!r} is not a target ('cpu', 'cpu-<level>', 'sm_NN' or 'sm_NNa')")
        if t in out:
            raise _invalid(path, f"{where}: target {t!r} is listed twice")
        out.append(t)
    return out


def _variants(value: object, path: Path, where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _invalid(path, f"{where} must be a non-empty list of variants ({', '.join(map(repr, _VARIANTS))})")
    out: list[str] = []
    for v in value:
        if not isinstance(v, str) or v not in _VARIANTS:
            raise _invalid(path, f"{where}: {v!r} is not a variant ({', '.join(map(repr, _VARIANTS))})")
        if v in out:
            raise _invalid(path, f"{where}: variant {v!r} is listed twice")
        out.append(v)
    return out


def _table(value: object, path: Path, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(path, f"[{where}] must be a table")
    return dict(value)


def _max_cells(value: object, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid(path, f"max_cells must be an integer >= 1, got {value!r}")
    return value


def _kind(value: object) -> str:
    """A TOML value's kind, as a message names it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__  # dates and times


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _is_str_table(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")

#: Every executor setting with what it must be: (check, what the message says it must be).
#: Checked at parse time so that a wrong type is ``build.matrix_invalid`` naming the field,
#: never a traceback in an executor.
_SECTIONS: dict[str, dict[str, tuple[Any, str]]] = {
    "local": {
        "parallelism": (lambda v: _is_int(v, 1), "an integer >= 1"),
        "retries": (lambda v: _is_int(v, 0), "an integer >= 0"),
    },
    "ray": {
        "address": (_is_str, "a non-empty string"),
        "num_cpus": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
            "a number > 0",
        ),
        "retries": (lambda v: _is_int(v, 0), "an integer >= 0"),
        "accelerator_types": (_is_str_table, "a table of target = accelerator type strings"),
    },
    "k8s": {
        "image": (_is_str, "a non-empty string"),
        "namespace": (
            lambda v: isinstance(v, str) and _DNS_LABEL.fullmatch(v) is not None,
            "a Kubernetes namespace name (lowercase letters, digits and '-', at most 63)",
        ),
        "name": (_is_str, "a non-empty string"),
        "parallelism": (lambda v: _is_int(v, 1), "an integer >= 1"),
        "backoff_limit_per_index": (lambda v: _is_int(v, 0), "an integer >= 0"),
        "service_account": (_is_str, "a non-empty string"),
        "env": (_is_str_table, 'a table of NAME = "value" strings'),
        "env_from_secrets": (
            lambda v: isinstance(v, list) and all(_is_str(x) for x in v),
            "an array of secret names (strings)",
        ),
        "cpu": (_is_str, 'a string quantity such as "4" or "500m"'),
        "memory": (_is_str, 'a string quantity such as "16Gi"'),
        "node_selectors": (
            lambda v: isinstance(v, dict) and all(_is_str_table(t) for t in v.values()),
            'a table of target = { label = "value" } tables',
        ),
        "python": (_is_str, "a non-empty string"),
    },
}


def _section(value: object, path: Path, section: str) -> dict[str, Any]:
    table = _table(value, path, section)
    allowed = _SECTIONS[section]
    extra = sorted(set(table) - set(allowed))
    if extra:
        raise _invalid(path, f"[{section}]: unknown member(s) {', '.join(extra)} (known: {', '.join(sorted(allowed))})")
    for member, item in table.items():
        check, wanted = allowed[member]
        if not check(item):
            raise _invalid(path, f"[{section}] {member} must be {wanted}, got {_kind(item)} ({item!r})")
    return table


def parse_matrix(text: str, path: str | os.PathLike[str]) -> Matrix:
    """Parse and validate a matrix's text; ``path`` anchors the relative paths in it."""
    where = Path(path).absolute()
    data = _toml(text, where)
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise _invalid(where, f"unknown member(s) {', '.join(unknown)} (known: {', '.join(sorted(_TOP))})")
    if data.get("format", MATRIX_FORMAT) != MATRIX_FORMAT:
        raise _invalid(where, f"format {data.get('format')!r} is not supported (this version reads {MATRIX_FORMAT})")
    remote = data.get("remote")
    if remote is not None and (not isinstance(remote, str) or not remote.strip()):
        raise _invalid(where, "remote must be a non-empty URL string (s3://bucket/prefix)")
    if remote is None:
        remote = os.environ.get("TORCH_COMPILED_GRAPHS_REMOTE", "").strip() or None
    lock = data.get("toolchain")
    if not isinstance(lock, str) or not lock:
        raise _invalid(where, "toolchain must name the lock file (torch-compiled-graphs toolchain record > FILE)")
    store = data.get("store")
    if store is not None and (not isinstance(store, str) or not store):
        raise _invalid(where, "store must be a directory path")
    default_targets = _targets(data["targets"], where, "targets") if "targets" in data else None
    recipes = data.get("recipes")
    if not isinstance(recipes, list) or not recipes:
        raise _invalid(where, "no [[recipes]]: a matrix needs at least one recipe")
    names: set[str] = set()
    expansions: list[tuple[str, str, list[str], dict[str, Any], dict[str, list[Any]], list[str]]] = []
    count = 0
    for i, recipe in enumerate(recipes):
        label = f"recipes[{i}]"
        if not isinstance(recipe, dict):
            raise _invalid(where, f"{label} must be a table")
        extra = sorted(set(recipe) - _RECIPE)
        if extra:
            raise _invalid(
                where, f"{label}: unknown member(s) {', '.join(extra)} (known: {', '.join(sorted(_RECIPE))})"
            )
        target_fn = recipe.get("callable")
        if not isinstance(target_fn, str) or not _CALLABLE.fullmatch(target_fn):
            raise _invalid(where, f"{label}: callable must be 'module:function', got {target_fn!r}")
        name = recipe.get("name", target_fn.rpartition(":")[2])
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid(where, f"{label}: name {name!r} must be letters, digits, '_', '.' or '-'")
        if name in names:
            raise _invalid(where, f"{label}: recipe name {name!r} is used twice")
        names.add(name)
        if "targets" in recipe:
            targets = _targets(recipe["targets"], where, f"{label}.targets")
        elif default_targets is not None:
            targets = default_targets
        else:
            raise _invalid(where, f"{label} has no targets and the matrix states no default targets")
        grid = _table(recipe.get("grid"), where, f"{label}.grid")
        params = _table(recipe.get("params"), where, f"{label}.params")
        for k, values in grid.items():
            if not isinstance(values, list) or not values:
                raise _invalid(where, f"{label}.grid.{k} must be a non-empty list of values")
            for v in values:
                if not isinstance(v, _SCALARS):
                    raise _invalid(where, f"{label}.grid.{k}: {v!r} is not a string, number or boolean")
            if len({json.dumps(v) for v in values}) != len(values):
                raise _invalid(where, f"{label}.grid.{k} lists a value twice")
        for k in params:
            if k in grid:
                raise _invalid(where, f"{label}: {k!r} is both a grid parameter and a fixed parameter")
        if "target" in grid or "target" in params:
            raise _invalid(where, f"{label}: 'target' is the cell's target, not a parameter")
        variants = _variants(recipe.get("variants", ["default"]), where, f"{label}.variants")
        # Counted from the axis lengths (Python ints: no overflow), before anything is made.
        count += math.prod(len(values) for values in grid.values()) * len(targets) * len(variants)
        expansions.append((name, target_fn, targets, params, grid, variants))
    sections = {section: _section(data.get(section), where, section) for section in _SECTIONS}
    cap = _max_cells(data.get("max_cells", MAX_CELLS), where)
    if count > cap:
        raise BuildError(
            f"{where}: the matrix describes {count} cells, more than the cap of {cap} "
            "(raise it with max_cells = N at the top of the matrix if that many are meant)",
            "build.matrix_too_large",
        )
    cells: list[Cell] = []
    for name, target_fn, targets, params, grid, variants in expansions:
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            for target in targets:
                for variant in variants:
                    cells.append(
                        Cell(
                            len(cells),
                            name,
                            target_fn,
                            target,
                            {**params, **dict(zip(keys, combo, strict=True))},
                            variant,
                        )
                    )
    return Matrix(
        where,
        text,
        remote,
        (where.parent / lock).absolute(),
        None if store is None else str((where.parent / store).absolute()),
        tuple(cells),
        sections["local"],
        sections["ray"],
        sections["k8s"],
    )


def load_matrix(path: str | os.PathLike[str], *, toolchain: str | os.PathLike[str] | None = None) -> Matrix:
    """Read and parse the matrix file at ``path``; ``toolchain`` overrides its lock path."""
    where = Path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(f"cannot read the build matrix {where}: {exc}", "build.matrix_invalid") from exc
    matrix = parse_matrix(text, where)
    if toolchain is not None:
        import dataclasses

        matrix = dataclasses.replace(matrix, toolchain_path=Path(toolchain).absolute())
    return matrix


def load_lock(path: str | os.PathLike[str]) -> dict[str, str]:
    """The toolchain block in a lock file (the JSON ``toolchain record`` prints), validated."""
    from .. import _native
    from ..errors import CompiledGraphError

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BuildError(f"cannot read the toolchain lock {path}: {exc}", "build.lock_invalid") from exc
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise BuildError(f"toolchain lock {path} must be a JSON object of strings", "build.lock_invalid")
    block = dict(raw)
    if "torch" not in block:
        raise BuildError(
            f"toolchain lock {path} has no torch member: write it with `torch-compiled-graphs toolchain record`",
            "build.lock_invalid",
        )
    try:
        _native.toolchain_axis(block)
    except CompiledGraphError as exc:
        raise BuildError(f"toolchain lock {path} is not a toolchain block: {exc}", "build.lock_invalid") from exc
    return block
