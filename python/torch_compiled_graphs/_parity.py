"""Parity at mint: the compiled graph against the exported program, on the program's example inputs.

Before anything is stored, :func:`check_parity` runs the freshly compiled
package once on ``program.example_inputs`` with the program's own weights and
constants bound, runs the exported program eagerly
(``program.module()(*args, **kwargs)``) once on the same inputs, and compares
the two outputs leaf by leaf over the output pytree with the tolerance of the
leaf's dtype (:data:`TOLERANCES`). A mismatch raises ``CompileError`` with
code ``mint.parity_failed`` and publishes nothing; what it measured goes into
the mint record (docs/engine.md, "Parity at mint"). torch is imported lazily.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import CompileError

__all__ = ["TOLERANCES", "check_parity", "compiled_runner", "run_compiled", "tolerance"]

#: ``(atol, rtol)`` by dtype. An element passes when
#: ``|compiled - eager| <= atol + rtol * |eager|`` (torch.testing's rule): each
#: element's bound depends on that element alone, so a huge value elsewhere in the
#: leaf (``finfo.min`` in a masked position) loosens nothing else. Non-finite
#: elements must be equal: NaN where eager has NaN, the same infinity. Integer,
#: unsigned and bool leaves must be equal exactly, compared in their own dtype
#: (never through a float). Complex leaves use their component dtype.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (5e-2, 5e-2),
    "float8_e4m3fn": (0.25, 0.25),
    "float8_e4m3fnuz": (0.25, 0.25),
    "float8_e5m2": (0.5, 0.5),
    "float8_e5m2fnuz": (0.5, 0.5),
    "float8_e8m0fnu": (1.0, 1.0),
    "complex128": (1e-7, 1e-7),
    "complex64": (1e-4, 1e-4),
    "complex32": (1e-2, 1e-2),
}


def tolerance(dtype: str) -> tuple[float, float]:
    """``(atol, rtol)`` for a dtype name such as ``float32``; ``(0, 0)`` (exact) for any other dtype."""
    return TOLERANCES.get(dtype, (0.0, 0.0))


def _unavailable(message: str) -> CompileError:
    return CompileError(f"parity check cannot run: {message}", "mint.parity_unavailable")


def run_compiled(
    package: str | os.PathLike[str], entry: str, constants: Mapping[str, Any], inputs: Sequence[Any], device_index: int
) -> list[Any]:
    """Load entry ``entry`` of ``package``, bind ``constants`` by fqn (a full update) and run it once on ``inputs``.

    The compiled side of the parity check (tests replace it to provoke a mismatch).
    It runs through torch's package loader, or, for a ``.so`` that carries its
    own C++ runtime (which crashes that loader), through the torch-free runner
    that ``load()`` uses for such a package (:func:`compiled_runner`).
    """
    import torch

    from . import _native
    from .errors import BindingError

    loader: Any
    try:
        if compiled_runner(package, entry) == "native":
            from ._native_loader import NativeLoader

            if device_index < 0:
                sm = _native.cpu_sm()
            else:
                major, minor = torch.cuda.get_device_capability(device_index)
                sm = f"sm_{major}{minor}"
            rows = _native.package_constant_table(os.fspath(package))
            loader = NativeLoader(package, entry, device_index, sm, rows)
        else:
            # (path, entry, run_single_threaded, num_runners, device_index): the positional
            # form torch 2.11 and 2.15 share, as in runner.py.
            from ._loadpath import torch_package_loader

            loader = torch_package_loader(torch, os.fspath(package), entry, False, device_index)
    except BindingError as exc:
        raise _unavailable(f"{exc} (the compiled graph cannot be run here to check it against eager)") from exc
    wanted = list(loader.get_constant_fqns())
    missing = [fqn for fqn in wanted if fqn not in constants]
    if missing:
        raise _unavailable(f"the program has no value for the compiled graph's constants {missing}")
    bound = {fqn: constants[fqn] for fqn in wanted}
    loader.load_constants(bound, False, True)
    from ._loadpath import input_strides, laid_out

    strides = input_strides(package)
    if strides is not None and len(strides) == len(inputs):
        inputs = [laid_out(t, s, f"input [{i}]") for i, (t, s) in enumerate(zip(inputs, strides, strict=True))]
    outputs = loader.boxed_run(list(inputs))
    return list(outputs)


def compiled_runner(package: str | os.PathLike[str], entry: str) -> str:
    """What runs the compiled side of the check: ``"native"`` (the torch-free runner) when
    the package's ``.so`` carries its own C++ runtime, else ``"torch"`` (torch's package
    loader). Recorded in the mint record as ``parity.runner``."""
    from . import _native
    from .errors import CompiledGraphError

    try:
        own = _native.package_own_cxx_runtime(os.fspath(package), entry)
    except CompiledGraphError as exc:  # a .so the ELF reader refuses (artifact.elf_invalid, ...)
        raise _unavailable(f"{exc} (the compiled graph cannot be loaded to check it against eager)") from exc
    return "native" if own else "torch"


def _clone(tree: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _device_index(flat: Sequence[Any]) -> int:
    import torch

    for x in flat:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return int(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return -1


def _program_constants(program: Any, device: Any) -> dict[str, Any]:
    import torch

    values: dict[str, Any] = {}
    for source in (program.constants, program.state_dict):
        for name, value in source.items():
            if isinstance(value, torch.Tensor):
                values[name] = value.detach().to(device).contiguous()
    return values


def _compare(path: str, expected: Any, actual: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The figures of one leaf, and a failure message when it differs beyond its tolerance."""
    import torch

    if not isinstance(expected, torch.Tensor):
        # A scalar output may come back from the compiled graph as a 0-d tensor.
        got = actual.item() if isinstance(actual, torch.Tensor) and actual.dim() == 0 else actual
        equal = not isinstance(got, torch.Tensor) and bool(expected == got)
        return None, None if equal else f"output {path or '<root>'}: eager {expected!r}, compiled {actual!r}"
    if not isinstance(actual, torch.Tensor):
        return None, f"output {path or '<root>'}: eager is a tensor, compiled is {type(actual).__qualname__}"
    dtype = str(expected.dtype).removeprefix("torch.")
    shape = [int(d) for d in expected.shape]
    got = str(actual.dtype).removeprefix("torch.")
    if got != dtype or [int(d) for d in actual.shape] != shape:
        return None, f"output {path or '<root>'}: eager is {dtype}{shape}, compiled is {got}{list(actual.shape)}"
    atol, rtol = tolerance(dtype)
    e = expected.detach()
    a = actual.detach().to(e.device)
    if int(e.numel()) == 0:
        return _leaf(path, dtype, shape, 0, 0.0, 0.0, atol, rtol), None
    if e.is_floating_point() or e.is_complex():
        return _compare_inexact(path, dtype, shape, e, a, atol, rtol)
    return _compare_exact(path, dtype, shape, e, a)


def _element(flat_index: int, shape: list[int]) -> list[int]:
    import torch

    return list(map(int, torch.unravel_index(torch.tensor(flat_index), tuple(shape)))) if shape else []


def _compare_inexact(
    path: str, dtype: str, shape: list[int], e: Any, a: Any, atol: float, rtol: float
) -> tuple[dict[str, Any], str | None]:
    import torch

    # Widened so that the difference of two float32 (or smaller) values is exact.
    wide = torch.complex128 if e.is_complex() else torch.float64
    ef, af = e.to(wide).reshape(-1), a.to(wide).reshape(-1)
    numel = int(ef.numel())
    magnitude = ef.abs()
    finite = torch.isfinite(ef) & torch.isfinite(af)
    same = (ef == af) | (torch.isnan(ef) & torch.isnan(af))
    diff = (af - ef).abs()
    allowed = atol + rtol * magnitude
    # A non-finite element passes only when equal (``same``); a finite one within its own bound.
    ok = same | (finite & (diff <= allowed))
    diff = torch.where(same, torch.zeros_like(diff), torch.where(finite, diff, torch.full_like(diff, float("inf"))))
    max_abs = float(diff.max())
    nonzero = magnitude > 0
    rel = torch.where(nonzero, diff / torch.where(nonzero, magnitude, torch.ones_like(magnitude)), diff)
    rel_max = float(rel[nonzero].max()) if bool(nonzero.any()) else 0.0
    leaf = _leaf(path, dtype, shape, numel, max_abs, rel_max, atol, rtol)
    bad = int((~ok).sum())
    if bad == 0:
        return leaf, None
    excess = torch.where(ok, torch.full_like(diff, -float("inf")), diff - allowed)
    excess = torch.nan_to_num(excess, nan=float("inf"))
    worst = int(torch.argmax(excess))
    err, bound = float(diff[worst]), float(allowed[worst])
    pick = complex if e.is_complex() else float
    eager_value, compiled_value = pick(ef[worst]), pick(af[worst])
    return leaf, (
        f"output {path or '<root>'} ({dtype}{shape}): max abs error {err:.6g} exceeds the allowed {bound:.6g} "
        f"at element {_element(worst, shape)} (eager {eager_value:.6g}, compiled {compiled_value:.6g}; "
        f"allowed = atol {atol:g} + rtol {rtol:g} x |eager|); "
        f"{bad} of {numel} elements outside; max abs error over the leaf {max_abs:.6g}, max rel error {rel_max:.6g}"
    )


def _as_words(x: Any) -> tuple[Any, Any]:
    """An integer tensor as exact ``(high, low)`` int64 halves: ``x == high * 2**32 + low``, ``0 <= low < 2**32``."""
    import torch

    if x.dtype == torch.uint64:
        # Reinterpreted bit for bit; the high half is then taken unsigned.
        bits = x.view(torch.int64)
        return (bits >> 32) & 0xFFFFFFFF, bits & 0xFFFFFFFF
    wide = x.to(torch.int64)  # exact for every other integer dtype and bool
    return wide >> 32, wide & 0xFFFFFFFF


def _python_int(high: Any, low: Any) -> int:
    return (int(high) << 32) + int(low)


def _compare_exact(path: str, dtype: str, shape: list[int], e: Any, a: Any) -> tuple[dict[str, Any], str | None]:
    """Integers and bools: equal element for element, in their own dtype; the figures exact."""
    import torch

    eh, el = (t.reshape(-1) for t in _as_words(e))
    ah, al = (t.reshape(-1) for t in _as_words(a))
    numel = int(eh.numel())
    differs = (eh != ah) | (el != al)
    bad = int(differs.sum())
    if bad == 0:
        return _leaf(path, dtype, shape, numel, 0, 0.0, 0.0, 0.0), None
    # |a - e| exactly, as int64 halves (a difference of two int64 can need 64 bits unsigned):
    # both halves' differences fit easily, and the sign of the whole is the high half's
    # unless that is zero.
    dh, dl = ah - eh, al - el
    negative = (dh < 0) | ((dh == 0) & (dl < 0))
    dh, dl = torch.where(negative, -dh, dh), torch.where(negative, -dl, dl)
    borrow = (dl < 0).to(torch.int64)
    dh, dl = dh - borrow, dl + borrow * (1 << 32)
    top = dh.max()
    worst = int(torch.argmax(torch.where(dh == top, dl, torch.full_like(dl, -1))))
    largest = _python_int(dh[worst], dl[worst])
    eager_value, compiled_value = _python_int(eh[worst], el[worst]), _python_int(ah[worst], al[worst])
    if dtype == "bool":
        eager_value, compiled_value = bool(eager_value), bool(compiled_value)
    magnitude = abs(eager_value)
    rel = largest / magnitude if magnitude else float(largest)
    leaf = _leaf(path, dtype, shape, numel, largest, rel, 0.0, 0.0)
    return leaf, (
        f"output {path or '<root>'} ({dtype}{shape}): {bad} of {numel} elements differ "
        f"({dtype} must be equal exactly); the largest difference is {largest} at element "
        f"{_element(worst, shape)} (eager {eager_value}, compiled {compiled_value})"
    )


def _leaf(
    path: str,
    dtype: str,
    shape: list[int],
    numel: int,
    max_abs: float | int,
    max_rel: float,
    atol: float,
    rtol: float,
) -> dict[str, Any]:
    return {
        "atol": float(atol),
        "dtype": dtype,
        # An integer leaf's difference stays a Python int (exact; 0 in every record).
        "max_abs_diff": max_abs if isinstance(max_abs, int) else float(max_abs),
        "max_rel_diff": float(max_rel),
        "numel": int(numel),
        "path": path,
        "rtol": float(rtol),
        # The multiplier of atol: 1 since atol stopped growing with the leaf's largest
        # value; kept so that records stay of the tcg-mint-record-v1 shape.
        "scale": 1.0,
        "shape": shape,
    }


def check_parity(program: Any, package: str | os.PathLike[str], entry: str) -> dict[str, Any]:
    """Compare the compiled ``entry`` of ``package`` with ``program`` run eagerly, on its example inputs.

    Returns the ``parity`` block of the mint record. Raises ``CompileError``:
    ``mint.parity_failed`` (a leaf differs beyond its tolerance, the output
    structure differs, or the compiled graph fails on the inputs) or
    ``mint.parity_unavailable`` (no example inputs, or the program cannot run
    eagerly on them, or the package cannot be loaded).
    """
    import torch
    from torch.utils._pytree import tree_flatten

    examples = getattr(program, "example_inputs", None)
    if not (isinstance(examples, tuple) and len(examples) == 2):
        raise _unavailable(
            "the exported program has no example inputs (program.example_inputs); "
            "export with torch.export.export(module, args, kwargs) so that the mint can check the compiled graph"
        )
    args, kwargs = examples
    in_spec = program.call_spec.in_spec
    names = list(in_spec.child(1).context or []) if in_spec is not None and in_spec.num_children == 2 else []
    ordered = {name: kwargs[name] for name in names if name in kwargs}
    flat, _ = tree_flatten((tuple(args), ordered))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    index = _device_index(tensors)
    device = torch.device("cpu") if index < 0 else torch.device("cuda", index)

    # Both sides in full float32 on a GPU: cuDNN's default TF32 convolutions (and
    # TF32 matmuls where a user enabled them) would make a correct graph differ
    # from eager by more than the float32 tolerance (seen: a UNet's output, 5e-4).
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _check_parity_full_precision(program, package, entry, args, kwargs, tensors, index, device)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _check_parity_full_precision(
    program: Any,
    package: Any,
    entry: str,
    args: Any,
    kwargs: Any,
    tensors: list[Any],
    index: int,
    device: Any,
) -> dict[str, Any]:
    import torch
    from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

    mutated = sorted(set(program.graph_signature.buffers_to_mutate.values()))
    saved = {}
    for name in mutated:
        for source in (program.state_dict, program.constants):
            if isinstance(source.get(name), torch.Tensor):
                saved[name] = (source, source[name].detach().clone())
    try:
        with torch.no_grad():
            eager = program.module()(*_clone(tuple(args)), **_clone(dict(kwargs)))
    except Exception as exc:
        raise _unavailable(f"the exported program fails on its example inputs: {type(exc).__name__}: {exc}") from exc
    finally:
        for name, (source, value) in saved.items():
            with torch.no_grad():
                source[name].copy_(value)
    constants = _program_constants(program, device)
    try:
        compiled = run_compiled(package, entry, constants, [t.clone() for t in tensors], index)
    except CompileError:
        raise
    except Exception as exc:
        raise CompileError(
            f"compiled graph does not match the exported program: it fails on the example inputs: "
            f"{type(exc).__name__}: {exc}",
            "mint.parity_failed",
        ) from exc

    try:
        leaves_with_path = [(keystr(path), leaf) for path, leaf in tree_flatten_with_path(eager)[0]]
    except ValueError:
        # A node type registered without key paths (diffusers' outputs on torch 2.11):
        # leaves are named by their flat position.
        leaves_with_path = [(f"[{i}]", leaf) for i, leaf in enumerate(tree_flatten(eager)[0])]
    if len(leaves_with_path) != len(compiled):
        raise CompileError(
            f"compiled graph does not match the exported program: it returns {len(compiled)} outputs, "
            f"the program {len(leaves_with_path)}",
            "mint.parity_failed",
        )
    leaves: list[dict[str, Any]] = []
    failures: list[str] = []
    for (path, expected), actual in zip(leaves_with_path, compiled, strict=True):
        leaf, failure = _compare(path, expected, actual)
        if leaf is not None:
            leaves.append(leaf)
        if failure is not None:
            failures.append(failure)
    if failures:
        raise CompileError(
            "compiled graph does not match the exported program on its example inputs; nothing is published: "
            + "; ".join(failures),
            "mint.parity_failed",
        )
    return {"inputs": "example_inputs", "leaves": leaves, "runner": compiled_runner(package, entry), "status": "passed"}
