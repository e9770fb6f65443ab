"""The build farm: mint a whole matrix of graphs ahead of a rollout (docs/build.md).

A matrix file (TOML) lists recipes (``module:function`` returning a ``GraphClassSpec``),
their parameter grid, the targets, the remote and the fleet's toolchain lock. One
idempotent cell step (:func:`build_cell`, ``build-cell``) builds a cell; the ``local``,
``ray`` and ``k8s`` executors drive it. Importing this package imports neither torch, nor
ray, nor kubernetes.
"""

from __future__ import annotations

from .cell import CELL_ENV, CellResult, build_cell
from .errors import EXIT_DETERMINISTIC, EXIT_DONE, EXIT_TRANSIENT, EXIT_USAGE, BuildError
from .matrix import MATRIX_FORMAT, Cell, Matrix, load_lock, load_matrix, parse_matrix
from .run import CellRun, PlanRow, plan, run_local

__all__ = [
    "CELL_ENV",
    "EXIT_DETERMINISTIC",
    "EXIT_DONE",
    "EXIT_TRANSIENT",
    "EXIT_USAGE",
    "MATRIX_FORMAT",
    "BuildError",
    "Cell",
    "CellResult",
    "CellRun",
    "Matrix",
    "PlanRow",
    "build_cell",
    "load_lock",
    "load_matrix",
    "parse_matrix",
    "plan",
    "run_local",
]
