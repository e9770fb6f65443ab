"""torch-compiled-graphs: compile PyTorch graphs once, reuse verified artifacts everywhere.

Importing this package never imports torch. Everything that derives a key or
checks bytes lives in the native core; the torch-dependent parts (declaring
graph classes from exported programs, compiling, running) import torch lazily.
"""

# No `from __future__ import annotations` here or in engine.py: that statement
# imports the `__future__` module at run time, a tenth of a millisecond on the
# hit path; engine.py quotes the annotations that name typing-only names.
from .engine import (
    Engine,
    EnsureOutcome,
    EnsureResult,
    StoredCompiledGraph,
    StoreOutcome,
    StoreResult,
)

# Only the engine is imported eagerly: the hit path (import, Engine.resolve)
# loads nothing else. Every other public name is imported on first use
# (PEP 562); the declaration, runtime and toolchain modules import torch lazily.
_LAZY = {
    "AdmissionError": "errors",
    "ArtifactError": "errors",
    "CompileError": "errors",
    "DeclarationError": "errors",
    "IdentityError": "errors",
    "QuarantinedArtifact": "errors",
    "StorageError": "errors",
    "TrustError": "errors",
    "COMPILED_GRAPH_FORMAT": "identity",
    "CompiledGraphKey": "identity",
    "GraphClassDeclaration": "identity",
    "is_compiled_graph_key": "identity",
    "LocalCAS": "store",
    "GraphClassSpec": "declaration",
    "RuntimeCompatibility": "runtime",
    "record_toolchain": "toolchain",
    "WeightsSet": "weights_set",
    "NativeWeightsSet": "native",
}

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .declaration import GraphClassSpec
    from .errors import (
        AdmissionError,
        ArtifactError,
        CompileError,
        DeclarationError,
        IdentityError,
        QuarantinedArtifact,
        StorageError,
        TrustError,
    )
    from .identity import COMPILED_GRAPH_FORMAT, CompiledGraphKey, GraphClassDeclaration, is_compiled_graph_key
    from .native import NativeWeightsSet
    from .runtime import RuntimeCompatibility
    from .store import LocalCAS
    from .toolchain import record_toolchain
    from .weights_set import WeightsSet


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "GraphClassSpec",
    "IdentityError",
    "LocalCAS",
    "NativeWeightsSet",
    "QuarantinedArtifact",
    "RuntimeCompatibility",
    "StorageError",
    "StoreOutcome",
    "StoreResult",
    "StoredCompiledGraph",
    "TrustError",
    "WeightsSet",
    "is_compiled_graph_key",
    "record_toolchain",
]
