"""The torch side of taking weights, shared by ``load()`` (:mod:`.runner`) and :class:`.WeightsSet`.

A checkpoint on disk read by the weights pipeline into one allocation
(:func:`read_checkpoint`), a module's or state_dict's tensors by name
(:func:`named_tensors`), and the refusals both raise (:func:`check_row`,
:func:`tied_mismatch`). It lives below both so that neither imports the other
for it (``tests/test_layering.py``); torch is imported inside the functions
only, as everywhere on the load paths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import _loadpath, _native
from .errors import BindingError

__all__ = ["check_row", "named_tensors", "read_checkpoint", "tied_mismatch"]


def read_checkpoint(
    weights: object,
    naming: tuple[str, str],
    device: Any,
    plan_of: Callable[[list[str]], Mapping[str, Any]],
    rows: Mapping[str, Mapping[str, Any]] | None,
) -> tuple[dict[str, Any], int, dict[str, float], Mapping[str, Any]]:
    """The tensors of a checkpoint on disk that the graph binds, read by the
    weights pipeline into one allocation on ``device`` (several threads, and on
    a GPU a pinned ring copied on a copy stream), as views of it by graph name;
    with the binding plan ``plan_of`` made from the checkpoint's names.

    As on the native path, every check the headers allow comes first (each
    bound tensor's dtype and shape against its row, tied aliases' dtypes and
    shapes), then the capacity check, and only then is memory allocated and
    anything read: tied aliases are compared in bounded chunks, and only the
    names the plan binds are read."""
    import torch

    reader = _native.CheckpointReader(_loadpath.weight_paths(weights), *naming)
    entries = {name: (dtype, list(shape)) for name, dtype, shape in reader.entries}
    plan = plan_of(list(entries))
    dtypes = {}
    for fqn, name in plan["bind"]:
        dtype_name, shape = entries[name]
        shown = repr(fqn) if fqn == name else f"{fqn!r} (bound from its alias {name!r})"
        if rows is not None:  # None: a weights set's own read, checked by each graph that binds it
            check_row(shown, dtype_name, shape, rows[fqn])
        torch_dtype = getattr(torch, dtype_name, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise BindingError(f"{name!r} has a dtype ({dtype_name}) torch cannot hold", "run.weights_invalid")
        dtypes[name] = torch_dtype
    for bound_name, other in plan["duplicates"]:
        if entries[bound_name] != entries[other]:
            raise tied_mismatch(bound_name, other)
    wanted = sorted(dtypes)
    total = reader.layout_bytes(wanted)
    index = f"cuda:{device.index}" if device.type == "cuda" else "cpu"
    reader.check_capacity(total, index)
    try:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:  # a CPU allocator's failure is a RuntimeError
        raise BindingError(
            f"the weights need {total} bytes on {device}, which cannot hold them: {exc}", "run.weights_too_large"
        ) from exc
    for bound_name, other in plan["duplicates"]:
        if not reader.same_values(bound_name, other):
            raise tied_mismatch(bound_name, other)
    offsets, timings = reader.read_into(wanted, buffer.data_ptr(), total, index)
    named: dict[str, Any] = {}
    for name, offset in offsets:
        dtype, shape = dtypes[name], entries[name][1]
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        named[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
    return named, reader.outside_prefix, dict(timings), plan


def check_row(shown: str, dtype: str, shape: list[int], row: Mapping[str, Any]) -> None:
    """A constant's dtype and shape (``shown`` names it) against its row of the table."""
    if dtype != row["dtype"] or shape != list(row["shape"]):
        raise BindingError(
            f"constant {shown} is {dtype}{shape}, the graph was compiled for {row['dtype']}{list(row['shape'])}",
            "run.constant_mismatch",
        )


def tied_mismatch(bound_name: str, other: str) -> BindingError:
    """The refusal of two tied names whose weights hold different values."""
    return BindingError(
        f"{bound_name!r} and {other!r} share storage in the exported program, "
        "but the weights hold different values for them",
        "run.constant_mismatch",
    )


def named_tensors(weights: object, device: Any = None) -> dict[str, Any]:
    """The tensors of an ``nn.Module`` or a state_dict by name (anything else is ``run.weights_invalid``)."""
    import torch

    if isinstance(weights, torch.nn.Module):
        # Every name a user's module has for each tensor: tied weights under
        # each of their names, non-persistent buffers too.
        named: dict[str, Any] = dict(weights.named_parameters(remove_duplicate=False))
        named.update(weights.named_buffers(remove_duplicate=False))
        return named
    if isinstance(weights, Mapping):
        out: dict[str, Any] = {}
        for name, value in weights.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise BindingError(
                    f"weights must map names to tensors; {name!r} maps to {type(value).__qualname__}",
                    "run.weights_invalid",
                )
            out[name] = value
        return out
    raise BindingError(
        f"weights must be an nn.Module, a state_dict or a checkpoint path, got {type(weights).__qualname__}",
        "run.weights_invalid",
    )
