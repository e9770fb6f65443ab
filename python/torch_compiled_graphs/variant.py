"""Graph variants: today's (``default``) and the libtorch-free ``shim-v1`` (issue 34, item 1).

A variant is a compile policy (:func:`~torch_compiled_graphs.compile.policy_of`). It
enters the key through the toolchain block's ``settings_declaration`` member, so the
two variants of one graph have different keys and a worker gets exactly the one its
declared toolchain names (docs/keys.md, "Variants").

The mint of ``shim-v1`` reads the compiled ``.so``'s imports
(:func:`_native.package_shim_imports`) and judges them against shim set v1
(:func:`_native.shim_set_v1_missing`) before anything is published: a graph that needs
more is refused (``compile.variant_refused``) with the ops named. The imports are not
recorded in the mint record (a closed schema, docs/shim.md): they are a pure function of
the verified ``.so`` and are read on demand (``StoredCompiledGraph.shim_imports``).

Nothing here imports torch at module level.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import _native
from .errors import CompileError, DeclarationError

__all__ = [
    "DEFAULT_VARIANT",
    "SHIM_V1",
    "VARIANTS",
    "check_request",
    "judge_package",
    "no_kernel_ops",
    "refusal",
    "refusal_names",
]

#: Today's variant: the default compile policy, served through libtorch.
DEFAULT_VARIANT = "default"
#: The libtorch-free variant whose ``.so`` imports only shim set v1.
SHIM_V1 = "shim-v1"
#: Every variant, by name.
VARIANTS = (DEFAULT_VARIANT, SHIM_V1)

_SHIM_PREFIXES = ("aoti_torch_cpu_", "aoti_torch_cuda_")
_PROXY = "aoti_torch_proxy_executor_call_function"
_DISPATCHER = "aoti_torch_call_dispatcher"


def check_request(variant: object, toolchain: Mapping[str, object]) -> str:
    """The variant asked for, checked against the toolchain block it is asked under.

    The block's ``settings_declaration`` is what the key holds, so it must name this
    variant's policy: ``shim-v1`` needs the digest :func:`record_toolchain(variant=...)
    <torch_compiled_graphs.record_toolchain>` records (``declaration.variant_mismatch``
    otherwise: the key would name another variant than the one compiled); ``default``
    refuses a block that names another variant's policy and accepts any other block (a
    caller's own, as before variants existed). An unknown name is
    ``declaration.variant_unknown``.
    """
    from .toolchain import settings_digest, variant_of_block

    if not isinstance(variant, str) or variant not in VARIANTS:
        raise DeclarationError(
            f"unknown graph variant {variant!r}; the variants are {', '.join(map(repr, VARIANTS))}",
            "declaration.variant_unknown",
        )
    named = variant_of_block(toolchain)
    if variant == DEFAULT_VARIANT:
        if named is not None and named != DEFAULT_VARIANT:
            raise DeclarationError(
                f"the toolchain block's settings_declaration names the {named} variant's policy, but "
                f"variant={DEFAULT_VARIANT!r} was asked for; pass variant={named!r}, or derive the key "
                "under record_toolchain()",
                "declaration.variant_mismatch",
            )
        return variant
    wanted = settings_digest(variant)
    if toolchain.get("settings_declaration") != wanted:
        raise DeclarationError(
            f"variant {variant!r} needs a toolchain block whose settings_declaration is {wanted} "
            f"(record_toolchain(variant={variant!r}) or variant_toolchain(block, {variant!r})), "
            f"got {toolchain.get('settings_declaration')!r}: the key would name another compile policy",
            "declaration.variant_mismatch",
        )
    return variant


def _aten_name(rest: str) -> str:
    """``addmm_out`` -> ``aten.addmm``, ``convolution`` -> ``aten.convolution``.

    The C shim of an op is ``aoti_torch_<device>_<op>[_<overload>]``; an ``_out`` suffix is
    the out-variant of the op. The name is checked against ``torch.ops.aten`` where torch
    is importable (it is, at mint); otherwise it is read as written.
    """
    candidates = [rest.removesuffix("_out"), rest] if rest.endswith("_out") else [rest]
    try:
        import torch

        for name in candidates:
            if hasattr(torch.ops.aten, name):
                return f"aten.{name}"
        head, _, overload = rest.rpartition("_")
        if head and hasattr(torch.ops.aten, head) and overload:
            return f"aten.{head}.{overload}"
    except ImportError:  # pragma: no cover - the mint always has torch
        pass
    return f"aten.{candidates[0]}"


def refusal_names(missing: list[str], calls: list[dict[str, object]]) -> list[str]:
    """One readable name per import shim set v1 lacks: the aten op of an op-specific
    extern (``aten.addmm (aoti_torch_cpu_addmm_out)``), the operators behind the proxy
    executor or the dispatcher (from the package's extern-kernel table), or the symbol
    with the library it comes from."""
    names: list[str] = []
    for symbol in missing:
        if symbol.startswith(_SHIM_PREFIXES):
            rest = symbol.removeprefix("aoti_torch_cpu_").removeprefix("aoti_torch_cuda_")
            names.append(f"{_aten_name(rest)} ({symbol})")
        elif symbol in (_PROXY, _DISPATCHER):
            targets = sorted({str(c["target"]) for c in calls if c.get("call") == symbol})
            ops = ", ".join(targets) if targets else "an operator the extern-kernel table does not name"
            names.append(f"{ops} ({symbol})")
        elif symbol.startswith("aoti_torch_"):
            names.append(f"{symbol} (a libtorch C shim function outside shim set v1)")
        elif symbol.startswith(("GOMP_", "omp_")):
            names.append(f"{symbol} (the OpenMP runtime)")
        elif symbol.startswith("Sleef_"):
            names.append(f"{symbol} (SLEEF vector math, carried by libtorch)")
        elif symbol.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch")):
            names.append(f"{symbol} (a libtorch C++ API symbol)")
        else:
            names.append(f"{symbol} (a library outside the system libraries)")
    return names


def judge_package(package: str | os.PathLike[str], entry: str, variant: str) -> dict[str, list[str]]:
    """The imports of ``entry``'s ``.so``, judged for ``variant``; raises when it cannot be that variant.

    For ``default`` nothing is judged. For ``shim-v1`` every import must be in shim set v1
    and none may come from outside the system libraries; otherwise ``CompileError``
    ``compile.variant_refused`` names each op the graph needs and says to mint the
    default variant. Returns the imports (``{"aoti_torch", "other"}``).
    """
    imports: dict[str, list[str]] = _native.package_shim_imports(os.fspath(package), entry)
    if variant == DEFAULT_VARIANT:
        return imports
    missing = _native.shim_set_v1_missing(imports["aoti_torch"], imports["other"])
    if missing:
        calls = _native.package_native_calls(os.fspath(package)) if {_PROXY, _DISPATCHER} & set(missing) else []
        raise refusal(entry, variant, refusal_names(missing, calls))
    return imports


def refusal(entry: str, variant: str, names: list[str]) -> CompileError:
    """``compile.variant_refused`` for graph class ``entry``, naming what its code needs."""
    return CompileError(
        f"graph class {entry!r} cannot be minted as the libtorch-free variant {variant}: its compiled code "
        f"needs {'; '.join(names)}, which {_native.SHIM_SET_V1} does not provide (docs/shim.md); nothing "
        f"was published. Mint the default variant (variant={DEFAULT_VARIANT!r}, under record_toolchain()) "
        "to serve this graph through libtorch",
        "compile.variant_refused",
    )


#: What :func:`no_kernel_ops` names when inductor's error names no target.
UNNAMED_NO_KERNEL_OP = "an operator inductor names no target for (NoValidChoicesError)"


def no_kernel_ops(exc: BaseException) -> list[str] | None:
    """The ops inductor found no kernel for under a variant's backends, or ``None``.

    A variant leaves only template backends for GEMMs and convolutions
    (``max_autotune_gemm_backends``: ``TRITON`` on CUDA, ``CPP`` on the CPU;
    ``max_autotune_conv_backends``: ``TRITON``; never ``ATEN``). Where no template applies
    (torch's C++ GEMM template takes only a prepacked constant weight, which a code-only
    artifact cannot hold; a Triton template may not cover a shape or dtype), inductor
    raises ``NoValidChoicesError`` inside its lowering instead of emitting an extern: the
    graph needs an op the variant cannot carry. The lowering's message names it
    (``target: aten.addmm.default``): ``aten.addmm (no kernel of the variant's GEMM
    backends: NoValidChoicesError)``.
    """
    import re

    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    if not any("NoValidChoicesError" in type(e).__name__ or "NoValidChoicesError" in str(e) for e in seen):
        return None
    ops: list[str] = []
    for e in seen:
        for target in re.findall(r"target: ([A-Za-z_][\w.:]*)", str(e)):
            op = target.removesuffix(".default")
            name = f"{op} (no kernel of the variant's template backends: NoValidChoicesError)"
            if name not in ops:
                ops.append(name)
    return ops or [UNNAMED_NO_KERNEL_OP]
