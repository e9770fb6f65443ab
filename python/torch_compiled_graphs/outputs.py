"""Structured outputs of a loaded graph, read by field name (imports neither torch nor a model library).

Models of transformers and diffusers return dataclass-like outputs
(``ModelOutput``, ``BaseOutput``) registered as pytree nodes. Their exported
output spec names the class (``transformers.modeling_outputs.CausalLMOutputWithPast``)
and, as the node's context, the fields that were set, in field order (fields that
were ``None`` are not in it). :class:`GraphOutput` is what the native path
returns for such a node, and what ``load()`` returns when the class itself
cannot be imported: a read-only mapping of those fields, in that order, that
also reads like the library's class (``out.logits``, ``out[0]``, ``out.to_tuple()``).

See docs/run.md, "Outputs".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, overload

__all__ = ["OUTPUT_FAMILIES", "GraphOutput", "is_output_record"]

#: The top-level packages whose registered output classes are read as records of
#: named fields; a node of any other registered type is not interpreted.
OUTPUT_FAMILIES = ("transformers", "diffusers")


def is_output_record(type_name: str) -> bool:
    """Whether a treespec node of serialized type ``type_name`` is one of the output
    classes read by field name: a class of one of :data:`OUTPUT_FAMILIES` whose name
    says it is an output (``...Output``, ``...OutputWithPast``, ``ModelOutput``)."""
    package, _, rest = type_name.partition(".")
    class_name = rest.rpartition(".")[2]
    return package in OUTPUT_FAMILIES and bool(rest) and "Output" in class_name


class GraphOutput(Mapping[str, Any]):
    """A read-only record of a graph's named outputs, in field order.

    ``type_name`` is the serialized name of the class the exported model returned.
    Read a field as ``out["sample"]`` or ``out.sample``, by position as ``out[0]``
    (or a slice), like the model library's own class; ``to_tuple()`` gives the values
    in order. Iterating gives the field names, as for a ``dict``.
    """

    __slots__ = ("_fields", "_type_name")
    _fields: dict[str, Any]
    _type_name: str

    def __init__(self, type_name: str, fields: Sequence[str], values: Sequence[Any]) -> None:
        names = list(fields)
        if len(names) != len(values) or len(set(names)) != len(names):
            raise ValueError(f"{type_name}: fields {names} do not name {len(values)} distinct values")
        object.__setattr__(self, "_type_name", str(type_name))
        object.__setattr__(self, "_fields", dict(zip(names, values, strict=True)))

    @property
    def type_name(self) -> str:
        """The serialized type name of the exported output class."""
        return self._type_name

    @overload
    def __getitem__(self, key: str | int) -> Any: ...
    @overload
    def __getitem__(self, key: slice) -> tuple[Any, ...]: ...
    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            return self._fields[key]
        if isinstance(key, (int, slice)) and not isinstance(key, bool):
            return self.to_tuple()[key]
        raise TypeError(f"{self._type_name} fields are read by name, index or slice, not {type(key).__qualname__}")

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the fields, then an AttributeError.
        fields = object.__getattribute__(self, "_fields")
        try:
            return fields[name]
        except KeyError:
            raise AttributeError(
                f"{object.__getattribute__(self, '_type_name')} has no field {name!r} (fields: {list(fields)})"
            ) from None

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{self._type_name} is read-only")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{self._type_name} is read-only")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def to_tuple(self) -> tuple[Any, ...]:
        """The field values in field order."""
        return tuple(self._fields.values())

    def __reduce__(self) -> tuple[type, tuple[str, list[str], tuple[Any, ...]]]:
        return (type(self), (self._type_name, list(self._fields), self.to_tuple()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"GraphOutput({self._type_name}: {inner})"
