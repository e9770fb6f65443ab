"""Declaring a graph class from a ``torch.export.ExportedProgram`` (SPEC-v1 §3.7 to §3.10).

This is the torch adapter's half of identity. It renders only what needs torch
(the canonical lines of the program, literal rows of raw bytes, placement,
constant names and the call ingress object) and hands plain data to the
native core, which validates, joins and hashes every value. Nothing here
re-implements a digest.

torch is imported lazily inside functions: importing this module never
imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import CompiledGraphError, DeclarationError
from .identity import GraphClassDeclaration

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = [
    "GraphClassSpec",
    "call_ingress",
    "canonical_lines",
    "constant_fqns",
    "graph_interface",
    "literal_names",
    "literal_rows",
    "placement",
]

#: Line 0 of every canonical rendering.
_HEADER = "v=1 ir=export"


# --------------------------------------------------------------------------- program check


def _require_program(program: object) -> ExportedProgram:
    try:
        from torch.export import ExportedProgram
    except ImportError as exc:  # pragma: no cover - torch is a declared extra
        raise DeclarationError(f"declaring a graph class needs torch: {exc}", "declaration.program_invalid") from exc
    if not isinstance(program, ExportedProgram):
        raise DeclarationError(
            f"a graph class needs a torch.export.ExportedProgram, got {type(program).__module__}."
            f"{type(program).__qualname__}",
            "declaration.program_invalid",
        )
    return program


# --------------------------------------------------------------------------- canonical lines (§3.7)


class _Symbols:
    """The one symbol table shared by every line: sympy symbol text -> ``S<n>``."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def canonical(self, text: str) -> str:
        name = self.names.get(text)
        if name is None:
            name = f"S{len(self.names)}"
            self.names[text] = name
        return name


def _sym(value: Any, table: _Symbols) -> str:
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None) if node is not None else None
    if expr is None:
        return str(value)
    free = getattr(expr, "free_symbols", None)
    if not free:
        return str(expr)
    rendered = str(expr)
    for text in sorted({str(s) for s in free}, key=lambda t: (-len(t), t)):
        rendered = rendered.replace(text, table.canonical(text))
    return rendered


def _scalar(value: Any) -> str:
    import torch

    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.device):
        return str(value).split(":", 1)[0]
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, (int, str, bytes)):
        return repr(value)
    if isinstance(value, slice):
        return f"slice({value.start!r},{value.stop!r},{value.step!r})"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _dims(tensor: Any, table: _Symbols) -> str:
    return ",".join(_sym(d, table) for d in tensor.shape)


def _is_sym(value: Any) -> bool:
    import torch

    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _arg(value: Any, index: Mapping[Any, int], table: _Symbols) -> str:
    import torch

    if isinstance(value, torch.fx.Node):
        position = index.get(value)
        return "%?" if position is None else f"%{position}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_arg(v, index, table) for v in value) + ")"
    if isinstance(value, dict):
        items = sorted(((repr(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        return "{" + ",".join(f"{k}:{_arg(v, index, table)}" for k, v in items) + "}"
    if isinstance(value, torch.Tensor):
        return f"t({value.dtype}|[{_dims(value, table)}])"
    if _is_sym(value):
        return f"sym({_sym(value, table)})"
    return _scalar(value)


def _val(value: Any, table: _Symbols) -> str:
    import torch

    if value is None:
        return "-"
    if isinstance(value, torch.Tensor):
        return f"t({value.dtype}|[{_dims(value, table)}]|{value.device.type})"
    if _is_sym(value):
        return f"sym({_sym(value, table)})"
    if isinstance(value, list):
        return "[" + ",".join(_val(v, table) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ",".join(_val(v, table) for v in value) + ")"
    if isinstance(value, dict):
        items = sorted(((repr(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        return "{" + ",".join(f"{k}:{_val(v, table)}" for k, v in items) + "}"
    return _scalar(value)


_META_KEYS = ("val", "example_value", "tensor_meta")


def _meta_value(node: Any) -> tuple[bool, Any]:
    for key in _META_KEYS:
        if key in node.meta:
            return True, node.meta[key]
    return False, None


def _target(node: Any) -> str:
    if node.op == "placeholder":
        return ""
    if node.op in ("call_method", "get_attr", "output"):
        return str(node.target)
    module = getattr(node.target, "__module__", None)
    qualname = getattr(node.target, "__qualname__", None)
    if module and qualname:
        return f"{module}.{qualname}"
    return str(node.target)


def _bound(value: Any) -> str:
    if value is None:
        return "oo"
    try:
        return str(int(value))
    except Exception:  # sympy infinities raise TypeError or AttributeError
        return str(value).replace("+", "")


def _node_lines(program: ExportedProgram, table: _Symbols) -> list[str]:
    nodes = list(program.graph_module.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    lines = []
    for i, node in enumerate(nodes):
        args = ",".join(_arg(a, index, table) for a in node.args)
        kwargs = ",".join(f"{k}={_arg(node.kwargs[k], index, table)}" for k in sorted(node.kwargs))
        present, value = _meta_value(node)
        rendered = _val(value, table) if present else "-"
        ph = f"arg{i}" if node.op == "placeholder" else ""
        lines.append(f"node {i} {node.op} {_target(node)} {ph} args=({args}) kwargs=({kwargs}) val={rendered}")
    return lines


def canonical_lines(program: object) -> list[str]:
    """The canonical lines of ``program`` (SPEC-v1 §3.7), byte-exact.

    The native core joins them with LF and hashes them into the graph witness.
    Weight values and strides never enter; parameters appear only as
    placeholders with dtype and shape.
    """
    program = _require_program(program)
    table = _Symbols()
    lines = [_HEADER, *_node_lines(program, table)]
    ranges = []
    for symbol, value_range in program.range_constraints.items():
        name = table.names.get(str(symbol))
        if name is not None:
            lower = _bound(getattr(value_range, "lower", None))
            upper = _bound(getattr(value_range, "upper", None))
            ranges.append(f"sym {name} range=[{lower},{upper}]")
    lines.extend(sorted(ranges))
    signature = program.graph_signature
    for direction, specs in (("in", signature.input_specs), ("out", signature.output_specs)):
        for i, spec in enumerate(specs):
            target = spec.target or "-"
            lines.append(f"sig {direction} {i} kind={spec.kind.name} target={target}")
    for direction, attribute in (("in", "_in_spec"), ("out", "_out_spec")):
        tree_spec = getattr(program, attribute, None)
        if tree_spec is not None:
            lines.append(f"spec {direction} {tree_spec}".replace("\n", " "))
    return lines


# --------------------------------------------------------------------------- constants (§3.8, §3.10)


def _signature_names(program: ExportedProgram, attribute: str) -> set[str]:
    return {str(name) for name in getattr(program.graph_signature, attribute, ()) or ()}


def constant_fqns(program: object) -> list[str]:
    """Sorted union of parameters, buffers, lifted_tensor_constants and constants.keys() (§3.10)."""
    program = _require_program(program)
    names = _signature_names(program, "parameters") | _signature_names(program, "buffers")
    names |= _signature_names(program, "lifted_tensor_constants")
    names |= {str(name) for name in program.constants}
    return sorted(names)


def literal_names(program: object) -> list[str]:
    """Literal names: lifted_tensor_constants and constants.keys(), less parameters and buffers (§3.8)."""
    program = _require_program(program)
    state = _signature_names(program, "parameters") | _signature_names(program, "buffers")
    names = _signature_names(program, "lifted_tensor_constants") | {str(n) for n in program.constants}
    return sorted(names - state)


def tensor_bytes(tensor: Any) -> bytes:
    """The element bytes of a detached, CPU, contiguous copy of ``tensor`` (little-endian host)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return bytes(flat.numpy().tobytes())


def literal_rows(program: object) -> list[tuple[str, str, list[int], bytes]]:
    """One ``(name, torch dtype text, shape, raw bytes)`` row per literal, sorted by name (§3.8).

    A literal without a value, or one that cannot be read, is refused
    (``declaration.literal_unreadable``).
    """
    import torch

    program = _require_program(program)
    rows = []
    for name in literal_names(program):
        value = program.constants.get(name)
        if not isinstance(value, torch.Tensor):
            raise DeclarationError(
                f"literal constant {name!r} has no tensor value (found {type(value).__qualname__})",
                "declaration.literal_unreadable",
            )
        try:
            raw = tensor_bytes(value)
        except Exception as exc:
            raise DeclarationError(
                f"literal constant {name!r} cannot be read: {type(exc).__name__}: {exc}",
                "declaration.literal_unreadable",
            ) from exc
        rows.append((name, str(value.dtype), [int(d) for d in value.shape], raw))
    return rows


def placement(program: object) -> list[str]:
    """Every device the graph touches, sorted and unique (§3.10); callers omit a single entry."""
    import torch

    program = _require_program(program)
    devices: set[str] = set()

    def note(value: Any) -> None:
        if isinstance(value, torch.device):
            devices.add(value.type if value.index is None else f"{value.type}:{value.index}")
        elif isinstance(value, torch.Tensor):
            note(value.device)
        elif isinstance(value, (list, tuple)):
            for item in value:
                note(item)
        elif isinstance(value, dict):
            for item in value.values():
                note(item)

    for node in program.graph_module.graph.nodes:
        present, value = _meta_value(node)
        if present:
            note(value)
        note(node.args)
        note(node.kwargs)
    return sorted(devices)


# --------------------------------------------------------------------------- derived interface (§3.9)


def user_input_nodes(program: ExportedProgram, error: type[CompiledGraphError], code: str) -> list[Any]:
    """The placeholders of the program's user inputs, in order.

    A graph whose placeholders do not pair with its signature's input specs is
    refused with ``error(…, code)``: the declaration and the compiler each name
    their own code for it.
    """
    from torch.export.graph_signature import InputKind

    placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    specs = program.graph_signature.input_specs
    if len(placeholders) != len(specs):
        raise error(
            f"program signature lists {len(specs)} inputs but the graph has {len(placeholders)} placeholders",
            code,
        )
    return [node for node, spec in zip(placeholders, specs, strict=True) if spec.kind == InputKind.USER_INPUT]


def _call_signature(program: ExportedProgram) -> tuple[Any, Any, list[str]]:
    """``(in_spec, out_spec, forward_arg_names)`` of the program's root call."""
    graph = program.module_call_graph
    if not graph or graph[0].signature is None:
        raise DeclarationError(
            "program has no root call signature (module_call_graph[0].signature)",
            "declaration.program_invalid",
        )
    signature = graph[0].signature
    names = list(getattr(signature, "forward_arg_names", None) or [])
    return signature.in_spec, signature.out_spec, names


def _key_text(entry: Any) -> str | int:
    """A pytree key entry as an ingress path step: a mapping key or a sequence index."""
    from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey

    if isinstance(entry, SequenceKey):
        return int(entry.idx)
    if isinstance(entry, MappingKey):
        return str(entry.key)
    if isinstance(entry, GetAttrKey):
        return str(entry.name)
    return str(entry)


def call_ingress(program: object) -> dict[str, Any]:
    """The call ingress object of ``program``'s user inputs (SPEC-v1 §3.9).

    Built here because it needs torch; validated and hashed only by the native
    core (:func:`torch_compiled_graphs.identity.ingress_digest`). Symbols are
    named like the witness (``S0``, ``S1`` … in order of first appearance in
    the canonical lines) and carry their range-constraint bounds.
    """
    import torch
    from torch.utils._pytree import tree_flatten_with_path

    program = _require_program(program)
    in_spec, _, arg_names = _call_signature(program)
    table = _Symbols()
    _node_lines(program, table)  # fills the table with the witness's numbering
    user_nodes = user_input_nodes(program, DeclarationError, "declaration.program_invalid")
    leaves = in_spec.num_leaves
    # Rebuild the structure with positions as leaves to learn each leaf's path.
    tree = torch.utils._pytree.tree_unflatten(list(range(leaves)), in_spec)
    paths, _ = tree_flatten_with_path(tree)
    if len(paths) != len(user_nodes):
        raise DeclarationError(
            f"program's in_spec has {len(paths)} leaves but {len(user_nodes)} user inputs",
            "declaration.program_invalid",
        )
    parameters: list[str] = []
    rows: list[dict[str, Any]] = []
    used: set[str] = set()
    excluded: set[str] = set()
    for (path, position), node in zip(paths, user_nodes, strict=True):
        steps = [_key_text(e) for e in path]
        # steps[0] is 0 (positional args) or 1 (kwargs); steps[1] the arg index or name.
        if len(steps) < 2:
            raise DeclarationError(f"unexpected input path {steps!r}", "declaration.program_invalid")
        group, head, rest = steps[0], steps[1], steps[2:]
        if group == 0 and isinstance(head, int):
            param = arg_names[head] if head < len(arg_names) else f"arg{head}"
        else:
            param = str(head)
        if param not in parameters:
            parameters.append(param)
        name = param
        for step in rest:
            name = step if isinstance(step, str) else f"{name}.{step}"
        exported = "_".join([param, *(str(s) for s in rest)])
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            shape: list[int | str] = []
            for d in value.shape:
                text = _sym(d, table)
                if text.isdigit():
                    shape.append(int(text))
                else:
                    shape.append(text)
                    used.add(text)
        else:
            # A non-tensor leaf (an int, float, bool or string the export specialised on) is
            # not an ingress input; it is recorded by name as excluded.
            excluded.add(name)
            continue
        rows.append(
            {
                "name": name,
                "position": int(position),
                "param": param,
                "param_position": parameters.index(param),
                "path": rest,
                "exported_name": exported,
                "dtype": dtype,
                "shape": shape,
            }
        )
    symbols: dict[str, list[int]] = {}
    for symbol, value_range in program.range_constraints.items():
        canonical = table.names.get(str(symbol))
        if canonical in used:
            symbols[canonical] = [_int_bound(value_range.lower), _int_bound(value_range.upper)]
    return {
        "v": _native.CALL_INGRESS_VERSION,
        "parameters": parameters,
        "flat_arity": int(leaves),
        "inputs": rows,
        "symbols": symbols,
        "excluded_inputs": sorted(excluded),
    }


def _int_bound(value: Any) -> int:
    """A range bound as an integer; unbounded ends are refused by the ingress rules."""
    try:
        return int(value)
    except Exception as exc:  # sympy infinities raise TypeError or AttributeError
        raise DeclarationError(
            f"dynamic dimension bound {value} is not finite; give the Dim an explicit max or state a range_digest",
            "declaration.ingress_invalid",
        ) from exc


def graph_interface(
    program: object, ingress: Mapping[str, Any] | None = None, *, with_ingress: bool = True
) -> dict[str, Any]:
    """The derived graph interface (SPEC-v1 §3.6 rule 3) of ``program``.

    ``{"v": 3, "constant_fqns", "lifted_inputs", "pytree": {"in", "out", "ingress"},
    "specialization": {}}``; ``pytree.ingress`` is omitted when ``with_ingress`` is
    false. See docs/compile-policy.md ("Declaration").
    """
    program = _require_program(program)
    in_spec, out_spec, _ = _call_signature(program)
    pytree: dict[str, Any] = {"in": _spec_text(in_spec), "out": _spec_text(out_spec)}
    if with_ingress:
        pytree["ingress"] = dict(ingress) if ingress is not None else call_ingress(program)
    return {
        "v": _native.GRAPH_FACTS_VERSION,
        "constant_fqns": constant_fqns(program),
        # Call inputs that carry lifted module state (LoRA factors passed as inputs, say) are
        # known only to the caller, who states them in ``graph``; a derived interface has none.
        "lifted_inputs": [],
        "pytree": pytree,
        "specialization": {},
    }


def _spec_text(tree_spec: Any) -> str:
    """A tree spec as torch's serialised JSON (``treespec_dumps``), else its one-line text."""
    from torch.utils._pytree import treespec_dumps

    try:
        return str(treespec_dumps(tree_spec))
    except Exception:  # a node type without a serialisation name
        return " ".join(str(tree_spec).split())


# --------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class GraphClassSpec:
    """An exported program plus the caller facts that select its compiled graph.

    ``graph`` and ``range_digest`` are optional. With neither, the graph
    interface is derived from the program with its call ingress and
    ``range_digest`` is the ingress digest. A stated ``range_digest`` is opaque:
    a derived interface then carries no ingress. A stated ``graph`` is copied, never
    mutated; its ``constant_fqns`` and ``literal_values`` are filled in from the
    program or checked against it.
    """

    graph_class: str
    target: str
    program: Any
    graph: Mapping[str, Any] | None = None
    range_digest: str | None = None
    fork: Iterable[tuple[object, object]] = ()
    class_dims: Iterable[tuple[object, int]] = ()
    strict: bool = True
    lora_bucket: int = 0

    def declare(self) -> GraphClassDeclaration:
        """Render, derive and validate: the canonical declaration (SPEC-v1 §3.6 to §3.10)."""
        program = _require_program(self.program)
        witness = _native.graph_witness(canonical_lines(program))
        fqns = constant_fqns(program)
        rows = literal_rows(program)
        literals = _native.literal_digest(rows) if rows else ""
        devices = placement(program)

        if self.graph is None and self.range_digest is None:
            # The adapter derives the call ingress, places it and takes its digest (§3.9).
            ingress = call_ingress(program)
            graph: dict[str, Any] = graph_interface(program, ingress)
            range_digest = _native.ingress_digest(ingress)
        elif self.graph is None:
            # A caller-stated range digest is opaque: no ingress is derived or placed.
            graph = graph_interface(program, with_ingress=False)
            range_digest = str(self.range_digest)
        else:
            if not isinstance(self.graph, Mapping):
                raise DeclarationError(
                    f"graph must be an object, got {type(self.graph).__qualname__}",
                    "declaration.graph_invalid",
                )
            graph = _deep_copy(self.graph)
            if self.range_digest is None:
                pytree = graph.get("pytree")
                ingress_value = pytree.get("ingress") if isinstance(pytree, dict) else None
                if ingress_value is None:
                    ingress_value = call_ingress(program)
                range_digest = _native.ingress_digest(ingress_value)
            else:
                range_digest = self.range_digest

        stated = graph.get("constant_fqns")
        if stated is not None and stated != fqns:
            raise DeclarationError(
                f"graph.constant_fqns {stated!r} does not match the program's constants {fqns!r}",
                "declaration.constant_fqns_mismatch",
            )
        graph["constant_fqns"] = fqns

        stated_literals = graph.get("literal_values")
        if stated_literals is not None and stated_literals != literals:
            detail = "the program has no literals" if not literals else f"the program's is {literals}"
            raise DeclarationError(
                f"graph.literal_values {stated_literals!r} does not match: {detail}",
                "declaration.literal_values_mismatch",
            )
        if literals:
            graph["literal_values"] = literals

        return GraphClassDeclaration(
            self.graph_class,
            self.target,
            graph,
            witness,
            range_digest,
            fork=self.fork,
            class_dims=self.class_dims,
            strict=self.strict,
            lora_bucket=self.lora_bucket,
            literal_values=literals,
            placement=devices if len(devices) >= 2 else (),
        )


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep_copy(v) for v in value]
    return value
