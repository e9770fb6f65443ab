"""Identity: compiled-graph keys, graph-class declarations and digests.

Every value here is computed by the native core (the single producer); this
module only gives it Python shapes. Nothing here imports torch.
"""

from __future__ import annotations

from . import _native

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

__all__ = [
    "COMPILED_GRAPH_FORMAT",
    "KEY_AXES",
    "KEY_SCHEME",
    "CompiledGraphKey",
    "GraphClassDeclaration",
    "canonical_json",
    "graph_witness",
    "ingress_digest",
    "is_compiled_graph_key",
    "literal_digest",
    "split_key",
    "toolchain_axis_digest",
]

COMPILED_GRAPH_FORMAT: int = _native.COMPILED_GRAPH_FORMAT
KEY_SCHEME: str = _native.KEY_SCHEME
KEY_AXES: tuple[str, ...] = tuple(_native.KEY_AXES)


def is_compiled_graph_key(value: object) -> bool:
    """Whether ``value`` is a ``str`` in the compiled-graph key grammar (SPEC-v1 §3.1)."""
    return _native.is_compiled_graph_key(value)


def split_key(key: object) -> tuple[str, str]:
    """``(scheme, digest)`` of a key, split at its anchored 56-hex suffix.

    Anything that is not a key raises ``IdentityError`` (``identity.key_invalid``).
    """
    return _native.split_key(key)


def canonical_json(value: object) -> bytes:
    """Canonical JSON bytes: ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True)``."""
    return _native.canonical_json(value)


def toolchain_axis_digest(block: Mapping[str, object]) -> str:
    """The toolchain axis (16 hex) of a toolchain block; keys and values pass through ``str()``."""
    return _native.toolchain_axis(dict(block))


def literal_digest(rows: Iterable[tuple[str, str, Sequence[int], bytes]]) -> str:
    """The literal digest over ``(name, torch dtype text, shape, raw bytes)`` rows; ``""`` for none."""
    return _native.literal_digest([(n, d, list(s), b) for n, d, s, b in rows])


def ingress_digest(ingress: Mapping[str, Any]) -> str:
    """Validate a call ingress (SPEC-v1 §3.9) and return its 32-hex digest."""
    return _native.ingress_digest(ingress)


def graph_witness(lines: Sequence[str]) -> str:
    """The graph witness: 16 hex of the canonical lines joined by LF."""
    return _native.graph_witness(list(lines))


class CompiledGraphKey(str):
    """A ``cg-key-v1`` key derived from its three axes.

    It is a ``str`` (the key itself) that also remembers its axes. Build one
    with :meth:`derive`, :meth:`for_declaration` or :meth:`from_metadata`.
    """

    graph: str
    sm: str
    toolchain: str

    def __new__(cls, graph: str, sm: str, toolchain: str) -> CompiledGraphKey:
        key = _native.derive_key({"graph": graph, "sm": sm, "toolchain": toolchain})
        self = super().__new__(cls, key)
        self.graph, self.sm, self.toolchain = graph, sm, toolchain
        return self

    @classmethod
    def derive(cls, axes: Mapping[str, object]) -> CompiledGraphKey:
        """Derive from an axes mapping, validated in the SPEC's order."""
        key = _native.derive_key(dict(axes))
        self = str.__new__(cls, key)
        self.graph, self.sm, self.toolchain = (str(axes[a]) for a in KEY_AXES)
        return self

    @classmethod
    def for_declaration(
        cls, declaration: GraphClassDeclaration, *, sm: str, toolchain: Mapping[str, object]
    ) -> CompiledGraphKey:
        """The key of ``declaration`` compiled for ``sm`` by the ``toolchain`` block."""
        return cls(declaration.class_hash, sm, toolchain_axis_digest(toolchain))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> CompiledGraphKey:
        """The key an artifact's ``metadata.json`` restates (SPEC-v1 §3.3)."""
        key = _native.key_from_metadata(dict(metadata))
        self = str.__new__(cls, key)
        self.graph = metadata["graph_class"]["class_hash"]
        self.sm = metadata["sm"]
        self.toolchain = toolchain_axis_digest(metadata["toolchain"])
        return self

    @property
    def axes(self) -> dict[str, str]:
        """The three axes."""
        return {"graph": self.graph, "sm": self.sm, "toolchain": self.toolchain}

    def __repr__(self) -> str:
        return f"CompiledGraphKey({str.__repr__(self)})"


_FIELDS = (
    "graph_class",
    "target",
    "graph",
    "graph_witness",
    "range_digest",
    "fork",
    "class_dims",
    "strict",
    "lora_bucket",
    "literal_values",
    "placement",
)


class GraphClassDeclaration:
    """A validated, canonical graph-class declaration (SPEC-v1 §3.6) and its class hash.

    Construction applies every rule in order and raises ``DeclarationError``
    with the rule's code. Declarations compare equal iff all canonical fields
    are equal; the display name ``graph_class`` is not part of the class hash.
    """

    __slots__ = ("_fields",)
    _fields: dict[str, Any]

    def __init__(
        self,
        graph_class: str,
        target: str,
        graph: Mapping[str, Any],
        graph_witness: str,
        range_digest: str,
        *,
        fork: Iterable[tuple[object, object]] = (),
        class_dims: Iterable[tuple[object, int]] = (),
        strict: bool = True,
        lora_bucket: int = 0,
        literal_values: str = "",
        placement: Iterable[object] = (),
    ) -> None:
        fields = _native.declare(
            graph_class,
            target,
            graph,
            graph_witness,
            range_digest,
            list(fork),
            list(class_dims),
            strict,
            lora_bucket,
            literal_values,
            list(placement),
        )
        fields["graph_class"] = fields.pop("name")
        object.__setattr__(self, "_fields", fields)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("GraphClassDeclaration is immutable")

    @property
    def graph_class(self) -> str:
        """The display name (also the package entry name)."""
        return str(self._fields["graph_class"])

    @property
    def target(self) -> str:
        """The target label."""
        return str(self._fields["target"])

    @property
    def graph(self) -> dict[str, Any]:
        """A copy of the canonical graph interface."""
        graph: dict[str, Any] = _copy(self._fields["graph"])
        return graph

    @property
    def graph_witness(self) -> str:
        """The 16-hex witness of the program's canonical lines."""
        return str(self._fields["graph_witness"])

    @property
    def range_digest(self) -> str:
        """The 32-hex range digest."""
        return str(self._fields["range_digest"])

    @property
    def fork(self) -> tuple[tuple[str, Any], ...]:
        """Canonical fork pairs."""
        return tuple((n, _copy(v)) for n, v in self._fields["fork"])

    @property
    def class_dims(self) -> tuple[tuple[str, int], ...]:
        """Canonical class dims."""
        return tuple((n, v) for n, v in self._fields["class_dims"])

    @property
    def strict(self) -> bool:
        """Strictness."""
        return bool(self._fields["strict"])

    @property
    def lora_bucket(self) -> int:
        """LoRA bucket."""
        return int(self._fields["lora_bucket"])

    @property
    def literal_values(self) -> str:
        """``""`` or the 32-hex literal digest."""
        return str(self._fields["literal_values"])

    @property
    def placement(self) -> tuple[str, ...]:
        """Canonical placement: empty, or two or more devices."""
        return tuple(self._fields["placement"])

    @property
    def class_hash(self) -> str:
        """The facts-v3 class hash: the ``graph`` axis of the key."""
        return str(self._fields["class_hash"])

    def facts(self) -> dict[str, Any]:
        """The facts-v3 object whose hash is :attr:`class_hash`."""
        facts: dict[str, Any] = _copy(self._fields["facts"])
        return facts

    def to_dict(self) -> dict[str, Any]:
        """The canonical fields, as passed back to the native core."""
        return {name: _copy(self._fields[name]) for name in _FIELDS}

    def key(self, *, sm: str, toolchain: Mapping[str, object]) -> CompiledGraphKey:
        """The key of this class compiled for ``sm`` by the ``toolchain`` block."""
        return CompiledGraphKey.for_declaration(self, sm=sm, toolchain=toolchain)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraphClassDeclaration):
            return NotImplemented
        return bool(self._fields == other._fields)

    def __hash__(self) -> int:
        return hash((self.class_hash, self.graph_class))

    def __repr__(self) -> str:
        return (
            f"GraphClassDeclaration(graph_class={self.graph_class!r}, target={self.target!r}, "
            f"class_hash={self.class_hash!r})"
        )


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
