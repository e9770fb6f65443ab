"""The engine: resolve, ensure, import and export over a local store.

A thin facade over the native engine. Resolving never imports torch; only the
miss path of :meth:`Engine.ensure` does, to run the caller's recipe and the
sole compile policy.
"""

from __future__ import annotations

import enum
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _native

if TYPE_CHECKING:
    from .declaration import GraphClassSpec

__all__ = [
    "Engine",
    "EnsureOutcome",
    "EnsureResult",
    "StoreOutcome",
    "StoreResult",
    "StoredCompiledGraph",
    "default_store_root",
]

StrPath = str | os.PathLike[str]


def default_store_root() -> Path:
    """``$XDG_CACHE_HOME/torch-compiled-graphs``, or ``~/.cache/torch-compiled-graphs``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch-compiled-graphs"


class StoreOutcome(enum.Enum):
    """What publication decided (first writer wins)."""

    STORED = "STORED"
    PRESENT = "PRESENT"
    REPAIRED = "REPAIRED"
    DIVERGENT = "DIVERGENT"


class EnsureOutcome(enum.Enum):
    """Whether ``ensure`` reused a stored artifact or minted one."""

    REUSED = "REUSED"
    MINTED = "MINTED"


@dataclass(frozen=True)
class StoreResult:
    """The verdict of publishing one verified artifact under a key."""

    outcome: StoreOutcome
    key: str
    manifest: str

    @classmethod
    def _from_native(cls, d: Mapping[str, Any]) -> StoreResult:
        return cls(StoreOutcome(d["outcome"]), d["key"], d["manifest"])


@dataclass(frozen=True)
class StoredCompiledGraph:
    """A verified, admitted compiled graph unpacked at :attr:`path`.

    ``path`` holds ``metadata.json``, ``model.pt2`` and, when the graph has
    literal constants, ``constants.safetensors``.
    """

    key: str
    path: Path
    metadata: dict[str, Any] = field(repr=False)
    manifest: str = field(repr=False)

    @classmethod
    def _from_native(cls, d: Mapping[str, Any]) -> StoredCompiledGraph:
        return cls(d["key"], Path(d["destination"]), d["metadata"], d["manifest"])

    @property
    def graph_class(self) -> str:
        """The display name, which is also the package entry name."""
        return str(self.metadata["graph_class"]["name"])

    @property
    def sm(self) -> str:
        """The ``sm`` axis the artifact was compiled for."""
        return str(self.metadata["sm"])

    @property
    def package_path(self) -> Path:
        """The AOTInductor package."""
        return self.path / "model.pt2"

    @property
    def constants(self) -> list[dict[str, Any]]:
        """The package's constant rows (fqn, source, dtype, shape), in table order."""
        return list(self.metadata["graph_class"]["constants"])


@dataclass(frozen=True)
class EnsureResult:
    """What :meth:`Engine.ensure` did and what it resolved."""

    outcome: EnsureOutcome
    graph: StoredCompiledGraph
    publication: StoreResult | None


class Engine:
    """Resolve compiled graphs from a local content-addressed store, minting on a miss.

    ``root`` defaults to :func:`default_store_root`. ``lock_timeout`` bounds
    how long ``ensure`` waits for another process minting the same key.
    """

    def __init__(self, root: StrPath | None = None, *, lock_timeout: float | None = None) -> None:
        self._native = _native.NativeEngine(os.fspath(root or default_store_root()), lock_timeout)

    @property
    def root(self) -> Path:
        """The store root."""
        return Path(self._native.root)

    def resolve(self, key: str, destination: StrPath) -> StoredCompiledGraph | None:
        """The verified artifact of ``key`` unpacked at ``destination``; ``None`` on a miss.

        Raises ``QuarantinedArtifact`` for a record that exists but must not be
        served and ``AdmissionError`` when this host cannot run it. Never
        imports torch.
        """
        found = self._native.resolve(key, os.fspath(destination))
        return None if found is None else StoredCompiledGraph._from_native(found)

    def ensure(
        self,
        key: str,
        destination: StrPath,
        *,
        target: str,
        toolchain: Mapping[str, object],
        recipe: Callable[[], GraphClassSpec],
    ) -> EnsureResult:
        """Resolve ``key``; on a miss call ``recipe`` once, compile, store and resolve.

        ``recipe`` returns a ``GraphClassSpec`` and is called only on a miss,
        by at most one process at a time per key on this host.
        """
        with tempfile.TemporaryDirectory(prefix="tcg-mint-") as work:

            def mint() -> dict[str, Any]:
                from ._mint import mint_for_engine

                return mint_for_engine(key, recipe, target, toolchain, Path(work))

            out = self._native.ensure(key, os.fspath(destination), target, dict(toolchain), mint)
        publication = out["publication"]
        return EnsureResult(
            EnsureOutcome(out["outcome"]),
            StoredCompiledGraph._from_native(out["resolved"]),
            None if publication is None else StoreResult._from_native(publication),
        )

    def import_artifact(self, key: str, path: StrPath) -> StoreResult:
        """Verify an envelope, admit it on this host and publish it under ``key``."""
        return StoreResult._from_native(self._native.import_artifact(key, os.fspath(path)))

    def export_artifact(self, key: str, path: StrPath) -> Path:
        """Write the exact stored envelope of ``key`` to the file ``path``."""
        return Path(self._native.export_artifact(key, os.fspath(path)))

    def list(self) -> list[dict[str, Any]]:
        """Every stored key with graph class, sm, size and last use."""
        return list(self._native.list())

    def gc(self, max_bytes: int | None = None) -> dict[str, Any]:
        """Collect unreachable objects; with ``max_bytes``, evict least recently resolved keys."""
        return dict(self._native.gc(max_bytes))

    def fsck(self, *, quarantine: bool = False) -> dict[str, Any]:
        """Re-hash every object and report corrupt ones (optionally moving them aside)."""
        return dict(self._native.fsck(quarantine))

    def stats(self) -> dict[str, int]:
        """Hits, misses, mints, quarantines, keys, objects and bytes."""
        return dict(self._native.stats())
