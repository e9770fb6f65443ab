"""What both load paths share, in one module below them (imports neither torch nor the engine).

``load()`` (:mod:`.runner`, with :mod:`.weights_set`, :mod:`._native_loader`,
:mod:`.capture`, :mod:`.binding`, :mod:`.dropin`) and ``load_native()``
(:mod:`.native`) take weights, prefixes and calls the same way and report the
same timings. The helpers for that live here rather than as private names of
one load path imported by the others:

- naming: :func:`naming` checks ``strip_prefix`` / ``add_prefix``,
  :func:`renamed` applies them to a mapping of tensors and :func:`source_name`
  maps a bound name back to the caller's;
- weight paths: :func:`weight_paths`, the checkpoint argument as a list of paths;
- call specs: :func:`parse_spec` reads torch's treespec JSON (with
  :func:`context`), :func:`flatten` / :func:`unflatten` / :func:`count` walk
  the result;
- DLPack inputs: :func:`dlpack` takes an array through ``__dlpack__``, ordered
  before the run's stream;
- CUDA-graph options: :data:`MAX_CAPTURES`, the variables :data:`ENV_CUDA_GRAPHS`
  and :data:`ENV_MAX_CAPTURES`, read by :func:`flag` and :func:`capture_count`;
- input layouts: :func:`input_strides` reads the strides a package's graph reads
  each input with, :func:`laid_out` lays a tensor out that way (torch's loader
  reads an input's memory with the strides the graph was compiled for);
- timings: :func:`log_timings`;
- the libtorch-free variant under torch: :func:`torch_package_loader` opens a
  package with torch's loader, making libtorch's C shim global first when the
  ``.so`` was built with ``link_libtorch=False`` (docs/keys.md, "Variants").

Layering (``tests/test_layering.py`` holds it): the engine
(:class:`~torch_compiled_graphs.engine.StoredCompiledGraph`) imports the load
paths lazily, from ``load`` and ``load_native``; the load paths import this
module and never import the engine back at run time (they name
``StoredCompiledGraph`` in annotations only, under ``TYPE_CHECKING``, and use
what the instance they are given carries). This module imports only the
standard library, :mod:`.errors` and :mod:`.outputs` (both torch-free), and
the native extension lazily, inside :func:`dlpack` and :func:`input_strides`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .errors import BindingError
from .outputs import GraphOutput, is_output_record

_UNRESOLVED_SHIM = "undefined symbol: aoti_torch_"


def _expose_libtorch_shim(torch: Any) -> None:
    """Put libtorch's already loaded libraries in the process's global symbol scope.

    A ``.so`` built with ``link_libtorch=False`` (the libtorch-free variant) has no
    ``DT_NEEDED`` on libtorch: its ``aoti_torch_*`` imports resolve against whatever is
    global. torch loads libtorch without ``RTLD_GLOBAL``, so in a torch process they are
    not; re-opening the same files with ``RTLD_NOLOAD | RTLD_GLOBAL`` promotes them and
    loads nothing new.
    """
    import ctypes

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cuda.so"):
        path = os.path.join(lib, name)
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
            except OSError:  # not loaded in this process (a CPU-only torch has no libtorch_cuda)
                continue


def torch_package_loader(torch: Any, package: str, entry: str, single_threaded: bool, device_index: int) -> Any:
    """torch's ``AOTIModelPackageLoader`` for ``entry`` of ``package``.

    Positional arguments ``(path, entry, run_single_threaded, num_runners,
    device_index)``, the form torch 2.11 and 2.15 share. A package of the
    libtorch-free variant fails to open with an unresolved ``aoti_torch_*`` import
    until libtorch's shim is global (:func:`_expose_libtorch_shim`); then it is
    opened again, served by libtorch's implementation of the same functions.
    """
    try:
        return torch._C._aoti.AOTIModelPackageLoader(package, entry, single_threaded, 1, device_index)
    except RuntimeError as exc:
        if _UNRESOLVED_SHIM not in str(exc):
            raise
    _expose_libtorch_shim(torch)
    return torch._C._aoti.AOTIModelPackageLoader(package, entry, single_threaded, 1, device_index)


TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from typing import Any, TypeAlias

    from . import _native

    #: A path argument: what ``os.fspath`` takes.
    StrPath: TypeAlias = str | os.PathLike[str]
    #: A parsed call spec: ``("leaf",)`` | ``("tuple" | "list", children)`` |
    #: ``("dict", keys, children)`` | ``("record", type name, fields, children)``
    #: (an output class read as a GraphOutput).
    Spec: TypeAlias = tuple[Any, ...]

__all__ = [
    "ENV_CUDA_GRAPHS",
    "ENV_MAX_CAPTURES",
    "MAX_CAPTURES",
    "capture_count",
    "context",
    "count",
    "dlpack",
    "flag",
    "flatten",
    "log_timings",
    "naming",
    "parse_spec",
    "renamed",
    "source_name",
    "unflatten",
    "weight_paths",
]

LOGGER = logging.getLogger("torch_compiled_graphs")


def input_strides(package: str | os.PathLike[str]) -> list[list[int | None]] | None:
    """The static strides the package's graph reads each input with (``None`` items
    where the wrapper states none), or ``None`` when its wrapper states no input checks."""
    from . import _native

    return _native.package_input_strides(os.fspath(package))


def laid_out(value: Any, strides: Sequence[int | None] | None, name: str) -> Any:
    """``value`` (a torch tensor) in the layout the graph reads this input with.

    Compiled code reads an input with the strides of the exported example: a graph
    minted from a channels-last image reads channels-last memory whatever it is
    given, and one minted C-contiguous (every mint of this version) reads row-major
    memory. A tensor already laid out so is passed as it is; otherwise a copy is made
    in that layout: row-major when every stride the graph states is row-major,
    exactly the graph's strides when it states them all. A graph that states some
    strides only (symbolic ones), not row-major, and a tensor laid out otherwise is
    refused (``run.input_layout``): its layout cannot be rebuilt from what is known."""
    if strides is None or len(strides) != value.dim():
        return value  # no checks stated, or a rank the call checks reject
    if value.stride() == tuple(strides):
        return value  # the common case, on every call: exactly the graph's layout
    shape = tuple(value.shape)
    row_major = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        row_major[k] = row_major[k + 1] * max(shape[k + 1], 1)

    def fits(have: Any) -> bool:
        return all(s is None or n <= 1 or s == h for s, n, h in zip(strides, shape, have, strict=True))

    if fits(row_major):
        return value if value.is_contiguous() else value.contiguous()
    if fits(value.stride()):
        return value
    if all(s is not None for s in strides):
        return value.new_empty_strided(shape, [int(s) for s in strides if s is not None]).copy_(value)
    raise BindingError(
        f"{name} has strides {list(value.stride())}; the graph reads it with strides "
        f"{['?' if s is None else s for s in strides]} (its exported example's layout, partly symbolic): "
        "pass it in that layout (for a channels-last image: x.contiguous(memory_format=torch.channels_last))",
        "run.input_layout",
    )


def log_timings(what: str, timings: Mapping[str, float]) -> None:
    """Log a load's phase timings (seconds, shown in ms) at debug level."""
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("%s: %s", what, ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))


# ---------------------------------------------------------------------- naming


def naming(strip_prefix: object, add_prefix: object) -> tuple[str, str]:
    """``(strip_prefix, add_prefix)``, checked to be strings (``run.weights_invalid``)."""
    if not isinstance(strip_prefix, str) or not isinstance(add_prefix, str):
        raise BindingError("strip_prefix and add_prefix must be strings", "run.weights_invalid")
    return strip_prefix, add_prefix


def renamed(named: dict[str, Any], strip_prefix: str, add_prefix: str) -> tuple[dict[str, Any], int]:
    """``named`` with ``strip_prefix`` taken off and ``add_prefix`` put on each name,
    and how many entries were skipped for lying outside ``strip_prefix``."""
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


def source_name(name: str, naming: tuple[str, str]) -> str:
    """The caller's name of a tensor :func:`renamed` named ``name``."""
    strip_prefix, add_prefix = naming
    return strip_prefix + name[len(add_prefix) :]


def weight_paths(weights: object) -> list[str]:
    """The weights argument as a list of paths: one path, or a list or tuple of them."""
    items = list(weights) if isinstance(weights, (list, tuple)) else [weights]
    if not items:
        raise BindingError("no weights path was given", "run.weights_invalid")
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise BindingError(
                f"weights must be a path or a list of paths, got {type(item).__qualname__}", "run.weights_invalid"
            )
        out.append(os.fspath(item))
    return out


# ---------------------------------------------------------------- CUDA graphs

#: Shape sets captured at once per loaded graph, by default.
MAX_CAPTURES = 8
#: ``0`` (or ``false``, ``no``, ``off``) turns CUDA graphs off where ``load()`` is not told.
ENV_CUDA_GRAPHS = "TORCH_COMPILED_GRAPHS_CUDA_GRAPHS"
#: The default of ``max_captures`` where ``load()`` is not told.
ENV_MAX_CAPTURES = "TORCH_COMPILED_GRAPHS_MAX_CAPTURES"

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def flag(value: str, name: str) -> bool | None:
    """An on/off environment value: ``None`` when empty, else on or off (anything
    else is ``run.option_invalid``, naming the variable)."""
    text = value.strip().lower()
    if not text:
        return None
    if text in _OFF or text in _ON:
        return text in _ON
    raise BindingError(f"{name}={value!r}: use 0 or 1", "run.option_invalid")


def capture_count(value: object, name: str) -> int:
    """A number of captures (0 or more) given as an argument or an environment value
    (anything else is ``run.option_invalid``)."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise BindingError(f"{name}={value!r}: a number of captures (0 or more)", "run.option_invalid") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BindingError(f"{name} must be a number of captures (0 or more), got {value!r}", "run.option_invalid")
    return value


def capture_options(
    cuda_graphs: object, max_captures: object, environ: Mapping[str, str] = os.environ
) -> tuple[int, str | None]:
    """``(max_captures, reason_off)`` from the arguments, else the environment: an
    argument wins over its variable, an invalid value of either is
    ``run.option_invalid``; ``reason_off`` says why captures are off by option or
    environment (``None`` where they are wanted). Every load path decides this way."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise BindingError(f"cuda_graphs must be True or False, got {cuda_graphs!r}", "run.option_invalid")
    if max_captures is None:
        env_max = environ.get(ENV_MAX_CAPTURES, "").strip()
        count = capture_count(env_max, ENV_MAX_CAPTURES) if env_max else MAX_CAPTURES
    else:
        count = capture_count(max_captures, "max_captures")
    if cuda_graphs is None:
        if flag(environ.get(ENV_CUDA_GRAPHS, ""), ENV_CUDA_GRAPHS) is False:
            return count, f"{ENV_CUDA_GRAPHS} is off"
    elif not cuda_graphs:
        return count, "cuda_graphs=False"
    return count, None


# ----------------------------------------------------------------- tree specs


def context(node: dict[str, Any], default: str) -> Any:
    """A treespec node's context, decoded (``None`` when it is not JSON)."""
    try:
        return json.loads(node.get("context") or default)
    except (ValueError, TypeError):
        return None


def parse_spec(text: str, what: str, *, records: bool = False, unsupported: str = "run.native_unsupported") -> Spec:
    """Torch's treespec JSON (protocol 1) as nested tuples; tuple, list, dict and
    leaf nodes are understood, and with ``records`` the registered output classes
    of transformers and diffusers (:func:`~torch_compiled_graphs.outputs.is_output_record`),
    whose context is the list of their set fields; any other node is
    ``run.native_unsupported``, naming its type."""
    try:
        protocol, root = json.loads(text)
    except (ValueError, TypeError) as exc:
        raise BindingError(f"the graph's {what} spec is not a treespec: {exc}", unsupported) from exc
    if protocol != 1:
        raise BindingError(f"the graph's {what} spec uses treespec protocol {protocol}", unsupported)

    def node(n: Any) -> Spec:
        if not isinstance(n, dict) or not isinstance(n.get("children_spec"), list):
            raise BindingError(f"the graph's {what} spec is malformed", unsupported)
        kind, children = n.get("type"), [node(c) for c in n["children_spec"]]
        if kind is None and not children:
            return ("leaf",)
        if kind in ("builtins.tuple", "builtins.list"):
            return (kind.removeprefix("builtins."), children)
        if kind == "builtins.dict":
            keys = context(n, "[]")
            if not isinstance(keys, list) or len(keys) != len(children) or not all(isinstance(k, str) for k in keys):
                raise BindingError(f"the graph's {what} spec has a dict of non-string keys", unsupported)
            return ("dict", keys, children)
        if records and isinstance(kind, str) and is_output_record(kind):
            fields = context(n, "null")
            if (
                not isinstance(fields, list)
                or len(fields) != len(children)
                or not all(isinstance(f, str) for f in fields)
                or len(set(fields)) != len(fields)
            ):
                raise BindingError(
                    f"the graph's {what} spec has a {kind} node whose context is not its list of field names",
                    unsupported,
                )
            return ("record", kind, fields, children)
        if unsupported == "run.native_unsupported":
            hint = "the native path does not interpret it; use load()"
        else:
            hint = "torch cannot rebuild it in this process; import the module that registers it before load()"
        raise BindingError(f"the graph's {what} spec has a {kind} node: {hint}", unsupported)

    return node(root)


def flatten(spec: Spec, value: Any, path: str, out: list[tuple[str, Any]]) -> None:
    """Append ``(path, leaf)`` for each leaf of ``value`` laid out as ``spec`` (a
    value of another structure is ``run.call_invalid``, naming where)."""
    kind = spec[0]
    if kind == "leaf":
        out.append((path, value))
        return
    bad = f"argument {path or '(call)'} must be"
    if kind in ("tuple", "list"):
        want = tuple if kind == "tuple" else list
        if not isinstance(value, want) or len(value) != len(spec[1]):
            raise BindingError(f"{bad} a {kind} of {len(spec[1])}, got {_describe(value)}", "run.call_invalid")
        for i, (child, item) in enumerate(zip(spec[1], value, strict=True)):
            flatten(child, item, f"{path}[{i}]", out)
        return
    keys: list[str] = spec[1]
    if not isinstance(value, dict) or sorted(value) != sorted(keys):
        got = sorted(value) if isinstance(value, dict) else _describe(value)
        raise BindingError(f"{bad} a dict with keys {sorted(keys)}, got {got}", "run.call_invalid")
    for key, child in zip(keys, spec[2], strict=True):
        flatten(child, value[key], f"{path}[{key!r}]", out)


def count(spec: Spec) -> int:
    """The number of leaves of ``spec``."""
    if spec[0] == "leaf":
        return 1
    return sum(count(c) for c in spec[-1])


def unflatten(spec: Spec, leaves: Iterator[Any]) -> Any:
    """The value of structure ``spec`` built from ``leaves`` (records as :class:`GraphOutput`)."""
    kind = spec[0]
    if kind == "leaf":
        return next(leaves)
    if kind == "tuple":
        return tuple(unflatten(c, leaves) for c in spec[1])
    if kind == "list":
        return [unflatten(c, leaves) for c in spec[1]]
    if kind == "record":
        return GraphOutput(spec[1], spec[2], [unflatten(c, leaves) for c in spec[3]])
    return {k: unflatten(c, leaves) for k, c in zip(spec[1], spec[2], strict=True)}


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__qualname__


# ---------------------------------------------------------------------- inputs


def dlpack(path: str, value: Any, stream: int) -> _native.DLPackInput:
    """Take ``value`` through its ``__dlpack__``; a CUDA producer is asked to order
    its pending work before ``stream`` (ours: 0 is the legacy default stream, which
    DLPack spells 1)."""
    from . import _native

    try:
        kind, _ = value.__dlpack_device__()
        if int(kind) == 2:  # kDLCUDA
            capsule = value.__dlpack__(stream=stream or 1)
        else:
            capsule = value.__dlpack__()
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise BindingError(f"input {path} cannot be exported through DLPack: {exc}", "run.input_layout") from exc
    return _native.DLPackInput(capsule)
