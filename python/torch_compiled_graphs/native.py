"""Run a resolved compiled graph without importing torch (the native load path).

:meth:`StoredCompiledGraph.load_native` loads the package's wrapper ``.so``
through libtorch's C ABI (``crates/tcg-run``): libtorch's shared libraries are
opened from the installed torch package, found without importing it, and the
Python ``torch`` package is never imported. CPU artifacts run on ``"cpu"``,
``sm_NN`` artifacts on ``"cuda:N"`` (libtorch_cuda and the CUDA runtime are
opened at run time too, and the device's capability must be the artifact's).
Weights come from a safetensors file and are checked constant by constant
against the artifact's table before anything is bound. Calls take arrays with
the original module's ``(args, kwargs)`` convention: numpy-compatible host
arrays, or any object with ``__dlpack__`` (torch, CuPy, JAX, ...); host arrays
are copied to the GPU for a CUDA graph. Each input is checked against what the
graph was compiled for before the graph runs. Outputs are ``NativeTensor``s:
``__dlpack__`` exports them without a copy (``numpy.from_dlpack``,
``torch.from_dlpack``, ``cupy.from_dlpack``), and host ones also expose
``__array_interface__``, so ``numpy.asarray(out)`` is a zero-copy view.

See docs/run.md for what is checked and what is refused.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
import time

from . import _native

# The helpers both load paths share (_loadpath.py), under the names this module has
# always used for them (tests import _parse_spec and _unflatten from here).
from ._loadpath import count as _count
from ._loadpath import dlpack as _dlpack
from ._loadpath import flatten as _flatten
from ._loadpath import log_timings as _log_timings
from ._loadpath import naming as _naming
from ._loadpath import parse_spec as _parse_spec
from ._loadpath import unflatten as _unflatten
from ._loadpath import weight_paths as _weight_paths
from .errors import BindingError
from .outputs import GraphOutput

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from typing import Any

    from .engine import StoredCompiledGraph, StrPath

LOGGER = logging.getLogger("torch_compiled_graphs")


__all__ = [
    "GraphOutput",
    "NativeGraph",
    "NativeWeightsSet",
    "find_cuda_runtime",
    "find_torch_lib",
    "from_buffer",
    "to_numpy",
]

# numpy type strings (and buffer-protocol formats) of the dtypes the path passes.
_TYPESTR = {
    "f4": "float32",
    "f8": "float64",
    "f2": "float16",
    "i8": "int64",
    "i4": "int32",
    "i2": "int16",
    "i1": "int8",
    "u1": "uint8",
    "b1": "bool",
}
_FORMAT = {
    "f": "float32",
    "d": "float64",
    "e": "float16",
    "q": "int64",
    "l": "int64",
    "i": "int32",
    "h": "int16",
    "b": "int8",
    "B": "uint8",
    "?": "bool",
}
_SIZE = {"float32": 4, "float64": 8, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

# Every size computed from a caller's shape stays within what the native side
# can hold (int64 dimensions, an isize byte count): beyond it is a refusal.
_MAX_DIM = 2**63 - 1
_MAX_BYTES = 2**63 - 1


def _checked_shape(what: str, shape: Any) -> list[int]:
    """``shape`` as a list of int64 dimensions, else ``BindingError(run.input_layout)``."""
    try:
        dims = [operator.index(d) for d in shape]
    except TypeError:
        shown = f"{shape!r:.200}"
        message = f"{what} has a shape that is not a sequence of integers: {shown}"
        raise BindingError(message, "run.input_layout") from None
    if len(dims) > 64 or any(d < 0 or d > _MAX_DIM for d in dims):
        raise BindingError(f"{what} has an invalid shape {dims}", "run.input_layout")
    return dims


def _checked_nbytes(what: str, shape: Sequence[int], itemsize: int) -> int:
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    if nbytes > _MAX_BYTES:
        raise BindingError(f"{what} of shape {list(shape)} is too large", "run.input_layout")
    return nbytes


def _torch_package_dir() -> str:
    """The installed torch package's directory, found without importing it."""
    from importlib.util import find_spec

    spec = find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise BindingError(
            "torch is not installed in this environment; pass torch_lib= with the lib directory of a torch "
            "installation",
            "run.torch_not_found",
        )
    return str(locations[0])


def find_torch_lib(torch_lib: StrPath | None = None) -> str:
    """The directory holding ``libtorch.so`` and ``libtorch_cpu.so``: ``torch_lib``
    when given, else ``<torch package>/lib`` (located without importing torch)."""
    lib = os.fspath(torch_lib) if torch_lib is not None else os.path.join(_torch_package_dir(), "lib")
    for name in ("libtorch.so", "libtorch_cpu.so"):
        if not os.path.isfile(os.path.join(lib, name)):
            raise BindingError(
                f"{lib} has no {name}; pass torch_lib= with a torch lib directory", "run.torch_not_found"
            )
    return lib


def _is_record_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _lazy_module_loading() -> None:
    """Ask the CUDA driver for lazy module loading unless the environment says
    otherwise, before it is first initialised in this process (as importing
    torch does). Lazy is the default of current drivers; where the default is
    eager, opening libtorch loads every kernel it carries (``EAGER`` measured
    2.2-3.5 s for ``open_libraries`` on an H200, against 0.3-0.5 s)."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")


def _torch_record_digest(torch_lib: str) -> str | None:
    """The toolchain digest (16 hex of SHA-256 of ``RECORD``) of the torch
    distribution that owns ``torch_lib``, as ``record_toolchain`` computes it;
    ``None`` when no distribution metadata sits beside the package."""
    from .toolchain import record_digest

    site = os.path.dirname(os.path.dirname(os.path.realpath(torch_lib)))
    try:
        names = os.listdir(site)
    except OSError:
        return None
    infos = [n for n in names if n.startswith("torch-") and n.endswith(".dist-info") and n[6:7].isdigit()]
    if len(infos) != 1:
        return None
    try:
        with open(os.path.join(site, infos[0], "RECORD"), encoding="utf-8") as f:
            record = f.read()
    except OSError:
        return None
    return record_digest(record)


def _check_torch(stored: StoredCompiledGraph, torch_lib: str) -> str:
    """Refuse a torch other than the one that compiled the artifact; say what was checked."""
    recorded = stored.metadata.get("toolchain", {}).get("torch")
    if not _is_record_digest(recorded):
        # Artifacts of other producers (the reference fixture among them) record no
        # digest this project can recompute: nothing to compare against.
        return "not recorded"
    found = _torch_record_digest(torch_lib)
    if found is None:
        raise BindingError(
            f"the artifact was compiled with torch {recorded}, and the torch at {torch_lib} has no distribution "
            "RECORD to compare",
            "run.torch_mismatch",
        )
    if found != recorded:
        raise BindingError(
            f"the artifact was compiled with torch {recorded}; the torch at {torch_lib} is {found}",
            "run.torch_mismatch",
        )
    return "record digest"


# ---------------------------------------------------------------------- inputs


def _is_array(value: object) -> bool:
    return (
        hasattr(value, "__array_interface__")
        or hasattr(value, "__dlpack__")
        or (not isinstance(value, (str, bytes, int, float, bool)) and value is not None and _has_buffer(value))
    )


def _has_buffer(value: object) -> bool:
    try:
        memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _buffer(path: str, value: Any) -> tuple[int, int, str, list[int], object]:
    """``(address, nbytes, dtype, shape, keep)`` of a C-contiguous CPU buffer.

    ``keep`` must be held until the run returns: for a buffer-protocol object
    it is the exported view, which stops the object from being resized or
    freed (by another thread while the run has released the GIL).
    """
    layout = "run.input_layout"
    keep: object = value
    iface = getattr(value, "__array_interface__", None)
    if iface is not None:
        typestr = str(iface.get("typestr", ""))
        if typestr[:1] not in "<|" or typestr[1:] not in _TYPESTR:
            raise BindingError(f"input {path} has type {typestr!r}, which the graph cannot take", "run.input_mismatch")
        dtype = _TYPESTR[typestr[1:]]
        shape = _checked_shape(f"input {path}", iface.get("shape"))
        data = iface.get("data")
        if not isinstance(data, tuple) or not isinstance(data[0], int):
            raise BindingError(f"input {path} does not expose its memory by address", layout)
        address = int(data[0])
        strides = iface.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, _SIZE[dtype]):
            raise BindingError(f"input {path} is not C-contiguous (strides {tuple(strides)})", layout)
        if iface.get("mask") is not None or iface.get("offset", 0):
            raise BindingError(f"input {path} has a mask or an offset", layout)
    else:
        view = memoryview(value)
        keep = view
        fmt = view.format.lstrip("@=<")
        if fmt not in _FORMAT or (fmt == "l" and view.itemsize != 8):
            raise BindingError(
                f"input {path} has format {view.format!r}, which the graph cannot take", "run.input_mismatch"
            )
        if not view.c_contiguous:
            raise BindingError(f"input {path} is not C-contiguous", layout)
        if view.readonly:
            raise BindingError(
                f"input {path} is a read-only buffer without __array_interface__; pass a numpy array", layout
            )
        import ctypes

        dtype, shape = _FORMAT[fmt], list(view.shape or ())
        address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0
    nbytes = _checked_nbytes(f"input {path}", shape, _SIZE[dtype])
    if address % _SIZE[dtype]:
        raise BindingError(f"input {path} is not aligned to its {_SIZE[dtype]}-byte elements", layout)
    return address, nbytes, dtype, shape, keep


def _lora_args(lora: object, scale: object, prefix: object, name: object) -> tuple[str, float, str | None, str | None]:
    """The native set's LoRA arguments, checked (``run.lora_invalid``)."""
    if not isinstance(lora, (str, os.PathLike)):
        raise BindingError(
            f"a LoRA on a native set is a safetensors file or a directory holding one, got {type(lora).__qualname__}",
            "run.lora_invalid",
        )
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise BindingError(f"the LoRA scale must be a finite number, got {scale!r}", "run.lora_invalid")
    for label, value in (("prefix", prefix), ("name", name)):
        if value is not None and not isinstance(value, str):
            raise BindingError(f"{label} must be a string", "run.lora_invalid")
    return os.fspath(lora), float(scale), prefix, name  # type: ignore[return-value]


class NativeWeightsSet:
    """Every tensor of a checkpoint read once onto a device, without torch, for several
    native graphs to bind without a copy (docs/run.md, "Weights once").

    ``weights`` takes the forms :meth:`StoredCompiledGraph.load_native` takes (a
    ``.safetensors`` file, a sharded checkpoint's index, a directory holding either, or a
    list of those); names are mapped by ``strip_prefix`` (tensors outside it are skipped)
    and ``add_prefix``. ``device`` is ``"cpu"`` (the default) or ``"cuda:N"``. The set
    is read through the native weights pipeline into one allocation: threaded reads, on
    a GPU a pinned ring and a copy stream, and the checks of a native load (headers,
    capacity, regular files). Pass it to :meth:`StoredCompiledGraph.load_native` or
    :meth:`NativeGraph.rebind`: each graph checks the names its table needs by its own
    weights contract and binds handles over the set's memory. Graphs keep the set alive,
    so the set and its graphs may be released in any order.
    """

    def __init__(
        self,
        weights: StrPath | Sequence[StrPath],
        *,
        device: str | None = None,
        torch_lib: StrPath | None = None,
        strip_prefix: str = "",
        add_prefix: str = "",
    ) -> None:
        if device is None:
            device = "cpu"
        if not isinstance(device, str):
            raise BindingError(f"device must be a string such as 'cuda:0', got {device!r}", "run.device_mismatch")
        lib = find_torch_lib(torch_lib)
        if device.startswith("cuda"):
            # The set opens libtorch: the allocator the graphs' CUDA-graph captures
            # need (by the environment's capture settings) is chosen first.
            wanted, count, _ = _capture_options(None, None)
            _prepare_cuda(wanted, count)
        self._set = _native.NativeWeightsSet.open(
            lib, device, _weight_paths(weights), *_naming(strip_prefix, add_prefix)
        )
        self._lib = lib
        _log_timings("NativeWeightsSet", self.timings)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the set holds (on its device), plus the base copies kept
        for a fused LoRA."""
        return int(self._set.nbytes)

    @property
    def names(self) -> list[str]:
        """Every tensor's name (after the prefixes), sorted."""
        return list(self._set.names)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``: where the tensors live."""
        return str(self._set.device)

    @property
    def outside_prefix(self) -> int:
        """Tensors of the checkpoint skipped for lying outside ``strip_prefix``."""
        return int(self._set.outside_prefix)

    @property
    def timings(self) -> dict[str, float]:
        """How long reading the set took, phase by phase, in seconds (``open_libraries``,
        ``plan_weights``, ``allocate_weights``, ``read_weights``, ``copy_weights``, on a
        GPU ``cuda_context`` and ``staging_ring``, then ``set_total``)."""
        return dict(self._set.timings)

    # -- LoRA -------------------------------------------------------------------------

    @property
    def lora(self) -> dict[str, Any] | None:
        """The fused LoRA: ``name``, ``scale``, ``targets`` (names changed) and ``nbytes``
        (its tensors); ``None`` when none is fused."""
        info = self._set.lora
        return None if info is None else dict(info)

    def apply_lora(self, lora: StrPath, scale: float = 1.0, prefix: str | None = None, name: str | None = None) -> None:
        """Fuse a LoRA (a diffusers/PEFT ``.safetensors`` file, or a directory holding
        ``pytorch_lora_weights.safetensors`` or ``adapter_model.safetensors``) into the set's
        values in place, and so into every graph bound to it, without torch:
        ``W + scale_m · B @ A`` per adapted module, in float32 on the set's device, cast to
        W's dtype, where ``scale_m`` is alpha / rank x ``scale`` (the rules of
        :meth:`WeightsSet.apply_lora`). ``prefix`` selects one component of a pipeline's
        LoRA (``"unet."``). Refused (``run.lora_invalid``, nothing changed) when one is
        already fused (use :meth:`replace_lora`) or when it does not fit."""
        self._set.apply_lora(*_lora_args(lora, scale, prefix, name))

    def replace_lora(
        self, lora: StrPath, scale: float = 1.0, prefix: str | None = None, name: str | None = None
    ) -> None:
        """Swap the fused LoRA for another in one step, from the base values: every call
        sees the old one or the new one, never the base or a mix. Refused LoRAs change
        nothing."""
        self._set.replace_lora(*_lora_args(lora, scale, prefix, name))

    def remove_lora(self) -> None:
        """Restore the base values bit for bit and free the copies kept of them."""
        self._set.remove_lora()

    def __repr__(self) -> str:
        return f"NativeWeightsSet({len(self._set.names)} tensors, {self.nbytes} bytes, device={self.device!r})"


#: The variables libtorch's CUDA allocator reads its configuration from, in its order.
_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _capture_options(cuda_graphs: object, max_captures: object) -> tuple[bool, int, str | None]:
    """``(wanted, max_captures, reason_off)`` from the arguments, else the environment
    (the variables and rules of ``load()``, :mod:`torch_compiled_graphs.capture`)."""
    from ._loadpath import capture_options

    count, off = capture_options(cuda_graphs, max_captures)
    if off is not None:
        return False, count, off
    if count == 0:
        return False, count, "max_captures is 0"
    return True, count, None


def _prepare_cuda(captures_wanted: bool, captures_max: int) -> None:
    """What a process does before libtorch opens for a CUDA graph (or a CUDA
    ``NativeWeightsSet``, which opens libtorch first): lazy module loading and, when
    captures are wanted, libtorch's stream-ordered allocator where nothing else chose
    one (docs/run.md, "CUDA graphs")."""
    _lazy_module_loading()
    if captures_wanted:
        stream_ordered, _ = _native.prepare_capture_allocator(True, captures_max)
        if stream_ordered and not any(v in os.environ for v in _ALLOC_CONF):
            os.environ[_ALLOC_CONF[0]] = "backend:cudaMallocAsync"  # what libtorch now reads


_CUDA_RUNTIME_LOADED: list[str] = []


def find_cuda_runtime() -> str | None:
    """The CUDA runtime library (``libcudart.so.N``) of an ``nvidia-cuda-runtime``
    wheel on ``sys.path``, the newest major found; ``None`` when no wheel holds one.
    What a process without Python (the Rust ``Served``) can be given through
    ``TORCH_COMPILED_GRAPHS_CUDART``."""
    import glob
    import re
    import sys

    found: list[tuple[int, str]] = []
    for entry in sys.path:
        if not entry or not os.path.isdir(os.path.join(entry, "nvidia")):
            continue
        for path in glob.glob(os.path.join(glob.escape(entry), "nvidia", "*", "lib", "libcudart.so.*")):
            m = re.fullmatch(r"libcudart\.so\.(\d+)", os.path.basename(path))
            if m and os.path.isfile(path):
                found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def _load_cuda_runtime() -> None:
    """Before a CUDA graph opens on the shim runtime: load :func:`find_cuda_runtime`'s
    library with ``RTLD_LOCAL``. The graph's code calls that library without naming
    it; the native side names the loaded one in the graph's binding stub
    (crates/tcg-run/src/cudart.rs, docs/run.md "Runtime"). Nothing is loaded when
    ``TORCH_COMPILED_GRAPHS_CUDART`` names the file or no wheel holds one (the native
    side then asks the dynamic loader and ``/usr/local/cuda``)."""
    if _CUDA_RUNTIME_LOADED or os.environ.get("TORCH_COMPILED_GRAPHS_CUDART"):
        return
    path = find_cuda_runtime()
    if path is None:
        return
    import ctypes

    ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    _CUDA_RUNTIME_LOADED.append(path)
    LOGGER.debug("load_native: CUDA runtime %s", path)


_RUNTIME_OPTIONS = ("auto", "libtorch", "shim")


def _choose_runtime(stored: StoredCompiledGraph, device: str, runtime: object, on_set: bool) -> tuple[str, str]:
    """``(runtime, reason)`` for ``stored`` on ``device``: ``runtime`` (``"auto"``,
    ``"libtorch"``, ``"shim"``; ``None``: ``$TORCH_COMPILED_GRAPHS_RUNTIME``, else
    ``"auto"``) applied to the package's imports (``_native.choose_runtime``). A graph
    bound to a :class:`NativeWeightsSet` runs on libtorch, as the set does."""
    if runtime is not None and runtime not in _RUNTIME_OPTIONS:
        raise BindingError(
            f"runtime must be one of {', '.join(map(repr, _RUNTIME_OPTIONS))}, got {runtime!r}", "run.option_invalid"
        )
    wanted = runtime if runtime is not None else os.environ.get("TORCH_COMPILED_GRAPHS_RUNTIME") or "auto"
    if on_set:
        if wanted == "shim":
            raise BindingError(
                "the shim runtime was asked for, but a NativeWeightsSet holds its tensors on libtorch: "
                "load from weights files to run on the shim",
                "run.native_unsupported",
            )
        return "libtorch", "bound to a weights set (weights sets run on libtorch)"
    if device.startswith("cuda") and wanted != "libtorch":
        # Before the choice: on CUDA, `auto` picks the shim only where a CUDA runtime
        # is found, and the wheel's is the one this process can offer.
        _load_cuda_runtime()
    return _native.choose_runtime(os.fspath(stored.package_path), stored.graph_class, device, runtime)


class NativeGraph:
    """A resolved graph loaded without torch: call it like the original module, with arrays."""

    def __init__(
        self,
        stored: StoredCompiledGraph,
        weights: StrPath | Sequence[StrPath] | NativeWeightsSet,
        *,
        device: str | None = None,
        torch_lib: StrPath | None = None,
        strip_prefix: str = "",
        add_prefix: str = "",
        cuda_graphs: bool | None = None,
        max_captures: int | None = None,
        runtime: str | None = None,
        cuda_graph_outputs: str = "copy",
    ) -> None:
        self._stored = stored
        self._naming = _naming(strip_prefix, add_prefix)
        if cuda_graph_outputs not in ("copy", "static"):
            raise BindingError(
                f"cuda_graph_outputs must be one of ['copy', 'static'], got {cuda_graph_outputs!r}",
                "run.option_invalid",
            )
        # "static": replayed calls return the capture's output buffers (no copy);
        # `static_outputs()` asks that for one thread's calls in a block.
        self._static_default = cuda_graph_outputs == "static"
        self._local = threading.local()
        captures_wanted, captures_max, captures_off = _capture_options(cuda_graphs, max_captures)
        #: Names the weights provided that the graph does not bind: declared
        #: constants the compiler dropped (unused by the compiled code).
        self.ignored_constants: list[str] = []
        #: Tensors of the weights skipped for lying outside ``strip_prefix``.
        self.outside_prefix = 0
        shared = weights if isinstance(weights, NativeWeightsSet) else None
        if device is None:
            if shared is not None:
                device = shared.device
            else:
                device = "cpu" if stored.sm.startswith("cpu") else "cuda:0"
        if not isinstance(device, str):
            raise BindingError(f"device must be a string such as 'cuda:0', got {device!r}", "run.device_mismatch")
        if shared is not None:
            if self._naming != ("", ""):
                raise BindingError(
                    "a NativeWeightsSet maps its names when it is opened: pass strip_prefix and add_prefix there",
                    "run.weights_invalid",
                )
            if shared.device != device:
                raise BindingError(
                    f"the weights set is on {shared.device}, the graph was asked to run on {device}",
                    "run.device_mismatch",
                )
            if torch_lib is None:
                torch_lib = shared._lib
        chose = time.perf_counter()
        runtime_name, runtime_reason = _choose_runtime(stored, device, runtime, shared is not None)
        chose_s = time.perf_counter() - chose
        #: The runtime the graph runs on: ``"shim-v1"`` (``libtcg_shim.so``, shipped
        #: inside the extension, no libtorch in the process) or ``"libtorch"``
        #: (docs/run.md, "Runtime").
        self.runtime: str = runtime_name
        #: Why: ``"every import (N aoti_torch_*) in shim set v1"``, the first
        #: imports outside the set, ``"libtorch already loaded in this process"``,
        #: ``"no CUDA runtime (libcudart.so.N) found for the shim: ..."``, ``"forced by option"``, ...
        self.runtime_reason: str = runtime_reason
        LOGGER.debug("load_native %s: runtime %s (%s)", stored.key, runtime_name, runtime_reason)
        if runtime_name == "libtorch":
            lib = find_torch_lib(torch_lib)
            #: How the installed torch was matched to the artifact's: ``"record digest"``
            #: or ``"not recorded"`` (the artifact states no digest to compare);
            #: ``"not needed (shim runtime)"`` when no torch is opened.
            self.torch_check = _check_torch(stored, lib)
        else:
            lib = ""
            self.torch_check = "not needed (shim runtime)"
            if device.startswith("cuda"):
                _load_cuda_runtime()
        self._lib = lib
        rows = [(r["fqn"], r["source"], r["dtype"], [int(d) for d in r["shape"]]) for r in stored.constants]
        literals = os.path.join(stored.path, "constants.safetensors")
        has_literals = any(r["source"] == "literal" for r in stored.constants)
        if device.startswith("cuda"):
            _prepare_cuda(captures_wanted, captures_max)
        started = time.perf_counter()
        # One overlapped step: the weights are read (and, on a GPU, copied to the
        # device) while libtorch is opened and the container created.
        if shared is not None:
            self._model, ignored, timings = _native.NativeModel.load_set(
                lib,
                os.fspath(stored.package_path),
                stored.graph_class,
                device,
                stored.sm,
                rows,
                stored.metadata,
                shared._set,
                literals if has_literals else None,
            )
            outside = shared.outside_prefix
        else:
            self._model, ignored, outside, timings = _native.NativeModel.load(
                lib,
                os.fspath(stored.package_path),
                stored.graph_class,
                device,
                stored.sm,
                rows,
                stored.metadata,
                _weight_paths(weights),
                literals if has_literals else None,
                *self._naming,
                runtime=(runtime_name, runtime_reason),
            )
        self.ignored_constants, self.outside_prefix = list(ignored), int(outside)
        #: How long each phase of loading took, in seconds (docs/run.md lists
        #: them): ``choose_runtime`` (the package's imports read), ``open_libraries``
        #: (libtorch's, or the shim's), ``extract_package``, ``open_model``,
        #: ``create_container``, ``plan_weights``, ``allocate_weights``,
        #: ``read_weights``, ``copy_weights``, ``bind_weights``, on a GPU
        #: ``cuda_init``, ``cuda_context``, ``cuda_runtime``, ``staging_ring`` and
        #: ``prime_blas`` (when the graph calls cuBLAS), then
        #: ``load_total``, and ``first_call`` once the first call returned.
        #: Extraction and the weights run beside opening the libraries, so the
        #: phases overlap; ``load_total`` is the wall time of the load.
        self.timings: dict[str, float] = {"choose_runtime": chose_s, **dict(timings)}
        self.timings["load_total"] = time.perf_counter() - started
        self._first_call_pending = True
        self._capture_pending = device.startswith("cuda") and captures_wanted
        self._stream = 0
        in_text, out_text = self._model.call_spec
        self._in = _parse_spec(in_text, "input")
        self._out = _parse_spec(out_text, "output", records=True)
        if (
            self._in[0] != "tuple"
            or len(self._in[1]) != 2
            or self._in[1][0][0] != "tuple"
            or self._in[1][1][0] != "dict"
        ):
            raise BindingError("the graph's input spec is not (args, kwargs)", "run.native_unsupported")
        if _count(self._out) != self._model.num_outputs:
            raise BindingError(
                f"the output spec has {_count(self._out)} leaves, the graph returns {self._model.num_outputs}",
                "run.native_unsupported",
            )
        self._facts = self._input_facts()
        if self.device == "cpu":
            reason: str | None = "a cpu graph has no CUDA graphs"
        elif not captures_wanted:
            reason = captures_off
        else:
            reason = self._model.set_captures(True, captures_max)
        self._captures_off = reason
        if reason is not None:
            LOGGER.debug("load_native %s: CUDA graphs off: %s", stored.key, reason)
        _log_timings(f"load_native {stored.key}", self.timings)

    def _input_facts(self) -> list[tuple[int | None, str, list[Any]]]:
        """Per tensor input: its flat position (from the ingress, else None), dtype
        and dims (an int, a symbol name, or a ``(lo, hi)`` pair)."""
        pytree = self._stored.metadata["graph_class"]["graph"].get("pytree", {})
        ingress = pytree.get("ingress") if isinstance(pytree, dict) else None
        if isinstance(ingress, dict):
            rows = sorted(ingress["inputs"], key=lambda r: r["position"])
            self._symbols: Mapping[str, Sequence[int]] = ingress.get("symbols", {})
            if len(rows) != self._model.num_inputs:
                raise BindingError(
                    f"the call ingress lists {len(rows)} inputs, the graph takes {self._model.num_inputs}",
                    "run.package_invalid",
                )
            return [(int(r["position"]), str(r["dtype"]), list(r["shape"])) for r in rows]
        self._symbols = {}
        facts = self._model.input_facts
        if facts is None:
            raise BindingError(
                "the artifact records no call ingress and its wrapper states no input checks, so inputs cannot be "
                "checked before a call; use load()",
                "run.native_unsupported",
            )
        return [(None, dtype, dims) for dtype, dims in facts]

    @property
    def constant_fqns(self) -> list[str]:
        """The fqns the weights file must hold (parameters and buffers), in table order."""
        return list(self._model.weight_fqns)

    @property
    def cuda_graphs(self) -> bool:
        """Whether calls are replayed as CUDA graphs (docs/run.md, "CUDA graphs")."""
        return self.cuda_graphs_reason is None

    @property
    def cuda_graphs_reason(self) -> str | None:
        """Why calls are not replayed as CUDA graphs (``None`` while they are): off by
        option or environment, a CPU graph, libtorch's caching allocator in this
        process, a runtime without what capture needs, or a capture that failed."""
        if self._captures_off is not None:
            return self._captures_off
        return self._model.captures_reason

    @property
    def stats(self) -> dict[str, float]:
        """What CUDA-graph capture did: ``captures``, ``replays``, ``evictions``,
        ``invalidated`` (dropped by a rebind), ``fallbacks``, ``uncaptured_runs``,
        ``captured`` (now) and ``capture_seconds``."""
        stats = dict(self._model.capture_stats())
        stats.pop("last_capture_seconds", None)
        return stats

    @contextlib.contextmanager
    def static_outputs(self) -> Iterator[None]:
        """Within ``with graph.static_outputs():``, replayed calls of this thread return
        the capture's output buffers without a copy, as ``cuda_graph_outputs="static"``
        does: valid only until this graph's next call (of any shape), which overwrites
        them; uncaptured calls return new tensors either way (docs/run.md)."""
        before = getattr(self._local, "static", None)
        self._local.static = True
        try:
            yield
        finally:
            if before is None:
                del self._local.static
            else:
                self._local.static = before

    @property
    def torch_lib(self) -> str:
        """The libtorch directory the graph runs with (on the shim runtime: the
        path ``libtcg_shim.so`` was opened from)."""
        return str(self._model.torch_lib)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``: where the graph runs and its outputs live."""
        return self._model.device

    @property
    def stream(self) -> int:
        """The ``cudaStream_t`` calls queue their work on (0, the default: the legacy
        default stream). Set it to a stream of the graph's device (CuPy's
        ``stream.ptr``, torch's ``stream.cuda_stream``) to run there; inputs are
        ordered before it through DLPack, outputs remember it for their consumers."""
        return self._stream

    @stream.setter
    def stream(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BindingError(f"a stream is a non-negative cudaStream_t handle, got {value!r}", "run.call_invalid")
        if value and self.device == "cpu":
            raise BindingError("a CPU graph runs on no stream", "run.call_invalid")
        self._stream = value

    def synchronize(self) -> None:
        """Block until the work queued on :attr:`stream` is done (nothing to wait for on CPU)."""
        if self.device != "cpu":
            # Through the graph's own runtime: libtorch's CUDA runtime, or the shim's.
            self._model.synchronize(self._stream)

    @property
    def added_nbytes(self) -> int:
        """Bytes of constants the last bind added for this graph alone: everything it
        read when bound from files, only its literals when bound to a
        :class:`NativeWeightsSet` (the constants the compiled code folds live in the
        container's own buffers, whose size it does not report: not counted)."""
        return int(self._model.added_bytes)

    def rebind(self, weights: StrPath | Sequence[StrPath] | NativeWeightsSet) -> None:
        """Bind new weights (the forms :meth:`StoredCompiledGraph.load_native` takes, with
        the prefixes given at load, or a :class:`NativeWeightsSet` on the graph's device)
        with the same checks as loading; a refused rebind leaves the bound weights in place."""
        literals = os.path.join(self._stored.path, "constants.safetensors")
        has_literals = any(r["source"] == "literal" for r in self._stored.constants)
        if isinstance(weights, NativeWeightsSet):
            if weights.device != self.device:
                raise BindingError(
                    f"the weights set is on {weights.device}, the graph runs on {self.device}",
                    "run.device_mismatch",
                )
            ignored, timings = self._model.bind_set(weights._set, literals if has_literals else None)
            self.ignored_constants, self.outside_prefix = list(ignored), weights.outside_prefix
        else:
            ignored, outside, timings = self._model.bind(
                _weight_paths(weights), literals if has_literals else None, *self._naming
            )
            self.ignored_constants, self.outside_prefix = list(ignored), int(outside)
        _log_timings(f"rebind {self._stored.key}", dict(timings))

    def _check(self, index: int, path: str, dtype: str, shape: list[int], bound: dict[str, int]) -> None:
        _, want, dims = self._facts[index]
        bad = "run.input_mismatch"
        if dtype != want:
            raise BindingError(f"input {path} is {dtype}, the graph was compiled for {want}", bad)
        if len(shape) != len(dims):
            raise BindingError(f"input {path} has rank {len(shape)}, the graph was compiled for {len(dims)}", bad)
        for k, (size, dim) in enumerate(zip(shape, dims, strict=True)):
            if isinstance(dim, int):
                if size != dim:
                    raise BindingError(f"input {path} has size {size} at dimension {k}, the graph needs {dim}", bad)
            elif isinstance(dim, str):
                lo, hi = self._symbols[dim]
                if not lo <= size <= hi:
                    raise BindingError(
                        f"input {path} has size {size} at dimension {k}; {dim} must be in [{lo}, {hi}]", bad
                    )
                if bound.setdefault(dim, size) != size:
                    raise BindingError(
                        f"input {path} has size {size} at dimension {k}, but {dim} is {bound[dim]} elsewhere", bad
                    )
            else:
                lo, hi = dim
                if (lo is not None and size < lo) or (hi is not None and size > hi):
                    raise BindingError(f"input {path} has size {size} at dimension {k}, outside [{lo}, {hi}]", bad)

    def _check_device(self, path: str, device: str) -> None:
        """A tensor on the graph's device runs in place and host memory is copied to it
        (the native path's contract for numpy arrays); a tensor on any other device is
        refused before the run (``run.call_invalid``), never read through a pointer of
        another address space."""
        if device != self.device and device != "cpu":
            raise BindingError(
                f"input {path} is on {device}, the graph runs on {self.device}: move it there first",
                "run.call_invalid",
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run with the original module's ``(args, kwargs)`` convention; arrays in, arrays out."""
        flat: list[tuple[str, Any]] = []
        _flatten(self._in, (args, kwargs), "", flat)
        arrays = [(i, path, value) for i, (path, value) in enumerate(flat) if _is_array(value)]
        if len(arrays) != self._model.num_inputs:
            raise BindingError(
                f"the call holds {len(arrays)} arrays, the graph takes {self._model.num_inputs}", "run.call_invalid"
            )
        inputs: list[_native.DLPackInput | tuple[int, int, str, list[int]]] = []
        keep = []
        bound: dict[str, int] = {}
        for n, (position, path, value) in enumerate(arrays):
            expected = self._facts[n][0]
            if expected is not None and expected != position:
                raise BindingError(f"argument {path} is an array where the graph takes none", "run.call_invalid")
            if not hasattr(value, "__array_interface__") and hasattr(value, "__dlpack__"):
                taken = _dlpack(path, value, self._stream)
                self._check(n, path, taken.dtype, list(taken.shape), bound)
                self._check_device(path, taken.device)
                inputs.append(taken)
                keep.append(value)
                continue
            address, nbytes, dtype, shape, held = _buffer(path, value)
            self._check(n, path, dtype, shape, bound)
            inputs.append((address, nbytes, dtype, shape))
            keep.append(held)
        # `keep` holds every input object (or its exported view) until the run returns.
        started = time.perf_counter() if self._first_call_pending else 0.0
        static = getattr(self._local, "static", self._static_default)
        outputs = self._model.run(inputs, self._stream, static)
        del keep, arrays
        if self._capture_pending:
            last = self._model.capture_stats().get("last_capture_seconds")
            if last is not None:
                self._capture_pending = False
                self.timings["capture"] = float(last)
                LOGGER.debug("captured %s in %.1f ms", self._stored.key, last * 1e3)
        if self._first_call_pending:
            # The first call folds the computed constants and loads the kernels.
            self._first_call_pending = False
            self.timings["first_call"] = time.perf_counter() - started
            LOGGER.debug("first call of %s: %.1f ms", self._stored.key, self.timings["first_call"] * 1e3)
        return _unflatten(self._out, iter(outputs))

    def __repr__(self) -> str:
        return f"NativeGraph(key={self._stored.key!r}, device={self.device!r}, torch_lib={self.torch_lib!r})"


def from_buffer(
    buffer: Any,
    dtype: str,
    shape: Sequence[int],
    *,
    device: str = "cpu",
    stream: int = 0,
    torch_lib: StrPath | None = None,
) -> _native.NativeTensor:
    """A new tensor of ``dtype`` (an inductor dtype name, ``bfloat16`` included) and
    ``shape`` on ``device``, copied from the bytes of ``buffer`` (a C-contiguous host
    array or bytes-like object of exactly that many bytes), without importing torch.

    The way to make inputs of a dtype numpy has no type for (``bfloat16``), or to
    place an input on the GPU once and reuse it across calls."""
    dims = _checked_shape("the tensor", shape)
    lib = find_torch_lib(torch_lib)
    if isinstance(buffer, bytes):
        buffer = bytearray(buffer)
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise BindingError("the buffer is not C-contiguous", "run.input_layout")
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(flat)) if flat.nbytes and not flat.readonly else 0
    if flat.readonly and flat.nbytes:
        copy = bytearray(flat)
        flat = memoryview(copy)
        address = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    # `flat` (and the object it views) stays referenced until the copy returned.
    return _native.upload(lib, address, flat.nbytes, dtype, dims, device, stream)


# numpy dtypes of the float types ``to_numpy`` converts to (and from).
_FLOATS = ("float16", "float32", "float64")


def to_numpy(tensor: Any, dtype: str | None = None) -> Any:
    """A numpy array of ``tensor`` (a :class:`NativeTensor`, on the host or a GPU), without torch.

    With ``dtype=None`` the array has the tensor's own type (a zero-copy view of a
    host tensor; ``bfloat16`` has no numpy type and is refused: ask for a float).
    With ``dtype="float32"`` (or ``"float64"``, ``"float16"``) a new array of that
    type: a ``bfloat16`` tensor is widened exactly (its 16 bits are the upper half
    of the float32 with the same value, NaN and infinity included), other types
    are converted by numpy's ``astype``. A GPU tensor is copied to the host first
    (after the graph's stream).
    """
    import numpy as np

    if not isinstance(tensor, _native.NativeTensor):
        raise BindingError(
            f"to_numpy takes a NativeTensor (an output of load_native), got {type(tensor).__qualname__}",
            "run.call_invalid",
        )
    if dtype is not None and dtype not in _FLOATS:
        raise BindingError(f"to_numpy converts to one of {list(_FLOATS)}, not {dtype!r}", "run.call_invalid")
    host = tensor if tensor.device == "cpu" else tensor.cpu()
    if host.dtype == "bfloat16":
        if dtype is None:
            raise BindingError(
                "numpy has no bfloat16 type; pass dtype='float32' for an exact widening", "run.call_invalid"
            )
        bits = np.asarray(host).view(np.uint16)
        widened = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
        if dtype == "float32":
            return widened
        array = widened
    else:
        array = np.asarray(host)
        if dtype is None:
            return array
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and out-of-range values convert as numpy does
        return array.astype(dtype)
