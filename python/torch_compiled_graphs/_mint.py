"""The miss path of ``Engine.ensure`` on the Python side (imports torch).

The native engine calls :func:`mint_for_engine` at most once per miss, while
it holds the key's single-flight lock. This function runs the caller's recipe,
the runtime checks, the sole compile policy and the parity check (the compiled
graph against the exported program on its example inputs), and hands back
plain data: the package, the declaration, the runtime facts, the literal
values and the parity figures. Packing,
verification and publication happen in the native core.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import _parity
from .errors import AdmissionError, DeclarationError


def mint_for_engine(
    key: str,
    recipe: Callable[[], Any],
    target: str,
    toolchain: Mapping[str, object],
    workdir: Path,
    variant: str = "default",
) -> dict[str, Any]:
    """Compile the graph class ``recipe()`` describes, for ``key``, into ``workdir``.

    ``variant`` picks the compile policy; a ``shim-v1`` mint whose ``.so`` imports more
    than shim set v1 is refused here (``compile.variant_refused``), after the compile and
    before the parity check, so nothing is published (docs/keys.md, "Variants").
    """
    from .artifact import constant_table
    from .compile import compile_package, literal_tensors
    from .declaration import GraphClassSpec, canonical_lines, tensor_bytes
    from .runtime import RuntimeCompatibility
    from .variant import judge_package

    spec = recipe()
    if not isinstance(spec, GraphClassSpec):
        raise DeclarationError(
            f"the recipe must return a GraphClassSpec, got {type(spec).__qualname__}",
            "declaration.program_invalid",
        )
    runtime = RuntimeCompatibility(target, toolchain=toolchain)
    declaration = spec.declare()
    derived = runtime.key(declaration)
    if derived != key:
        raise AdmissionError(
            f"lazy recipe derives {derived}, not requested key {key!r}", "admission.recipe_key_mismatch"
        )
    package = compile_package(spec, declaration.graph_class, runtime, workdir, variant=variant)
    if variant != "default":
        # A default mint reads nothing more than it did before variants existed.
        judge_package(package, declaration.graph_class, variant)
    if spec.declare() != declaration:
        raise AdmissionError("exported program changed during compilation or packaging", "admission.program_mutated")
    literal_rows = [row for row in constant_table(package) if row["source"] == "literal"]
    tensors = literal_tensors(spec.program, literal_rows)
    literals = [
        (fqn, str(t.dtype).removeprefix("torch."), [int(d) for d in t.shape], tensor_bytes(t))
        for fqn, t in tensors.items()
    ]
    # Never publish a wrong graph: the compiled graph against the exported program, once, on
    # the program's example inputs (docs/engine.md, "Parity at mint").
    parity = _parity.check_parity(spec.program, package, declaration.graph_class)
    # The parity runs may not change the program either (its literal values, its graph).
    if spec.declare() != declaration:
        raise AdmissionError("exported program changed during the parity check", "admission.program_mutated")
    return {
        "package": os.fspath(package),
        "declaration": declaration.to_dict(),
        "sm": runtime.sm,
        "toolchain": runtime.toolchain,
        "host_isa": runtime.host_isa,
        "literals": literals,
        # Kept beside the artifact so that a later miss can show the first differing lines.
        "witness_lines": canonical_lines(spec.program),
        # The weights contract's facts, written into the package annex.
        "weights": weight_facts(spec.program, list(declaration.graph["constant_fqns"])),
        # The parity block of the mint record (in the package, not in the metadata or the key).
        "parity": parity,
    }


def weight_facts(program: Any, declared: list[str]) -> dict[str, Any]:
    """What the exported program knows about each declared constant: its kind
    and the names that share its storage (tied weights)."""
    import torch
    from torch.export.graph_signature import InputKind

    kinds: dict[str, str] = {}
    for spec in program.graph_signature.input_specs:
        if spec.target is None:
            continue
        if spec.kind == InputKind.PARAMETER:
            kinds[spec.target] = "parameter"
        elif spec.kind == InputKind.BUFFER:
            kinds[spec.target] = "buffer" if spec.persistent is not False else "non_persistent_buffer"
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            kinds[spec.target] = "constant"
    values: dict[str, Any] = {**dict(program.constants), **dict(program.state_dict)}
    storage: dict[tuple[Any, ...], list[str]] = {}
    for name in declared:
        value = values.get(name)
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            key = (
                value.untyped_storage().data_ptr(),
                value.storage_offset(),
                tuple(value.shape),
                tuple(value.stride()),
                value.dtype,
                str(value.device),
            )
            storage.setdefault(key, []).append(name)
    groups = sorted(sorted(names) for names in storage.values() if len(names) > 1)
    return {"kinds": {name: kinds.get(name, "constant") for name in declared}, "alias_groups": groups}
