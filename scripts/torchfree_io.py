"""Inputs, outputs and checks for processes that must never load libtorch (issue 34).

Used by the children of the shim stage (``scripts/shim_child.py``) and by the
cold-start benchmark's native way (``scripts/coldstart.py``). Nothing here imports
torch or opens a libtorch library:

- :func:`read_safetensors` / :func:`write_safetensors`: tensors as raw bytes, any
  dtype (``bfloat16`` included, which numpy has no type for);
- :class:`RawTensor`: a tensor made from raw bytes, exported through DLPack, on the
  host or on a CUDA device (allocated and filled through the CUDA driver API, so no
  runtime library is needed). ``torch_compiled_graphs.native.from_buffer`` would do
  the same, but it opens libtorch to allocate, which a libtorch-free worker must not;
- :func:`leaves`: the flat outputs of a ``load_native`` call, in the graph's order;
- :func:`mapped_libraries`: the libtorch and shim libraries this process has mapped,
  read from ``/proc/self/maps``.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

#: safetensors dtype name -> (inductor dtype name, bytes per element).
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_BY_NAME = {name: (code, size) for code, (name, size) in SAFETENSORS_DTYPES.items()}

#: DLPack's ``DLDataTypeCode`` and bits by inductor dtype name.
_DL_DTYPES = {
    "float64": (2, 64),
    "float32": (2, 32),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "int64": (0, 64),
    "int32": (0, 32),
    "int16": (0, 16),
    "int8": (0, 8),
    "uint8": (1, 8),
    "bool": (6, 8),
}
_KDLCPU, _KDLCUDA = 1, 2

Tensor = tuple[str, list[int], bytes]  # (dtype, shape, raw little-endian bytes)


def itemsize(dtype: str) -> int:
    return _BY_NAME[dtype][1]


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a safetensors file as ``(dtype, shape, bytes)``, in file order."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    out: dict[str, Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype, nbytes = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        count = 1
        for d in shape:
            count *= d
        if end - start != count * nbytes or end > len(data):
            raise ValueError(f"{path}: tensor {name} holds {end - start} bytes, not {count * nbytes}")
        out[name] = (dtype, shape, data[start:end])
    return out


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, Tensor]) -> None:
    """Write ``tensors`` (``(dtype, shape, bytes)`` by name) as a safetensors file."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, raw) in tensors.items():
        code, size = _BY_NAME[dtype]
        count = 1
        for d in shape:
            count *= d
        if len(raw) != count * size:
            raise ValueError(f"tensor {name}: {len(raw)} bytes for {dtype}{list(shape)}")
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, raw in tensors.values():
            f.write(raw)
    os.replace(tmp, path)


# ---------------------------------------------------------------------- DLPack


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    # No deleter: the memory belongs to the RawTensor, which outlives every consumer here.
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = b"dltensor"  # referenced by every capsule made below; lives as long as the module
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class CudaDriver:
    """The CUDA driver API through ctypes (``libcuda.so.1``): the device's primary
    context made current on this thread, device memory allocated and filled. The same
    primary context ``load_native`` runs in, on either runtime."""

    def __init__(self, index: int) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuInit.argtypes = [ctypes.c_uint]
        cu.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        cu.cuCtxSynchronize.argtypes = []
        for fn in (cu.cuInit, cu.cuDeviceGet, cu.cuDevicePrimaryCtxRetain, cu.cuCtxSetCurrent):
            fn.restype = ctypes.c_int
        cu.cuMemAlloc_v2.restype = cu.cuMemcpyHtoD_v2.restype = cu.cuCtxSynchronize.restype = ctypes.c_int
        self._cu = cu
        self._check(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(cu.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def upload(self, raw: bytes) -> int:
        """A new device allocation holding ``raw`` (the copy has finished on return)."""
        ptr = ctypes.c_uint64()
        self._check(self._cu.cuMemAlloc_v2(ctypes.byref(ptr), max(len(raw), 1)), "cuMemAlloc_v2")
        if raw:
            host = ctypes.create_string_buffer(raw, len(raw))
            self._check(self._cu.cuMemcpyHtoD_v2(ptr.value, ctypes.addressof(host), len(raw)), "cuMemcpyHtoD_v2")
        return int(ptr.value)

    def synchronize(self) -> None:
        """Wait for all work of the context (every stream of this device)."""
        self._check(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")


_DRIVERS: dict[int, CudaDriver] = {}


def driver(index: int) -> CudaDriver:
    if index not in _DRIVERS:
        _DRIVERS[index] = CudaDriver(index)
    return _DRIVERS[index]


class RawTensor:
    """A C-contiguous tensor of ``dtype`` and ``shape`` holding ``raw``, on ``device``
    (``cpu`` or ``cuda:N``), exported through DLPack (``__dlpack__``, a legacy
    ``dltensor`` capsule). The memory lives as long as this object (device memory:
    as long as the process)."""

    def __init__(self, raw: bytes, dtype: str, shape: list[int], device: str = "cpu") -> None:
        if dtype not in _DL_DTYPES:
            raise ValueError(f"no DLPack type for {dtype}")
        self.dtype, self.shape, self.device = dtype, [int(d) for d in shape], device
        self._host: Any = None
        if device == "cpu":
            self._host = (ctypes.c_char * max(len(raw), 1)).from_buffer_copy(raw or b"\0")
            self._data = ctypes.addressof(self._host)
            self._dl_device = (_KDLCPU, 0)
        elif device.startswith("cuda"):
            index = int(device.partition(":")[2] or 0)
            self._data = driver(index).upload(raw)
            self._dl_device = (_KDLCUDA, index)
        else:
            raise ValueError(f"unknown device {device!r}")
        self._exports: list[Any] = []  # every managed tensor and shape array handed out

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._dl_device

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        # The data was written before this object existed (device copies synchronous):
        # no stream needs to wait for anything.
        shape = (ctypes.c_int64 * max(len(self.shape), 1))(*self.shape)
        code, bits = _DL_DTYPES[self.dtype]
        managed = _DLManagedTensor()
        managed.dl_tensor.data = self._data
        managed.dl_tensor.device = _DLDevice(*self._dl_device)
        managed.dl_tensor.ndim = len(self.shape)
        managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
        managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        managed.dl_tensor.strides = None  # compact, row-major
        managed.dl_tensor.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = None
        self._exports.append((managed, shape))
        return _capsule_new(ctypes.addressof(managed), _CAPSULE_NAME, None)


def tensors_from(named: Mapping[str, Tensor], device: str) -> dict[str, RawTensor]:
    return {name: RawTensor(raw, dtype, shape, device) for name, (dtype, shape, raw) in named.items()}


# ---------------------------------------------------------------------- outputs


def leaves(value: Any) -> list[Any]:
    """The tensors of a ``load_native`` result in the graph's flat output order: a
    tuple or list in order, a dict or a ``GraphOutput`` record by its field order."""
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in leaves(item)]
    to_tuple = getattr(value, "to_tuple", None)
    if callable(to_tuple):  # a GraphOutput record
        return leaves(list(to_tuple()))
    if isinstance(value, Mapping):
        return leaves(list(value.values()))
    return [value]


def host_tensor(tensor: Any) -> Tensor:
    """A ``NativeTensor`` (on any device) as ``(dtype, shape, bytes)``, C-contiguous."""
    import numpy as np

    host = tensor if tensor.device == "cpu" else tensor.cpu()
    array = np.ascontiguousarray(np.asarray(host))
    return str(host.dtype), [int(d) for d in host.shape], array.tobytes()


def synchronizer(native: Any) -> tuple[Any, str]:
    """``(wait, how)``: a function that waits for ``native``'s queued work, and how it
    waits. ``NativeGraph.synchronize()`` where it works; where it fails (on the shim
    runtime it asks libtorch's directory, which that runtime does not have: a bug
    recorded as ``how``), the CUDA driver's ``cuCtxSynchronize``."""
    if native.device == "cpu":
        return (lambda: None), "cpu (nothing to wait for)"
    try:
        native.synchronize()
        return native.synchronize, "NativeGraph.synchronize"
    except Exception as exc:
        failed = f"{type(exc).__name__} [{getattr(exc, 'code', None)}]: {exc}"[:500]
    cuda = driver(int(native.device.partition(":")[2] or 0))
    cuda.synchronize()
    return cuda.synchronize, f"cuCtxSynchronize (NativeGraph.synchronize failed: {failed})"


def mapped_libraries() -> dict[str, list[str]]:
    """The libtorch (``libtorch*``, ``libc10*``) and shim (``libtcg_shim``) objects in
    this process's memory map, by file name."""
    names: set[str] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                names.add(os.path.basename(parts[5].strip()))
    libtorch = sorted(n for n in names if n.startswith(("libtorch", "libc10")))
    shim = sorted(n for n in names if "tcg_shim" in n)
    return {"libtorch": libtorch, "shim": shim}
