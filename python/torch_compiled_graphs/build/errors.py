"""The build farm's error class and its exit codes."""

from __future__ import annotations

from ..errors import CompiledGraphError

__all__ = ["EXIT_DETERMINISTIC", "EXIT_DONE", "EXIT_TRANSIENT", "EXIT_USAGE", "BuildError"]

#: ``build-cell``: the cell's key is present or was minted.
EXIT_DONE = 0
#: ``build-cell``: bad arguments or an unreadable matrix or lock (deterministic too: never retried).
EXIT_USAGE = 2
#: ``build-cell``: a deterministic failure (export, declaration, parity or compile error, a
#: toolchain or device refusal): retrying cannot help, executors never retry it.
EXIT_DETERMINISTIC = 3
#: ``build-cell``: a transient failure (remote unavailable, publication failed): executors retry
#: it, as they do a cell process killed by a signal (preempted, OOM-killed, lease lost).
EXIT_TRANSIENT = 75


class BuildError(CompiledGraphError, ValueError):
    """A build matrix, lock or cell request is invalid, or a cell was refused (``build.*``)."""
