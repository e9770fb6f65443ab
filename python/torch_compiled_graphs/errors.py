"""The error hierarchy of torch-compiled-graphs (SPEC-v1 §12).

Every error carries a stable ``code`` such as ``artifact.truncated_gzip``.
Messages are for people; codes are for programs. The native core raises these
classes through one exhaustive mapping; I/O failures are plain ``OSError``
subclasses chosen by errno, with ``code`` set as well.
"""

from __future__ import annotations

__all__ = [
    "AdmissionError",
    "ArtifactError",
    "BindingError",
    "CompileError",
    "CompiledGraphError",
    "DeclarationError",
    "IdentityError",
    "QuarantinedArtifact",
    "StorageError",
    "TrustError",
]


class CompiledGraphError(Exception):
    """Mixin base of every torch-compiled-graphs error; carries ``code``."""

    code: str

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (str(self), self.code))


class IdentityError(CompiledGraphError, ValueError):
    """A key or axis is invalid (``identity.*``)."""


class DeclarationError(CompiledGraphError, ValueError):
    """A graph-class declaration or runtime request is invalid (``declaration.*``)."""


class ArtifactError(CompiledGraphError, ValueError):
    """An envelope, its metadata, package or literal payload is refused (``artifact.*``)."""


class CompileError(CompiledGraphError, RuntimeError):
    """The compile under the sole policy failed (``compile.*``)."""


class StorageError(CompiledGraphError, RuntimeError):
    """The store or the engine failed (``store.*``)."""


class QuarantinedArtifact(StorageError):
    """The stored record for a key exists but must not be served (``quarantine.*``)."""


class AdmissionError(StorageError):
    """A verified artifact may not run on this host or suit this request (``admission.*``)."""


class TrustError(AdmissionError):
    """The trust policy refused an artifact's signatures, or a trust file or signing key is unusable (``trust.*``)."""


class BindingError(CompiledGraphError, ValueError):
    """Weights do not fit a resolved graph, or a call does not fit its convention (``run.*``)."""
