"""The engine: resolve, ensure, import and export over a local store.

A thin facade over the native engine. Resolving never imports torch; only the
miss path of :meth:`Engine.ensure` does, to run the caller's recipe and the
sole compile policy.
"""

from __future__ import annotations

import os

from . import _native

# The hit path imports nothing beyond `os` and the native module: typing,
# enum, dataclasses and pathlib would each cost more than the resolve itself.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from pathlib import Path
    from typing import Any, TypeAlias, TypeVar

    from .declaration import GraphClassSpec
    from .native import NativeGraph
    from .runner import LoadedGraph

    StrPath: TypeAlias = str | os.PathLike[str]
    OutcomeT = TypeVar("OutcomeT", bound="_Outcome")

__all__ = [
    "Engine",
    "EnsureOutcome",
    "EnsureResult",
    "StoreOutcome",
    "StoreResult",
    "StoredCompiledGraph",
    "default_store_root",
]


def _path(p: str) -> Path:
    from pathlib import Path

    return Path(p)


def default_store_root() -> Path:
    """``$XDG_CACHE_HOME/torch-compiled-graphs``, or ``~/.cache/torch-compiled-graphs``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _path(os.path.join(base, "torch-compiled-graphs"))


class _OutcomeType(type):
    """A minimal enumeration: named singletons, iteration and lookup by value."""

    _members: tuple[_Outcome, ...]

    def __iter__(cls) -> Iterator[_Outcome]:
        return iter(cls._members)

    def __call__(cls, value: str) -> _Outcome:
        for member in cls._members:
            if member.value == value:
                return member
        raise ValueError(f"{value!r} is not a valid {cls.__name__}")


class _Outcome(metaclass=_OutcomeType):
    __slots__ = ("name",)
    name: str
    _members: tuple[_Outcome, ...] = ()

    @classmethod
    def of(cls: type[OutcomeT], value: str) -> OutcomeT:
        """The member whose value is ``value``."""
        for member in cls._members:
            if member.name == value and isinstance(member, cls):
                return member
        raise ValueError(f"{value!r} is not a valid {cls.__name__}")

    @property
    def value(self) -> str:
        """The outcome's name, as the native engine spells it."""
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}>"

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (type(self), (self.name,))

    @classmethod
    def _define(cls, *names: str) -> None:
        members = []
        for name in names:
            member = object.__new__(cls)
            object.__setattr__(member, "name", name)
            setattr(cls, name, member)
            members.append(member)
        cls._members = tuple(members)


class StoreOutcome(_Outcome):
    """What publication decided (first writer wins): STORED, PRESENT, REPAIRED or DIVERGENT."""

    __slots__ = ()
    STORED: StoreOutcome
    PRESENT: StoreOutcome
    REPAIRED: StoreOutcome
    DIVERGENT: StoreOutcome


class EnsureOutcome(_Outcome):
    """Whether ``ensure`` reused a stored artifact (REUSED) or minted one (MINTED)."""

    __slots__ = ()
    REUSED: EnsureOutcome
    MINTED: EnsureOutcome


StoreOutcome._define("STORED", "PRESENT", "REPAIRED", "DIVERGENT")
EnsureOutcome._define("REUSED", "MINTED")


class _Record:
    __slots__: tuple[str, ...] = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f) for f in self.__slots__ if f != "metadata"))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _set(self, **fields: object) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)


class StoreResult(_Record):
    """The verdict of publishing one verified artifact under a key."""

    __slots__ = ("key", "manifest", "outcome")
    outcome: StoreOutcome
    key: str
    manifest: str

    def __init__(self, outcome: StoreOutcome, key: str, manifest: str) -> None:
        self._set(outcome=outcome, key=key, manifest=manifest)

    def __repr__(self) -> str:
        return f"StoreResult(outcome={self.outcome!r}, key={self.key!r}, manifest={self.manifest!r})"

    @classmethod
    def _from_native(cls, d: Mapping[str, Any]) -> StoreResult:
        return cls(StoreOutcome.of(d["outcome"]), d["key"], d["manifest"])


class StoredCompiledGraph(_Record):
    """A verified, admitted compiled graph unpacked at :attr:`path`.

    ``path`` holds ``metadata.json``, ``model.pt2`` and, when the graph has
    literal constants, ``constants.safetensors``.
    """

    __slots__ = ("_path", "key", "manifest", "metadata")
    key: str
    _path: str
    metadata: dict[str, Any]
    manifest: str

    def __init__(self, key: str, path: StrPath, metadata: dict[str, Any], manifest: str) -> None:
        self._set(key=key, _path=os.fspath(path), metadata=metadata, manifest=manifest)

    def __repr__(self) -> str:
        return f"StoredCompiledGraph(key={self.key!r}, path={self._path!r})"

    @classmethod
    def _from_native(cls, d: Mapping[str, Any]) -> StoredCompiledGraph:
        return cls(d["key"], d["destination"], d["metadata"], d["manifest"])

    @property
    def path(self) -> Path:
        """The directory the artifact was published at."""
        return _path(self._path)

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
        return _path(os.path.join(self._path, "model.pt2"))

    def load(self, weights: object, *, device: object = None) -> LoadedGraph:
        """Load this graph and bind ``weights`` (an ``nn.Module`` or a state_dict); imports torch.

        Every constant is checked by fqn (presence, dtype, shape, device)
        before anything is handed to the package loader; literal constants
        come from ``constants.safetensors``.
        """
        from .runner import LoadedGraph

        return LoadedGraph(self, weights, device=device)

    def load_native(self, weights: StrPath, *, torch_lib: StrPath | None = None) -> NativeGraph:
        """Load this graph without importing torch and bind ``weights`` (a ``.safetensors`` file).

        libtorch's shared libraries are opened from ``torch_lib``, or from the
        installed torch package (found without importing it). Every constant
        is checked by fqn (presence, no extras, dtype, shape) before anything
        is bound; calls take numpy-compatible arrays and return arrays. CPU
        graphs only. See docs/run.md.
        """
        from .native import NativeGraph

        return NativeGraph(self, weights, torch_lib=torch_lib)

    @property
    def constants(self) -> list[dict[str, Any]]:
        """The package's constant rows (fqn, source, dtype, shape), in table order."""
        return list(self.metadata["graph_class"]["constants"])


class EnsureResult(_Record):
    """What :meth:`Engine.ensure` did and what it resolved."""

    __slots__ = ("graph", "outcome", "publication")
    outcome: EnsureOutcome
    graph: StoredCompiledGraph
    publication: StoreResult | None

    def __init__(self, outcome: EnsureOutcome, graph: StoredCompiledGraph, publication: StoreResult | None) -> None:
        self._set(outcome=outcome, graph=graph, publication=publication)

    def __repr__(self) -> str:
        return f"EnsureResult(outcome={self.outcome!r}, graph={self.graph!r}, publication={self.publication!r})"


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
        return _path(self._native.root)

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
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tcg-mint-") as work:

            def mint() -> dict[str, Any]:
                from ._mint import mint_for_engine

                result: dict[str, Any] = mint_for_engine(key, recipe, target, toolchain, _path(work))
                return result

            out = self._native.ensure(key, os.fspath(destination), target, dict(toolchain), mint)
        publication = out["publication"]
        return EnsureResult(
            EnsureOutcome.of(out["outcome"]),
            StoredCompiledGraph._from_native(out["resolved"]),
            None if publication is None else StoreResult._from_native(publication),
        )

    def import_artifact(self, key: str, path: StrPath) -> StoreResult:
        """Verify an envelope, admit it on this host and publish it under ``key``."""
        return StoreResult._from_native(self._native.import_artifact(key, os.fspath(path)))

    def export_artifact(self, key: str, path: StrPath) -> Path:
        """Write the exact stored envelope of ``key`` to the file ``path``."""
        return _path(self._native.export_artifact(key, os.fspath(path)))

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
