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
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _loadpath, _native
from ._torch_weights import check_row, named_tensors, read_checkpoint, tied_mismatch
from .errors import BindingError

if TYPE_CHECKING:
    from .capture import CaptureBackend
    from .dropin import GraphModule
    from .engine import StoredCompiledGraph

__all__ = ["LoadedGraph", "load"]


def _check_tied(duplicates: Any, named: Mapping[str, Any]) -> None:
    """Two tensors given for one tied group must hold the same value: the same dtype,
    shape and device and equal elements. An address is not a value: ``W`` and ``W.t()``
    (or any other view of W's memory) start at the same address and differ."""
    import torch

    for bound_name, other in duplicates:
        a, b = named[bound_name], named[other]
        same = a is b or (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and (
                # The same elements at the same addresses: one view, no need to compare.
                (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()) or bool(torch.equal(a, b))
            )
        )
        if not same:
            raise tied_mismatch(bound_name, other)


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


def _row_nbytes(row: Mapping[str, Any]) -> int:
    import torch

    count = 1
    for d in row["shape"]:
        count *= int(d)
    dtype = getattr(torch, str(row["dtype"]), None)
    return count * (dtype.itemsize if isinstance(dtype, torch.dtype) else 0)


def _check(name: str, tensor: Any, row: Mapping[str, Any], device: Any) -> Any:
    _validate(name, tensor, row, device)
    return tensor.detach().contiguous()


def _validate(name: str, tensor: Any, row: Mapping[str, Any], device: Any) -> None:
    check_row(repr(name), str(tensor.dtype).removeprefix("torch."), [int(d) for d in tensor.shape], row)
    if tensor.device != device:
        raise BindingError(
            f"constant {name!r} is on {tensor.device}, the graph runs on {device}", "run.device_mismatch"
        )


def _spec_types(node: object, out: list[str]) -> list[str]:
    """Every node type a treespec JSON node names (depth first)."""
    if isinstance(node, dict):
        kind = node.get("type")
        if isinstance(kind, str) and kind not in out:
            out.append(kind)
        for child in node.get("children_spec") or []:
            _spec_types(child, out)
    return out


def _unknown_types(text: str) -> list[str]:
    """The node types of a treespec JSON that torch's pytree has no class for in this process."""
    import json

    from torch.utils import _pytree as pytree

    known = getattr(pytree, "SERIALIZED_TYPE_TO_PYTHON_TYPE", {})
    try:
        _, root = json.loads(text)
    except (ValueError, TypeError):
        return []
    return [t for t in _spec_types(root, []) if t not in known]


def _import_for(type_name: str) -> bool:
    """Import the module of a serialized type name (``a.b.Class`` -> ``a.b``) when it is
    already imported or its top-level package is installed; whether it could be."""
    import importlib
    import importlib.util
    import sys

    module = type_name.rpartition(".")[0]
    if not module or module in sys.modules:
        return bool(module)
    try:
        if importlib.util.find_spec(module.partition(".")[0]) is None:
            return False
        importlib.import_module(module)
    except Exception:  # an installed package that fails to import is one that is not importable
        return False
    return True


def _torch_spec(text: str, what: str) -> Any:
    """Torch's own reading of a call spec: the library's output classes rebuilt, after
    importing the modules that register them (:func:`_import_for`); ``None`` when
    torch still cannot read it in this process."""
    from torch.utils import _pytree as pytree

    for attempt in range(2):
        try:
            return pytree.treespec_loads(text)
        except Exception:
            if attempt or not any([_import_for(t) for t in _unknown_types(text)]):
                return None
    return None


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
        cuda_graphs: bool | None = None,
        max_captures: int | None = None,
        cuda_graph_outputs: str = "copy",
        capture_backend: CaptureBackend | None = None,
    ) -> None:
        import torch

        from . import capture

        self._stored = stored
        self._naming = _loadpath.naming(strip_prefix, add_prefix)
        #: Names the weights provided that the graph does not bind: declared
        #: constants the compiler dropped (unused by the compiled code).
        self.ignored_constants: list[str] = []
        #: Tensors of the weights skipped for lying outside ``strip_prefix``.
        self.outside_prefix = 0
        #: How long each phase of loading took, in seconds: ``create_container``
        #: (torch's package loader), for a checkpoint path ``read_weights`` and
        #: ``copy_weights`` (and ``cuda_context``), ``bind_weights``, and
        #: ``first_call`` once the first call returned.
        self.timings: dict[str, float] = {}
        self._first_call_pending = True
        #: Constants the binding copied instead of binding the caller's tensor in place:
        #: ``{"name", "nbytes", "reason"}`` each (docs/run.md, "Weights once").
        self.copied_constants: list[dict[str, Any]] = []
        #: Bytes this graph holds beyond the weights it borrows: copies, its own read of a
        #: checkpoint, literal constants and the constants the compiler folded.
        self.added_nbytes = 0
        self._binding: Any = None
        started = time.perf_counter()
        self.device = _device(stored, device)
        backend, max_captures, reason, fallback = capture.plan(
            stored,
            self.device,
            cuda_graphs=cuda_graphs,
            max_captures=max_captures,
            outputs=cuda_graph_outputs,
            backend=capture_backend,
        )
        self._rows: dict[str, Mapping[str, Any]] = {row["fqn"]: row for row in stored.constants}
        index = -1 if self.device.type == "cpu" else int(self.device.index)
        from ._native_loader import NativeLoader, needs_native_loader

        #: What runs the graph: ``"torch"`` (torch's package loader) or ``"native"``
        #: (the torch-free runner, for a .so that carries its own C++ runtime, which
        #: crashes torch's loader; docs/run.md, "Which loader runs a package").
        self.runner = "native" if needs_native_loader(stored.package_path, stored.graph_class) else "torch"
        self._loader: Any
        if self.runner == "native":
            # Typed refusals (BindingError) of the runner pass through as they are.
            self._loader = NativeLoader(stored.package_path, stored.graph_class, index, stored.sm, stored.constants)
            if backend is not None:
                # Captured calls use the container's single-threaded run, as with
                # torch's loader below; a runtime without it is not captured.
                try:
                    self._loader._model.single_threaded = True
                except BindingError as exc:
                    backend, reason, fallback = None, str(exc), True
        else:
            try:
                # (path, entry, run_single_threaded, num_runners, device_index): positional, the
                # form torch 2.11 and 2.15 share (2.15 adds use_stream_affinity, default False).
                # A captured graph runs single-threaded: the threaded run records an event
                # per run that a capture turns into one the container can no longer query;
                # calls are serialised by the capture's lock instead.
                self._loader = _loadpath.torch_package_loader(
                    torch, os.fspath(stored.package_path), stored.graph_class, backend is not None, index
                )
            except Exception as exc:
                raise BindingError(
                    f"cannot load {stored.package_path} entry {stored.graph_class!r}: {exc}", "run.package_invalid"
                ) from exc
        self.timings["create_container"] = time.perf_counter() - started
        #: The strides the graph reads each input with (from its wrapper's checks).
        read = _loadpath.input_strides(stored.package_path)
        self._input_strides = None if read is None else [tuple(s) for s in read]
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
        self._in_spec = _torch_spec(in_spec, "input")
        if self._in_spec is None:
            raise BindingError(
                f"the graph's input spec names a type torch cannot rebuild here ({_unknown_types(in_spec)}); "
                "import the module that registers it before load()",
                "run.spec_unsupported",
            )
        self._out_text = str(out_spec)
        self._out_spec = _torch_spec(out_spec, "output")
        #: The output spec as read without the library's classes (``None`` when torch
        #: rebuilds them): records of named fields come back as GraphOutput.
        self._out_records: Any = None
        if self._out_spec is None:
            self._out_records = _loadpath.parse_spec(
                out_spec, "output", records=True, unsupported="run.spec_unsupported"
            )
        self._kwarg_names: list[str] = list(self._in_spec.child(1).context or [])
        #: Bumped by every change of which memory the container reads for its
        #: constants; captures of another generation are dropped (docs/run.md).
        self._binding_generation = 0
        self._capture = capture.GraphCapture(
            self._loader.boxed_run,
            backend,
            max_captures=max_captures,
            outputs=cuda_graph_outputs,
            timings=self.timings,
            reason=reason,
            fallback=fallback,
            name=f"load {stored.key}",
        )
        self.rebind(weights)
        self.timings["load_total"] = time.perf_counter() - started

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
        """Bind new weights (after an out-of-place change), with the same checks as loading.

        A module's or state_dict's tensors (and a :class:`WeightsSet`'s) are bound in
        place where their layout allows, and copied otherwise (``copied_constants``)."""
        import torch

        from .binding import Binding, bind_in_place, log_copies
        from .weights_set import WeightsSet

        package, metadata = os.fspath(self._stored.package_path), self._stored.metadata
        timings: dict[str, float] = {}
        from_files = isinstance(weights, (str, os.PathLike, list, tuple))
        weights_set = weights if isinstance(weights, WeightsSet) else None
        owned = from_files or (weights_set is not None and not weights_set.borrowed)
        plan: Mapping[str, Any]
        if weights_set is not None:
            named, outside = _loadpath.renamed(weights_set.tensors_for_binding(self.device), *self._naming)
            plan = _native.package_plan_binding(package, metadata, list(named))
            _check_tied(plan["duplicates"], named)
        elif from_files:
            # Checked from the headers, then read by the weights pipeline
            # straight into one allocation: only the names the plan binds.
            named, outside, timings, plan = read_checkpoint(
                weights,
                self._naming,
                self.device,
                lambda names: _native.package_plan_binding(package, metadata, names),
                self._rows,
            )
        else:
            named, outside = _loadpath.renamed(named_tensors(weights, self.device), *self._naming)
            plan = _native.package_plan_binding(package, metadata, list(named))
            _check_tied(plan["duplicates"], named)
        sources = {fqn: named[name] for fqn, name in plan["bind"]}
        for fqn, tensor in sources.items():
            _validate(fqn, tensor, self._rows[fqn], self.device)
        bound, copied = bind_in_place(sources)
        bound.update(self._literals)
        # Folded ("computed") constants are recomputed by the package from what is bound.
        # (constants, use_inactive=False, check_full_update=True, user_managed=True): the
        # container keeps a handle to each tensor's storage without a copy; `self._binding`
        # keeps them alive too. The caller's tensors are read live (docs/run.md, "Weights once").
        started = time.perf_counter()
        with self._capture.exclusive():  # no call, and no replay in flight, while constants change
            self._loader.load_constants(bound, False, True, True)
            self._binding_generation += 1
        timings["bind_weights"] = time.perf_counter() - started
        folds = any(row["source"] == "computed" for row in self._rows.values())
        module, module_names = None, None
        if isinstance(weights, torch.nn.Module):
            module = weights
            module_names = {fqn: _loadpath.source_name(name, self._naming) for fqn, name in plan["bind"]}
        elif weights_set is not None and weights_set.module is not None:
            module = weights_set.module
            module_names = {
                fqn: weights_set.source_name(_loadpath.source_name(name, self._naming)) for fqn, name in plan["bind"]
            }
        self._binding = Binding(
            sources,
            bound,
            copied,
            borrowed=not owned,
            folds=folds,
            lock=weights_set.lock if weights_set is not None else None,
            module=module,
            module_names=module_names,
        )
        self._bound = bound
        self.copied_constants = copied
        # A checkpoint read by the pipeline is one allocation of the graph's own.
        own = 0
        if from_files:
            own = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in named.values()}.values())
        self.added_nbytes = (
            own
            + sum(int(row["nbytes"]) for row in copied)
            + sum(int(t.numel() * t.element_size()) for t in self._literals.values())
            + sum(_row_nbytes(row) for row in self._rows.values() if row["source"] == "computed")
        )
        log_copies(f"load {self._stored.key}", copied)
        self.ignored_constants, self.outside_prefix = list(plan["ignored"]), outside
        self.timings.update(timings)
        _loadpath.log_timings(f"load {self._stored.key}", timings)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph with the original module's ``(args, kwargs)`` convention."""

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
        self._check_inputs(flat)
        tensors = self._placed(flat)
        started = time.perf_counter() if self._first_call_pending else 0.0
        outputs = self._run_bound(tensors)
        if self._first_call_pending:
            self._first_call_pending = False
            self.timings["first_call"] = time.perf_counter() - started
        if self._out_spec is None:
            return _loadpath.unflatten(self._out_records, iter(outputs))
        return self._pytree.tree_unflatten(outputs, self._out_spec)

    def _run_bound(self, tensors: list[Any]) -> Any:
        """Run with the binding checked first (stale: refused; changed in place: copies
        and folds refreshed), under the weights set's lock when there is one."""
        binding = self._binding
        lock = binding.lock
        lock.acquire_shared()
        try:
            if binding.check():
                lock.release_shared()
                try:
                    with lock.exclusive():
                        self._refresh(binding)
                finally:
                    lock.acquire_shared()
            return self._capture.run(tensors, self._binding_generation)
        finally:
            lock.release_shared()

    def _refresh(self, binding: Any) -> None:
        """Copies and folds brought up to date after an in-place change of their sources
        (no call of this graph runs meanwhile: the binding's lock is held exclusive)."""
        if binding.refresh():
            # The container recomputes its folds on the next run, into new buffers:
            # captures of the old generation are dropped.
            with self._capture.exclusive():
                self._loader.load_constants(binding.bound, False, True, True)
                self._binding_generation += 1

    def stale_constants(self) -> list[str]:
        """Names whose bound tensor was replaced out of place since binding (a parameter
        reassigned, ``.data`` swapped, a submodule replaced, a device move): the graph
        still reads the old tensor, and calls are refused (``run.weights_stale``) until
        :meth:`rebind`. Empty for a graph that reads only memory of its own."""
        return list(self._binding.stale()) if self._binding is not None else []

    @property
    def binding_generation(self) -> int:
        """Bumped by every change of which memory the container reads for its constants."""
        return self._binding_generation

    @property
    def cuda_graphs(self) -> bool:
        """Whether calls are captured as CUDA graphs and replayed (docs/run.md, "CUDA graphs")."""
        return self._capture.active

    @property
    def cuda_graphs_reason(self) -> str | None:
        """Why calls are not captured (``None`` while they are)."""
        return self._capture.reason

    def static_outputs(self) -> AbstractContextManager[None]:
        """Within ``with graph.static_outputs():``, calls of this thread return a replay's
        output buffers without a copy, as ``cuda_graph_outputs="static"`` does: valid
        only until the next call of this graph."""
        return self._capture.static_outputs()

    @property
    def stats(self) -> dict[str, float]:
        """Counters of the calls: ``captures``, ``replays``, ``evictions``, ``invalidated``
        (captures dropped by a binding change), ``fallbacks``, ``capture_seconds`` (in
        total) and ``uncaptured_runs``."""
        return dict(self._capture.stats)

    def _input_name(self, position: int) -> str:
        pytree = self._stored.metadata["graph_class"]["graph"].get("pytree", {})
        ingress = pytree.get("ingress") if isinstance(pytree, dict) else None
        if isinstance(ingress, dict):
            for row in ingress.get("inputs", ()):
                if int(row["position"]) == position:
                    return f"input {row['name']!r}"
        return f"argument {position} of the flattened call"

    def _placed(self, flat: list[Any]) -> list[Any]:
        """The call's tensors, each on the graph's device: the container reads every
        input as memory of that device, so a tensor elsewhere would be read through a
        pointer of another address space (an illegal access that aborts the process on
        a GPU). What an eager module takes, the graph takes: a 0-d CPU tensor (a
        pipeline's timestep) is moved to the device, as torch's own ops accept a CPU
        scalar beside CUDA tensors; any other tensor on another device is refused
        (``run.call_invalid``) before the run."""
        import torch

        placed: list[Any] = []
        strides = self._input_strides
        for position, value in enumerate(flat):
            if not isinstance(value, torch.Tensor):
                continue
            device = value.device
            if device != self.device:
                if device.type == "cpu" and value.dim() == 0:
                    value = value.to(self.device)
                else:
                    raise BindingError(
                        f"{self._input_name(position)} is on {device}, the graph runs on {self.device}: "
                        f"move it with .to({str(self.device)!r})",
                        "run.call_invalid",
                    )
            if strides is not None and len(placed) < len(strides) and value.stride() != strides[len(placed)]:
                # The memory layout the compiled code reads (a channels-last image
                # given to a graph minted row-major is copied row-major first).
                value = _loadpath.laid_out(value, strides[len(placed)], self._input_name(position))
            placed.append(value)
        return placed

    def _check_inputs(self, flat: list[Any]) -> None:
        """The call's tensors against the call ingress: a tensor exactly where the graph
        takes one (``run.call_invalid``), its dtype, rank, static sizes and symbol ranges
        (``run.input_mismatch``, as on the native path). A call the graph was not compiled
        for is a typed refusal, not a runtime error or a read past an input; artifacts
        without an ingress are checked by the runtime alone."""
        import torch

        pytree = self._stored.metadata["graph_class"]["graph"].get("pytree", {})
        ingress = pytree.get("ingress") if isinstance(pytree, dict) else None
        if not isinstance(ingress, dict):
            return
        rows = {int(r["position"]): r for r in ingress["inputs"]}
        symbols: Mapping[str, Any] = ingress.get("symbols", {})
        bound: dict[str, int] = {}
        bad = "run.input_mismatch"
        for position, value in enumerate(flat):
            row = rows.get(position)
            if row is None:
                if isinstance(value, torch.Tensor):
                    raise BindingError(
                        f"argument {position} of the flattened call is a tensor where the graph takes none",
                        "run.call_invalid",
                    )
                continue
            name = row["name"]
            if not isinstance(value, torch.Tensor):
                raise BindingError(
                    f"input {name!r} must be a tensor ({row['dtype']}), got {type(value).__qualname__}",
                    "run.call_invalid",
                )
            dtype = str(value.dtype).removeprefix("torch.")
            if dtype != row["dtype"]:
                raise BindingError(f"input {name!r} is {dtype}, the graph was compiled for {row['dtype']}", bad)
            dims, shape = list(row["shape"]), list(value.shape)
            if len(shape) != len(dims):
                raise BindingError(f"input {name!r} has rank {len(shape)}, the graph was compiled for {len(dims)}", bad)
            for k, (size, dim) in enumerate(zip(shape, dims, strict=True)):
                if isinstance(dim, int) and size != dim:
                    raise BindingError(f"input {name!r} has size {size} at dimension {k}, the graph needs {dim}", bad)
                if isinstance(dim, str):
                    lo, hi = symbols[dim]
                    if not lo <= size <= hi or bound.setdefault(dim, size) != size:
                        raise BindingError(
                            f"input {name!r} has size {size} at dimension {k}; {dim} must be in [{lo}, {hi}] and "
                            "the same wherever it appears",
                            bad,
                        )

    @property
    def output_type(self) -> str:
        """How outputs are rebuilt: ``"torch"`` (torch's pytree, with the model library's
        own output classes) or ``"GraphOutput"`` (a class that could not be imported,
        read as a :class:`~torch_compiled_graphs.outputs.GraphOutput`)."""
        return "torch" if self._out_spec is not None else "GraphOutput"

    def as_module(self, like: Any, *, constants: Mapping[str, object] | None = None) -> GraphModule:
        """This graph as an ``nn.Module`` in place of ``like`` (the module it was exported
        from, or one of its class and config): called like ``like``, with ``return_dict``,
        ``config``, ``dtype`` and ``device`` (docs/run.md, "Drop-in use"). ``constants``
        states the non-tensor arguments the program was exported with (other than
        ``return_dict``), which the artifact does not record."""
        from .dropin import GraphModule

        return GraphModule(self, like, constants=constants)

    def __repr__(self) -> str:
        return f"LoadedGraph(key={self._stored.key!r}, device={str(self.device)!r})"


def load(stored: StoredCompiledGraph, weights: object, *, device: object = None, **options: Any) -> LoadedGraph:
    """Load ``stored`` and bind ``weights`` (an ``nn.Module``, a state_dict or a checkpoint path);
    ``options`` are :meth:`StoredCompiledGraph.load`'s."""
    return LoadedGraph(stored, weights, device=device, **options)


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
    named = named_tensors(module)
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
