"""torch-compiled-graphs: compile PyTorch graphs once, reuse verified artifacts everywhere.

Importing this package never imports torch. Everything that derives a key or
checks bytes lives in the native core; the torch-dependent parts (declaring
graph classes from exported programs, compiling, running) import torch lazily.
"""

from __future__ import annotations

from .engine import (
    Engine,
    EnsureOutcome,
    EnsureResult,
    StoredCompiledGraph,
    StoreOutcome,
    StoreResult,
)
from .errors import (
    AdmissionError,
    ArtifactError,
    CompileError,
    DeclarationError,
    IdentityError,
    QuarantinedArtifact,
    StorageError,
)
from .identity import (
    COMPILED_GRAPH_FORMAT,
    CompiledGraphKey,
    GraphClassDeclaration,
    is_compiled_graph_key,
)
from .store import LocalCAS

__all__ = [
    "COMPILED_GRAPH_FORMAT",
    "AdmissionError",
    "ArtifactError",
    "CompileError",
    "CompiledGraphKey",
    "DeclarationError",
    "Engine",
    "EnsureOutcome",
    "EnsureResult",
    "GraphClassDeclaration",
    "IdentityError",
    "LocalCAS",
    "QuarantinedArtifact",
    "StorageError",
    "StoreOutcome",
    "StoreResult",
    "StoredCompiledGraph",
    "is_compiled_graph_key",
]
