"""``LocalCAS``: the local content-addressed store, for tools and operators.

Objects are addressed by SHA-256 and written durably (temp, fsync, no-clobber
link, directory fsync); files are stored as chunked manifests; refs change
only by compare-and-swap. Every call releases the GIL while it does I/O.
The engine keeps compiled graphs under :data:`GRAPH_REF_PREFIX`.
"""

from __future__ import annotations

import os

from . import _native

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any


def _path(p: str | os.PathLike[str]) -> Path:
    from pathlib import Path

    return Path(p)


__all__ = ["GRAPH_REF_PREFIX", "MAX_CHUNK_BYTES", "QUARANTINE_REF_PREFIX", "LocalCAS"]

GRAPH_REF_PREFIX: str = _native.GRAPH_REF_PREFIX
QUARANTINE_REF_PREFIX: str = _native.QUARANTINE_REF_PREFIX
MAX_CHUNK_BYTES: int = _native.MAX_CHUNK_BYTES


class LocalCAS:
    """A store root (created on first use)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._native = _native.NativeStore(os.fspath(root))

    @property
    def root(self) -> Path:
        """The store root."""
        return _path(self._native.root)

    def ingest(self, path: str | os.PathLike[str], *, ref: str | None = None) -> dict[str, Any]:
        """Store a file; returns its ``manifest``, ``digest`` and ``size``.

        With ``ref``, that ref is pointed at the manifest so that GC keeps it;
        without one, the bytes are garbage once this call returns.
        """
        return dict(self._native.ingest_file(os.fspath(path), ref))

    def read_ref(self, name: str) -> dict[str, str] | None:
        """``{"kind", "target"}`` of a ref, or ``None``."""
        found = self._native.read_ref(name)
        return None if found is None else dict(found)

    def compare_and_swap(self, name: str, expected: str | None, desired: str | None) -> str:
        """Swap a ref between manifests: ``MATCHED``, ``ALREADY_EQUAL`` or ``CONFLICT``."""
        return self._native.compare_and_swap(name, expected, desired)

    def materialize(self, manifest: str, destination: str | os.PathLike[str]) -> Path:
        """Write a stored file to a new path, verifying every chunk; never clobbers."""
        self._native.materialize(manifest, os.fspath(destination))
        return _path(destination)

    def refs(self, prefix: str = "") -> list[str]:
        """Ref names under ``prefix``."""
        return list(self._native.list_refs(prefix))

    def gc(self, max_bytes: int | None = None) -> dict[str, Any]:
        """Delete what no ref or live writer reaches; ``max_bytes`` evicts least recently used graphs."""
        return dict(self._native.gc(max_bytes))

    def fsck(self, *, quarantine: bool = False) -> dict[str, Any]:
        """Re-hash every object; report (and with ``quarantine`` move aside) corrupt ones."""
        return dict(self._native.fsck(quarantine))

    def stats(self) -> dict[str, int]:
        """Objects, bytes, refs and leases."""
        return dict(self._native.stats())
