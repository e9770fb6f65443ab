"""Run a resolved compiled graph with its weights bound.

A stored artifact is code only: its ``model.pt2`` holds no weight values, and
running it without binding its constants would crash the process. This module
binds every constant by fqn, checks each one against the artifact's recorded
constant table first, and only then hands the tensors to the package loader.

Loading uses torch's package loader (``torch._C._aoti.AOTIModelPackageLoader``)
directly. ``torch._inductor.aoti_load_package`` goes through
``torch._inductor``, whose import in a fresh process costs seconds (the
inductor stack, and on CPU a probe of the vector ISA that compiles test
programs) and buys nothing for a package that is already compiled and verified.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import BindingError

if TYPE_CHECKING:
    from .engine import StoredCompiledGraph

__all__ = ["LoadedGraph", "load"]


def _device(stored: StoredCompiledGraph, device: object) -> Any:
    import torch

    if device is None:
        if stored.sm.startswith("cpu"):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise BindingError(f"artifact is for {stored.sm} but CUDA is not available", "run.device_mismatch")
        return _device(stored, torch.device("cuda", torch.cuda.current_device()))
    dev = torch.device(device)  # type: ignore[call-overload]
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BindingError(f"cannot run on {dev}: CUDA is not available", "run.device_mismatch")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    wants_cpu = stored.sm.startswith("cpu")
    if (dev.type == "cpu") != wants_cpu:
        raise BindingError(f"artifact is for {stored.sm}; it cannot run on {dev}", "run.device_mismatch")
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        if stored.sm.removeprefix("sm_").removesuffix("a") != f"{major}{minor}":
            raise BindingError(
                f"artifact is for {stored.sm}; {dev} has capability {major}.{minor} (sm_{major}{minor})",
                "run.device_mismatch",
            )
    return dev


def _from_files(weights: object) -> dict[str, Any]:
    """Every tensor of a checkpoint on disk (the forms ``load_native`` takes), on the CPU."""
    from safetensors.torch import load_file

    from .native import _weight_paths

    out: dict[str, Any] = {}
    for path in _weight_paths(weights):
        for file, names in _native.checkpoint_files(path):
            try:
                tensors = load_file(file)
            except Exception as exc:
                raise BindingError(f"{file} is not a readable safetensors file: {exc}", "run.weights_invalid") from exc
            if names is not None and set(tensors) != set(names):
                raise BindingError(f"{file} does not hold what its index maps to it", "run.weights_invalid")
            for name, tensor in tensors.items():
                if name in out:
                    raise BindingError(f"{name!r} is in two of the weights files", "run.weights_invalid")
                out[name] = tensor
    return out


def _weights(weights: object) -> dict[str, Any]:
    import torch

    if isinstance(weights, torch.nn.Module):
        # Every name a user's module has for each tensor: tied weights under
        # each of their names, non-persistent buffers too.
        named: dict[str, Any] = dict(weights.named_parameters(remove_duplicate=False))
        named.update(weights.named_buffers(remove_duplicate=False))
        return named
    if isinstance(weights, (str, os.PathLike, list, tuple)):
        return _from_files(weights)
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


def _renamed(named: dict[str, Any], strip_prefix: str, add_prefix: str) -> tuple[dict[str, Any], int]:
    if not strip_prefix and not add_prefix:
        return named, 0
    out: dict[str, Any] = {}
    skipped = 0
    for name, value in named.items():
        if strip_prefix:
            if not name.startswith(strip_prefix):
                skipped += 1
                continue
            name = name[len(strip_prefix) :]
        out[add_prefix + name] = value
    return out, skipped


def _check(name: str, tensor: Any, row: Mapping[str, Any], device: Any) -> Any:
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = [int(d) for d in tensor.shape]
    if dtype != row["dtype"] or shape != list(row["shape"]):
        raise BindingError(
            f"constant {name!r} is {dtype}{shape}, the graph was compiled for {row['dtype']}{list(row['shape'])}",
            "run.constant_mismatch",
        )
    if tensor.device != device:
        raise BindingError(
            f"constant {name!r} is on {tensor.device}, the graph runs on {device}", "run.device_mismatch"
        )
    return tensor.detach().contiguous()


class LoadedGraph:
    """A resolved graph loaded with its constants bound: call it like the original module."""

    def __init__(
        self,
        stored: StoredCompiledGraph,
        weights: object,
        *,
        device: object = None,
        strip_prefix: str = "",
        add_prefix: str = "",
    ) -> None:
        import torch

        from .native import _naming

        self._stored = stored
        self._naming = _naming(strip_prefix, add_prefix)
        #: Names the weights provided that the graph does not bind: declared
        #: constants the compiler dropped (unused by the compiled code).
        self.ignored_constants: list[str] = []
        #: Tensors of the weights skipped for lying outside ``strip_prefix``.
        self.outside_prefix = 0
        self.device = _device(stored, device)
        # A .so that carries its own C++ runtime crashes torch's package loader:
        # refused before the loader sees it.
        _native.package_check_torch_loader(os.fspath(stored.package_path), stored.graph_class)
        self._rows: dict[str, Mapping[str, Any]] = {row["fqn"]: row for row in stored.constants}
        index = -1 if self.device.type == "cpu" else int(self.device.index)
        try:
            # (path, entry, run_single_threaded, num_runners, device_index): positional, the
            # form torch 2.11 and 2.15 share (2.15 adds use_stream_affinity, default False).
            self._loader = torch._C._aoti.AOTIModelPackageLoader(
                os.fspath(stored.package_path), stored.graph_class, False, 1, index
            )
        except Exception as exc:
            raise BindingError(
                f"cannot load {stored.package_path} entry {stored.graph_class!r}: {exc}", "run.package_invalid"
            ) from exc
        needed = set(self._loader.get_constant_fqns())
        if needed != set(self._rows):
            raise BindingError(
                "the package's constants differ from its metadata "
                f"(package only {sorted(needed - set(self._rows))}, metadata only {sorted(set(self._rows) - needed)})",
                "run.package_invalid",
            )
        self._literals = self._read_literals()
        in_spec, out_spec = self._loader.get_call_spec()
        from torch.utils import _pytree as pytree

        self._pytree = pytree
        self._in_spec = pytree.treespec_loads(in_spec)
        self._out_spec = pytree.treespec_loads(out_spec)
        self._kwarg_names: list[str] = list(self._in_spec.child(1).context or [])
        self.rebind(weights)

    def _read_literals(self) -> dict[str, Any]:
        literal = [fqn for fqn, row in self._rows.items() if row["source"] == "literal"]
        if not literal:
            return {}
        path = self._stored.path / "constants.safetensors"
        try:
            from safetensors.torch import load_file

            tensors = load_file(os.fspath(path), device=str(self.device))
        except Exception as exc:
            raise BindingError(f"cannot read the literal payload {path}: {exc}", "run.literal_payload") from exc
        if sorted(tensors) != sorted(literal):
            raise BindingError(
                f"literal payload holds {sorted(tensors)}, the graph declares {sorted(literal)}", "run.literal_payload"
            )
        return {fqn: _check(fqn, tensors[fqn], self._rows[fqn], self.device) for fqn in literal}

    @property
    def constant_fqns(self) -> list[str]:
        """The fqns the weights must provide (parameters and buffers), in table order."""
        return [fqn for fqn, row in self._rows.items() if row["source"] == "state_dict"]

    def rebind(self, weights: object) -> None:
        """Bind new weights (after an out-of-place change), with the same checks as loading."""
        import torch

        named, outside = _renamed(_weights(weights), *self._naming)
        plan = _native.package_plan_binding(os.fspath(self._stored.package_path), self._stored.metadata, list(named))
        for bound_name, other in plan["duplicates"]:
            a, b = named[bound_name], named[other]
            same = a is b or (
                a.dtype == b.dtype
                and a.shape == b.shape
                and a.device == b.device
                and (a.data_ptr() == b.data_ptr() or bool(torch.equal(a, b)))
            )
            if not same:
                raise BindingError(
                    f"{bound_name!r} and {other!r} share storage in the exported program, "
                    "but the weights hold different values for them",
                    "run.constant_mismatch",
                )
        bound = {fqn: _check(fqn, named[name], self._rows[fqn], self.device) for fqn, name in plan["bind"]}
        bound.update(self._literals)
        # Folded ("computed") constants are recomputed by the package from what is bound.
        # (constants, use_inactive=False, check_full_update=True): the positional form both
        # torch 2.11 and 2.15 accept; user_managed and allow_h2d_copy keep their False defaults.
        self._loader.load_constants(bound, False, True)
        self._bound = bound
        self.ignored_constants, self.outside_prefix = list(plan["ignored"]), outside

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph with the original module's ``(args, kwargs)`` convention."""
        import torch

        if sorted(kwargs) != sorted(self._kwarg_names):
            raise BindingError(
                f"the graph takes keyword arguments {self._kwarg_names}, got {sorted(kwargs)}", "run.call_invalid"
            )
        ordered = {name: kwargs[name] for name in self._kwarg_names}
        flat, spec = self._pytree.tree_flatten((args, ordered))
        if spec != self._in_spec:
            raise BindingError(
                f"call arguments have structure {spec}, the graph was exported with {self._in_spec}",
                "run.call_invalid",
            )
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        outputs = self._loader.boxed_run(tensors)
        return self._pytree.tree_unflatten(outputs, self._out_spec)

    def __repr__(self) -> str:
        return f"LoadedGraph(key={self._stored.key!r}, device={str(self.device)!r})"


def load(stored: StoredCompiledGraph, weights: object, *, device: object = None) -> LoadedGraph:
    """Load ``stored`` and bind ``weights`` (an ``nn.Module``, a state_dict or a checkpoint path)."""
    return LoadedGraph(stored, weights, device=device)


def write_weights(
    stored: StoredCompiledGraph, module: object, path: str | os.PathLike[str], *, non_persistent_only: bool = False
) -> Path:
    """See :meth:`StoredCompiledGraph.write_weights`."""
    import torch
    from safetensors.torch import save_file

    if not isinstance(module, torch.nn.Module):
        raise BindingError(
            f"write_weights takes the nn.Module the graph was exported from, got {type(module).__qualname__}",
            "run.weights_invalid",
        )
    named = _weights(module)
    plan = _native.package_plan_binding(os.fspath(stored.package_path), stored.metadata, list(named))
    kinds = stored.weights_contract["kinds"]
    rows = {row["fqn"]: row for row in stored.constants}
    out: dict[str, Any] = {}
    for fqn, name in plan["bind"]:
        if non_persistent_only and kinds.get(fqn) != "non_persistent_buffer":
            continue
        out[fqn] = _check(fqn, named[name].detach().cpu(), rows[fqn], torch.device("cpu")).clone()
    target = Path(path)
    save_file(out, os.fspath(target), metadata={"written_by": "torch-compiled-graphs", "graph": stored.key})
    return target
