"""The engine: resolve, ensure, import and export over a local store.

A thin facade over the native engine. Resolving never imports torch; only the
miss path of :meth:`Engine.ensure` does, to run the caller's recipe and the
sole compile policy.
"""

import os

from . import _native

# The hit path imports nothing beyond `os` and the native module: typing,
# enum, dataclasses and pathlib would each cost more than the resolve itself.
# Nor `__future__` (see __init__.py): annotations that name typing-only names
# are quoted.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from pathlib import Path
    from typing import Any, TypeAlias, TypeVar

    from .capture import CaptureBackend
    from .declaration import GraphClassSpec
    from .explain import Explanation
    from .identity import GraphClassDeclaration
    from .native import NativeGraph, NativeWeightsSet
    from .runner import LoadedGraph
    from .store import LocalCAS

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


def _path(p: str) -> "Path":
    from pathlib import Path

    return Path(p)


def default_store_root() -> "Path":
    """``$XDG_CACHE_HOME/torch-compiled-graphs``, or ``~/.cache/torch-compiled-graphs``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _path(os.path.join(base, "torch-compiled-graphs"))


class _OutcomeType(type):
    """A minimal string enumeration: named singletons, iteration and lookup by value."""

    _members: "tuple[_Outcome, ...]"

    def __iter__(cls) -> "Iterator[_Outcome]":
        return iter(cls._members)

    def __len__(cls) -> int:
        return len(cls._members)

    def __call__(cls, value: object) -> "_Outcome":
        for member in cls._members:
            if member is value or str.__eq__(member, value) is True:
                return member
        raise ValueError(f"{value!r} is not a valid {cls.__name__}")


class _Outcome(str, metaclass=_OutcomeType):
    """A member is the ``str`` of its value (``"reused"``), as in 0.2.0.

    It compares equal to, hashes like and serialises as that string; ``name``
    is the upper-case member name and ``value`` the string itself.
    """

    __slots__ = ("name",)
    name: str
    _members: "tuple[_Outcome, ...]" = ()

    @classmethod
    def of(cls: "type[OutcomeT]", name: str) -> "OutcomeT":
        """The member named ``name`` (``"REUSED"``), as the native engine spells it."""
        for member in cls._members:
            if member.name == name and isinstance(member, cls):
                return member
        raise ValueError(f"{name!r} is not a valid {cls.__name__} name")

    @property
    def value(self) -> str:
        """The outcome's string value (``"reused"``)."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {str.__repr__(self)}>"

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (type(self), (str.__str__(self),))

    def __copy__(self) -> "_Outcome":
        return self

    def __deepcopy__(self, memo: object) -> "_Outcome":
        return self

    @classmethod
    def _define(cls, *names: str) -> None:
        members = []
        for name in names:
            member = str.__new__(cls, name.lower())
            object.__setattr__(member, "name", name)
            setattr(cls, name, member)
            members.append(member)
        cls._members = tuple(members)


class StoreOutcome(_Outcome):
    """What publication decided (first writer wins).

    ``STORED`` (``"stored"``), ``PRESENT`` (``"present"``), ``REPAIRED``
    (``"repaired"``) or ``DIVERGENT`` (``"divergent"``): a ``str`` enumeration,
    so ``StoreOutcome("stored") is StoreOutcome.STORED`` and
    ``StoreOutcome.STORED == "stored"``.
    """

    __slots__ = ()
    STORED: "StoreOutcome"
    PRESENT: "StoreOutcome"
    REPAIRED: "StoreOutcome"
    DIVERGENT: "StoreOutcome"


class EnsureOutcome(_Outcome):
    """Whether ``ensure`` reused a stored artifact or minted one.

    ``REUSED`` (``"reused"``) or ``MINTED`` (``"minted"``), a ``str`` enumeration.
    """

    __slots__ = ()
    REUSED: "EnsureOutcome"
    MINTED: "EnsureOutcome"


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
    outcome: "StoreOutcome"
    key: str
    manifest: str

    def __init__(self, outcome: "StoreOutcome", key: str, manifest: str) -> None:
        self._set(outcome=outcome, key=key, manifest=manifest)

    def __repr__(self) -> str:
        return f"StoreResult(outcome={self.outcome!r}, key={self.key!r}, manifest={self.manifest!r})"

    @classmethod
    def _from_native(cls, d: "Mapping[str, Any]") -> "StoreResult":
        return cls(StoreOutcome.of(d["outcome"]), d["key"], d["manifest"])


class StoredCompiledGraph(_Record):
    """A verified, admitted compiled graph unpacked at :attr:`directory`.

    ``directory`` holds ``metadata.json``, ``model.pt2`` (:attr:`package`) and,
    when the graph has literal constants, ``constants.safetensors``
    (:attr:`literals`). These are the 0.2.0 names; ``path`` and
    ``package_path`` are kept as aliases of ``directory`` and ``package``.
    """

    __slots__ = ("_path", "key", "manifest", "metadata", "source")
    key: str
    _path: str
    metadata: "dict[str, Any]"
    manifest: str
    #: Where it came from: ``"local"`` (the local store), ``"remote"`` (fetched
    #: from the fleet remote and verified) or ``"compiled"`` (minted by this call).
    source: str

    def __init__(
        self, key: str, path: "StrPath", metadata: "dict[str, Any]", manifest: str, source: str = "local"
    ) -> None:
        self._set(key=key, _path=os.fspath(path), metadata=metadata, manifest=manifest, source=source)

    def __repr__(self) -> str:
        return f"StoredCompiledGraph(key={self.key!r}, directory={self._path!r})"

    @classmethod
    def _from_native(cls, d: "Mapping[str, Any]") -> "StoredCompiledGraph":
        return cls(d["key"], d["destination"], d["metadata"], d["manifest"], d.get("source", "local"))

    @property
    def directory(self) -> "Path":
        """The directory the artifact was published at."""
        return _path(self._path)

    @property
    def path(self) -> "Path":
        """Alias of :attr:`directory`."""
        return _path(self._path)

    @property
    def package(self) -> "Path":
        """The AOTInductor package, ``directory / "model.pt2"``."""
        return _path(os.path.join(self._path, "model.pt2"))

    @property
    def package_path(self) -> "Path":
        """Alias of :attr:`package`."""
        return self.package

    @property
    def literals(self) -> "Path | None":
        """``directory / "constants.safetensors"`` when the graph has literal constants, else ``None``."""
        if any(row.get("source") == "literal" for row in self.metadata["graph_class"]["constants"]):
            return _path(os.path.join(self._path, "constants.safetensors"))
        return None

    @property
    def graph_class(self) -> str:
        """The display name, which is also the package entry name."""
        return str(self.metadata["graph_class"]["name"])

    @property
    def sm(self) -> str:
        """The ``sm`` axis the artifact was compiled for."""
        return str(self.metadata["sm"])

    def load(
        self,
        weights: object,
        *,
        device: object = None,
        strip_prefix: str = "",
        add_prefix: str = "",
        cuda_graphs: bool | None = None,
        max_captures: int | None = None,
        cuda_graph_outputs: str = "copy",
        capture_backend: "CaptureBackend | None" = None,
    ) -> "LoadedGraph":
        """Load this graph and bind ``weights``; imports torch.

        ``weights`` is an ``nn.Module``, a state_dict, or a checkpoint on disk:
        a ``.safetensors`` file, a sharded checkpoint's ``*.safetensors.index.json``
        (as ``save_pretrained`` writes it), a directory holding either, or a
        list of those (a checkpoint plus a file from :meth:`write_weights`).
        Names bind through the artifact's weights contract
        (:attr:`weights_contract`): any alias of a tied weight binds it,
        declared names the compiler dropped are ignored (and listed on the
        loaded graph's ``ignored_constants``), names foreign to the declaration
        are refused, and a missing name is explained by its kind.
        ``strip_prefix`` (``"unet."`` for a pipeline's checkpoint) keeps only
        the names under it, without it; ``add_prefix`` puts a prefix in front.
        Every constant is checked (dtype, shape, device) before anything is
        handed to the package loader; literal constants come from
        ``constants.safetensors``.

        On a GPU, calls are captured as CUDA graphs per input shape set and
        replayed (after two uncaptured runs of each): ``cuda_graphs=False``
        (or ``TORCH_COMPILED_GRAPHS_CUDA_GRAPHS=0`` where not given) turns it
        off, ``max_captures`` bounds the shape sets captured at once (default
        8, or ``TORCH_COMPILED_GRAPHS_MAX_CAPTURES``), ``cuda_graph_outputs``
        is ``"copy"`` (each call gets its own outputs) or ``"static"`` (the
        graph's buffers, valid until its next call); ``capture_backend``
        replaces ``torch.cuda.CUDAGraph`` (a
        :class:`~torch_compiled_graphs.capture.RecordingBackend` emulates it on
        any device). See docs/run.md.
        """
        from .runner import LoadedGraph

        return LoadedGraph(
            self,
            weights,
            device=device,
            strip_prefix=strip_prefix,
            add_prefix=add_prefix,
            cuda_graphs=cuda_graphs,
            max_captures=max_captures,
            cuda_graph_outputs=cuda_graph_outputs,
            capture_backend=capture_backend,
        )

    def load_native(
        self,
        weights: "StrPath | Sequence[StrPath] | NativeWeightsSet",
        *,
        device: str | None = None,
        torch_lib: "StrPath | None" = None,
        strip_prefix: str = "",
        add_prefix: str = "",
        cuda_graphs: bool | None = None,
        max_captures: int | None = None,
        runtime: str | None = None,
        cuda_graph_outputs: str = "copy",
    ) -> "NativeGraph":
        """Load this graph without importing torch and bind ``weights`` from disk.

        ``weights`` is a ``.safetensors`` file, a sharded checkpoint's
        ``*.safetensors.index.json``, a directory holding either, or a list of
        those; names bind through the weights contract as for :meth:`load`,
        with the same prefixes. ``device`` is ``"cpu"`` for a CPU artifact and
        ``"cuda:N"`` for an ``sm_NN`` one (default: ``"cpu"``, or ``"cuda:0"``);
        the GPU's capability must be the artifact's. libtorch's shared
        libraries (and ``libtorch_cuda`` for a GPU) are opened from
        ``torch_lib``, or from the installed torch package (found without
        importing it). Every constant is checked by fqn (dtype, shape) before
        anything is bound (on a GPU: before anything is copied to it); calls
        take numpy-compatible or DLPack arrays and return DLPack-exportable
        tensors. On a GPU, calls are replayed as CUDA graphs per shape set
        (``cuda_graphs``, ``max_captures`` and their environment variables as for
        :meth:`load`; docs/run.md, "CUDA graphs"); a replayed call returns copies of
        the capture's outputs, or with ``cuda_graph_outputs="static"`` (or within
        ``with native.static_outputs():``) the capture's buffers themselves, valid
        until the graph's next call. ``weights`` may also be a
        :class:`NativeWeightsSet` on the graph's device (``device`` defaults to the
        set's; the prefixes were applied when the set was opened): the graph then binds
        the set's memory without a copy. ``runtime`` (``"auto"``, ``"libtorch"``,
        ``"shim"``; default ``$TORCH_COMPILED_GRAPHS_RUNTIME``, else ``"auto"``) picks
        what provides the C shim the package calls: ``auto`` runs a CPU graph whose
        ``.so`` imports only shim set v1 on ``libtcg_shim.so`` (no libtorch opened,
        ``torch_lib`` unused) unless libtorch is already loaded in the process, every
        other graph on libtorch; ``shim`` on a graph it cannot run is
        ``run.native_unsupported`` naming the functions. ``native.runtime`` and
        ``native.runtime_reason`` say which and why. See docs/run.md.
        """
        from .native import NativeGraph

        return NativeGraph(
            self,
            weights,
            device=device,
            torch_lib=torch_lib,
            strip_prefix=strip_prefix,
            add_prefix=add_prefix,
            cuda_graphs=cuda_graphs,
            max_captures=max_captures,
            runtime=runtime,
            cuda_graph_outputs=cuda_graph_outputs,
        )

    @property
    def weights_contract(self) -> "dict[str, Any]":
        """What binding needs: ``kinds`` (each declared constant's kind:
        ``parameter``, ``buffer``, ``non_persistent_buffer``, ``constant``),
        ``alias_groups`` (declared names that share storage), ``dropped``
        (declared names the compiled table does not bind), ``bound`` (the names
        the weights must provide, in table order) and ``recorded`` (false for an
        artifact minted without a contract, whose kinds are ``unknown``)."""
        return dict(_native.package_weights_contract(os.fspath(self.package_path), self.metadata))

    def write_weights(self, module: object, path: "StrPath", *, non_persistent_only: bool = False) -> "Path":
        """Write what this graph binds, taken from ``module`` (an ``nn.Module``), to a
        ``.safetensors`` file for :meth:`load_native`: every constant the table binds,
        under its table name, or with ``non_persistent_only`` only the
        non-persistent buffers (the values no ``state_dict()`` or
        ``save_pretrained()`` checkpoint holds), to pass beside the user's
        checkpoint. Imports torch. Values come from the module, never from
        the artifact."""
        from .runner import write_weights

        return write_weights(self, module, path, non_persistent_only=non_persistent_only)

    @property
    def constants(self) -> "list[dict[str, Any]]":
        """The package's constant rows (fqn, source, dtype, shape), in table order."""
        return list(self.metadata["graph_class"]["constants"])

    @property
    def mint_record(self) -> "dict[str, Any] | None":
        """What the mint measured and found, or ``None`` for a graph minted without one (0.2.0).

        ``{"format", "native": {"unsupported_calls": [...]}, "parity": {...}}``,
        read from the package (``model/extra/tcg-mint.json``, docs/FORMAT.md
        "The mint record"), verified against the wrapper when the artifact was
        resolved. Not part of the metadata or the key.
        """
        record: dict[str, Any] | None = _native.package_mint_record(os.fspath(self.package))
        return record

    @property
    def shim_imports(self) -> dict[str, list[str]]:
        """What the graph's ``.so`` imports: ``{"aoti_torch": [...], "other": [...]}``.

        Read now from the dynamic symbol table of the verified package's
        ``.so`` (it is not in the mint record, whose schema refuses new members:
        docs/shim.md), so a 0.2.0 artifact is covered too. ``aoti_torch`` lists
        the libtorch C shim functions the compiled code calls; ``other`` every
        other import that no system library (glibc, the C++ runtime, libgcc_s,
        the CUDA runtime and driver) provides, for example libtorch C++ API
        symbols. Both sorted. Imports no torch.
        """
        imports: dict[str, list[str]] = _native.package_shim_imports(os.fspath(self.package), self.graph_class)
        return imports

    @property
    def native_unsupported_calls(self) -> "list[dict[str, Any]]":
        """Calls of the compiled code the native path cannot make (``[{call, count, target}]``).

        Scanned from the package's wrapper now, so a graph minted without a
        record is covered too; a non-empty list means :meth:`load_native`
        refuses the graph (``run.native_unsupported``) and :meth:`load` runs it.
        """
        calls: list[dict[str, Any]] = _native.package_native_calls(os.fspath(self.package))
        return calls


def _remote_publication(raw: dict[str, str] | None) -> dict[str, str] | None:
    """The native remote verdict with its outcome as a :class:`StoreOutcome` (a ``str``
    whose value is lowercase, ``"stored"``, ``"present"`` or ``"divergent"``, like
    :class:`StoreResult`'s outcome)."""
    if raw is None:
        return None
    return {**raw, "outcome": StoreOutcome(str(raw["outcome"]).lower())}


class EnsureResult(_Record):
    """What :meth:`Engine.ensure` did (:attr:`outcome`) and what it resolved (:attr:`compiled_graph`).

    ``publication`` is the :class:`StoreResult` of the mint (``None`` on a
    hit); ``graph`` is kept as an alias of ``compiled_graph``. ``explanation``
    is set when this call compiled (a miss): whether and how the stored
    entries of the same graph class differ from the requested key; it is
    ``None`` on a hit. ``source`` says where the graph came from;
    ``remote_publication`` is the fleet remote's verdict on a mint
    (``{"outcome", "manifest"}``) or ``None``.
    """

    __slots__ = ("compiled_graph", "explanation", "outcome", "publication", "remote_publication")
    outcome: "EnsureOutcome"
    compiled_graph: "StoredCompiledGraph"
    publication: "StoreResult | None"
    explanation: "Explanation | None"
    #: The fleet remote's verdict on this mint (``{"outcome", "manifest"}``), or ``None``.
    remote_publication: dict[str, str] | None

    def __init__(
        self,
        outcome: "EnsureOutcome",
        compiled_graph: "StoredCompiledGraph",
        publication: "StoreResult | None" = None,
        explanation: "Explanation | None" = None,
        remote_publication: dict[str, str] | None = None,
    ) -> None:
        self._set(
            outcome=outcome,
            compiled_graph=compiled_graph,
            publication=publication,
            explanation=explanation,
            remote_publication=remote_publication,
        )

    @property
    def graph(self) -> "StoredCompiledGraph":
        """Alias of :attr:`compiled_graph`."""
        return self.compiled_graph

    @property
    def source(self) -> str:
        """Where the graph came from: ``"local"``, ``"remote"`` or ``"compiled"``."""
        return self.compiled_graph.source

    def __repr__(self) -> str:
        return (
            f"EnsureResult(outcome={self.outcome!r}, compiled_graph={self.compiled_graph!r}, "
            f"publication={self.publication!r})"
        )


def _store_root(store: object) -> str:
    """The root of ``store``: a ``LocalCAS``, a path, or ``None`` for the default root."""
    if store is None:
        return os.fspath(default_store_root())
    if isinstance(store, (str, os.PathLike)):
        return os.fspath(store)
    from .store import LocalCAS

    if isinstance(store, LocalCAS):
        return str(store._native.root)
    raise TypeError(f"Engine(store) takes a LocalCAS, a path or None, not {type(store).__qualname__}")


class Engine:
    """Resolve compiled graphs from a local content-addressed store, minting on a miss.

    ``store`` is a :class:`~torch_compiled_graphs.LocalCAS`, a store root path,
    or ``None`` for :func:`default_store_root` (``root=`` is accepted as a
    keyword alias). ``lock_timeout`` bounds how long ``ensure`` waits for
    another process minting the same key. ``remote`` (``s3://bucket/prefix``;
    default ``$TORCH_COMPILED_GRAPHS_REMOTE``, ``""`` for none) names a fleet
    remote consulted on a local miss; see docs/fleet.md. Nothing is contacted
    until a miss needs it.

    Signed provenance (docs/trust.md): ``signing_key`` (an unencrypted OpenSSH
    ed25519 private key file) signs every artifact this engine mints;
    ``trust`` (an OpenSSH ``allowed_signers`` file, with an optional
    ``revoked_keys`` file) is the trust policy of every method that brings
    bytes in or serves them: ``import_artifact`` and ``adopt_hashrepo`` admit
    only artifacts a trusted signer signed (raising ``TrustError``
    otherwise), fetches from the remote (``resolve``, ``ensure``, ``pull``)
    take only signed artifacts, and a local hit is served only when this
    store minted the record or the policy admits it (an artifact an
    untrusting engine brought in is a miss until a trusted signature admits
    it; docs/trust.md, "Admission records"). ``producer`` names this node in
    statements. Each argument wins over its environment variable
    ``TORCH_COMPILED_GRAPHS_SIGNING_KEY``, ``…_TRUST``, ``…_REVOKED_KEYS``,
    ``…_PRODUCER``, used when the argument is ``None`` (an empty variable is
    unset).
    """

    def __init__(
        self,
        store: "LocalCAS | StrPath | None" = None,
        *,
        lock_timeout: float | None = None,
        root: "StrPath | None" = None,
        remote: str | None = None,
        signing_key: "StrPath | None" = None,
        trust: "StrPath | None" = None,
        revoked_keys: "StrPath | None" = None,
        producer: str | None = None,
    ) -> None:
        if root is not None:
            if store is not None:
                raise TypeError("Engine() takes a store or root=, not both")
            store = root
        if remote is None:
            remote = os.environ.get("TORCH_COMPILED_GRAPHS_REMOTE", "")

        def opt(p: "StrPath | None") -> str | None:
            return None if p is None else os.fspath(p)

        self._native = _native.NativeEngine(
            _store_root(store),
            lock_timeout,
            remote.strip() or None,
            opt(signing_key),
            opt(trust),
            opt(revoked_keys),
            producer,
        )

    @property
    def remote(self) -> str | None:
        """The fleet remote's URL, or ``None``."""
        return self._native.remote

    def pull(self, keys: list[str], admitted_copy: bool = False) -> "list[dict[str, Any]]":
        """Bring ``keys`` into the local store from the remote, verified; one row a key with its
        ``source`` (``"local"``, ``"remote"`` or ``None`` when neither has it) and ``signatures``
        (signature records stored with it). Under a trust policy a refused key has ``source``
        ``None``, ``refused`` (its ``trust.*`` code) and ``error`` (docs/trust.md, "The fleet").
        With ``admitted_copy`` each fetched graph's members are stored as its admitted copy too;
        otherwise its first ``resolve`` reads the envelope once and records the copy
        (docs/fleet.md)."""
        return list(self._native.pull(list(keys), admitted_copy))

    @property
    def root(self) -> "Path":
        """The store root."""
        return _path(self._native.root)

    def resolve(self, key: str, destination: "StrPath") -> "StoredCompiledGraph | None":
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
        destination: "StrPath",
        *,
        target: str,
        toolchain: "Mapping[str, object]",
        recipe: "Callable[[], GraphClassSpec]",
        variant: str = "default",
    ) -> "EnsureResult":
        """Resolve ``key``; on a miss call ``recipe`` once, compile, store and resolve.

        ``recipe`` returns a ``GraphClassSpec`` and is called only on a miss,
        by at most one process at a time per key on this host.

        ``variant`` is ``"default"`` (today's compile policy, served through
        libtorch) or ``"shim-v1"``, the libtorch-free variant: compiled with
        ``link_libtorch=False`` and kernels the package carries, and refused
        (``compile.variant_refused``, naming the ops; nothing published) unless
        its ``.so`` imports only shim set v1. The variant is part of the key
        through ``toolchain["settings_declaration"]``: derive the key under
        ``record_toolchain(variant=...)``; a block that names another variant's
        policy is ``declaration.variant_mismatch`` (docs/keys.md, "Variants").
        """
        import tempfile

        named = _native.COMPILE_POLICIES.get(str(toolchain.get("settings_declaration")))
        if variant != "default" or named not in (None, "default policy"):
            # The block names another variant's policy, or a variant was asked for.
            from .variant import check_request

            variant = check_request(variant, toolchain)

        with tempfile.TemporaryDirectory(prefix="tcg-mint-") as work:

            def mint() -> "dict[str, Any]":
                from ._mint import mint_for_engine

                result: dict[str, Any] = mint_for_engine(key, recipe, target, toolchain, _path(work), variant)
                return result

            out = self._native.ensure(key, os.fspath(destination), target, dict(toolchain), mint)
        publication = out["publication"]
        outcome = EnsureOutcome.of(out["outcome"])
        explanation = None
        if outcome is EnsureOutcome.MINTED:
            from .explain import explain_miss

            explanation = explain_miss(self._native, key)
        return EnsureResult(
            outcome,
            StoredCompiledGraph._from_native(out["resolved"]),
            None if publication is None else StoreResult._from_native(publication),
            explanation,
            _remote_publication(out.get("remote_publication")),
        )

    def explain(
        self,
        what: "GraphClassSpec | GraphClassDeclaration",
        *,
        target: str,
        toolchain: "Mapping[str, object]",
        limit: int = 3,
    ) -> "Explanation":
        """Why the key of ``what`` under ``target`` and ``toolchain`` would miss, fact by fact.

        ``what`` is a ``GraphClassSpec`` (its program's canonical lines are
        compared too) or a ``GraphClassDeclaration`` alone (no torch needed).
        ``target`` is ``cpu`` (this host's level), ``sm_NN[a]`` or a concrete
        ``cpu-<level>``; no device is checked and nothing is compiled. The
        result says whether the key is stored and lists at most ``limit``
        nearest stored entries of the same graph class name with the axes and
        facts that differ (docs/keys.md, "Why did it miss?").
        """
        from .explain import explain_request

        return explain_request(self._native, what, target, toolchain, limit)

    def explain_keys(self, a: str, b: str) -> "dict[str, Any]":
        """The facts that differ between two stored keys (``a`` in the requested role)."""
        return dict(self._native.explain_keys(a, b))

    def explain_class(self, graph_class: str) -> "dict[str, Any]":
        """Every stored entry of ``graph_class``, each diffed against the first (key order)."""
        return dict(self._native.explain_class(graph_class))

    def import_artifact(self, key: str, path: "StrPath") -> "StoreResult":
        """Verify an envelope, admit it on this host and publish it under ``key``.

        Signatures in ``path + ".sig"`` are checked and kept. With a trust
        policy, an artifact without a trusted signature raises ``TrustError``
        and nothing is published.
        """
        return StoreResult._from_native(self._native.import_artifact(key, os.fspath(path)))

    def adopt_hashrepo(self, old_root: "StrPath") -> "list[dict[str, Any]]":
        """Import every graph of a torch-compiled-graphs 0.2.0 store (a HashRepo root) into this store.

        The old root is only read, and never trusted: each graph goes through
        the full verification and admission of :meth:`import_artifact`. One
        dict per ref of the old store: ``key``, ``ref_file``, ``status``
        (``"imported"``, ``"present"``, ``"divergent"``, ``"quarantined"`` or
        ``"refused"``), ``outcome`` (the publication outcome's value or
        ``None``), ``manifest``, and ``code`` and ``message`` when refused or
        quarantined.
        """
        return list(self._native.adopt_hashrepo(os.fspath(old_root)))

    def export_artifact(self, key: str, path: "StrPath") -> "Path":
        """Write the exact stored envelope of ``key`` to ``path`` and its signatures to ``path + ".sig"``."""
        return _path(self._native.export_artifact(key, os.fspath(path)))

    @property
    def trusting(self) -> bool:
        """Whether a trust policy is set."""
        return self._native.trusting

    @property
    def signing(self) -> bool:
        """Whether this engine signs what it mints."""
        return self._native.signing

    def sign(self, key: str, key_file: "StrPath", *, producer: str | None = None) -> "dict[str, Any]":
        """Verify the artifact stored for ``key`` in full and sign it with ``key_file``."""
        return dict(self._native.sign(key, os.fspath(key_file), producer))

    def signers(self, key: str) -> "list[dict[str, Any]]":
        """The valid signatures of the artifact that serves ``key``: fingerprint, producer, signer, time."""
        return list(self._native.signers(key))

    def list(self) -> "list[dict[str, Any]]":
        """Every stored key with graph class, sm, size and last use."""
        return list(self._native.list())

    def gc(self, max_bytes: int | None = None) -> "dict[str, Any]":
        """Collect unreachable objects; with ``max_bytes``, evict least recently resolved keys."""
        return dict(self._native.gc(max_bytes))

    def fsck(self, *, quarantine: bool = False) -> "dict[str, Any]":
        """Re-hash every object and report corrupt ones (optionally moving them aside)."""
        return dict(self._native.fsck(quarantine))

    def stats(self) -> dict[str, int]:
        """Hits, misses, mints, quarantines, keys, objects and bytes."""
        return dict(self._native.stats())
