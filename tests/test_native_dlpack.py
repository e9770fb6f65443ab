"""DLPack in and out of the native load path on the CPU (the CUDA side runs in
``tests/test_cuda.py`` on a GPU machine): outputs exported without a copy to
numpy and torch (legacy and versioned capsules), inputs taken from any
``__dlpack__`` producer and checked like arrays, tensors made from raw bytes
(``bfloat16`` included), and the refusals."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from torch_compiled_graphs import StoredCompiledGraph, _native
from torch_compiled_graphs.native import NativeGraph, from_buffer

from .conftest import REFERENCE
from .conftest import refused_binding as refused

WEIGHTS = REFERENCE / "mlp-cpu.weights.safetensors"


def test_outputs_export_to_numpy_without_a_copy(native: NativeGraph, io: dict[str, np.ndarray]) -> None:
    out = native(io["x"])
    assert out.device == "cpu" and out.__dlpack_device__() == (1, 0) and native.device == "cpu"
    y = np.from_dlpack(out)
    np.testing.assert_allclose(y, io["y"], rtol=1e-5, atol=1e-6)
    assert y.__array_interface__["data"][0] == out.__array_interface__["data"][0]
    # The exported array keeps the output's memory alive after the output is gone.
    del out
    gc.collect()
    np.testing.assert_allclose(y, io["y"], rtol=1e-5, atol=1e-6)


def test_legacy_and_versioned_capsules_and_unconsumed_ones(native: NativeGraph, io: dict[str, np.ndarray]) -> None:
    out = native(io["x"])
    legacy = out.__dlpack__()
    versioned = out.__dlpack__(max_version=(1, 0))
    assert '"dltensor"' in repr(legacy) and '"dltensor_versioned"' in repr(versioned)
    del legacy  # never consumed: its destructor releases the export
    # A capsule outlives the output and is still valid when consumed later.
    del out
    gc.collect()
    taken = _native.DLPackInput(versioned)
    assert (taken.dtype, taken.shape, taken.device) == ("float32", [4, 8], "cpu")
    assert '"used_dltensor_versioned"' in repr(versioned)
    # A consumed capsule cannot be consumed again.
    refused("run.input_layout", _native.DLPackInput, versioned)
    refused("run.input_layout", _native.DLPackInput, object())


def test_export_arguments_of_the_array_api_are_honoured(native: NativeGraph, io: dict[str, np.ndarray]) -> None:
    out = native(io["x"])
    with pytest.raises(BufferError):
        out.__dlpack__(stream=1)  # a host tensor has no stream
    with pytest.raises(BufferError):
        out.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        out.__dlpack__(copy=True)
    assert '"dltensor"' in repr(out.__dlpack__(stream=None, dl_device=(1, 0), copy=False))


def test_torch_tensors_go_in_and_come_out_through_dlpack(native: NativeGraph, io: dict[str, np.ndarray]) -> None:
    import torch
    from torch.utils.dlpack import from_dlpack

    x = torch.from_numpy(io["x"].copy())
    out = native(x)  # a torch tensor has __dlpack__ and no __array_interface__
    y = from_dlpack(out)
    assert y.data_ptr() == out.__array_interface__["data"][0]
    torch.testing.assert_close(y, torch.from_numpy(io["y"]), rtol=1e-5, atol=1e-6)
    # Inputs are checked as arrays are, before the graph runs.
    refused("run.input_mismatch", native, x.double())
    refused("run.input_mismatch", native, x.to(torch.bfloat16))
    refused("run.input_mismatch", native, x[:3])
    refused("run.input_layout", native, torch.zeros(16, 4).T)
    # A size-1 dimension with an odd stride is still contiguous memory.
    one = torch.from_numpy(io["x"][:1].copy())
    odd = torch.as_strided(one, (1, 16), (999, 1))
    assert odd.stride() == (999, 1)
    assert _native.DLPackInput(odd.__dlpack__()).shape == [1, 16]


def test_from_buffer_makes_tensors_numpy_has_no_type_for(graph: StoredCompiledGraph) -> None:
    import torch
    from torch.utils.dlpack import from_dlpack

    values = torch.tensor([[1.5, -2.0, 3.25], [0.0, 1e-3, -7.0]], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().view(np.uint16)
    t = from_buffer(raw, "bfloat16", [2, 3])
    assert (t.dtype, t.shape, t.device) == ("bfloat16", (2, 3), "cpu")
    assert torch.equal(from_dlpack(t), values)
    assert from_buffer(raw.tobytes(), "bfloat16", (2, 3)).shape == (2, 3)  # read-only bytes are copied
    back = t.cpu()
    assert back.__array_interface__["data"][0] != t.__array_interface__["data"][0]
    refused("run.input_layout", from_buffer, raw, "bfloat16", [4, 3])
    refused("run.input_mismatch", from_buffer, raw, "complex64", [3])
    refused("run.input_layout", from_buffer, np.zeros((4, 4), np.float32)[:, ::2], "float32", [8])
    refused("run.device_mismatch", from_buffer, raw, "bfloat16", [2, 3], device="gpu")


def test_a_cpu_graph_takes_no_stream_and_refuses_gpu_inputs(graph: StoredCompiledGraph, native: NativeGraph) -> None:
    refused("run.call_invalid", setattr, native, "stream", 5)
    refused("run.call_invalid", setattr, native, "stream", -1)
    native.stream = 0
    native.synchronize()  # nothing queued on a CPU graph

    class FakeCuda:
        """A producer claiming CUDA memory: refused before anything reads it."""

        def __init__(self) -> None:
            self.inner = np.zeros((4, 16), np.float32)
            self.streams: list[object] = []

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

        def __dlpack__(self, stream: object = None) -> object:
            self.streams.append(stream)
            cap = self.inner.__dlpack__()
            return _retag_cuda(cap)

    fake = FakeCuda()
    err = refused("run.call_invalid", native, fake)
    assert "cuda:0" in str(err) and "cpu" in str(err)
    assert fake.streams == [1]  # the legacy default stream, in DLPack's spelling


def _retag_cuda(capsule: object) -> object:
    """The same legacy capsule with its DLDevice rewritten to CUDA device 0."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    # DLTensor: data (8 bytes), then DLDevice {int32 device_type, int32 device_id}.
    ctypes.c_int32.from_address(managed + 8).value = 2
    return capsule


def _reshaped(capsule: object, dims: list[int]) -> object:
    """The same legacy capsule with its shape values rewritten (the rank is kept)."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    # DLTensor: data (8), device (8), ndim (4), dtype (4), then the shape pointer.
    assert ctypes.c_int32.from_address(managed + 16).value == len(dims)
    shape = ctypes.c_void_p.from_address(managed + 24).value
    assert shape
    for i, d in enumerate(dims):
        ctypes.c_int64.from_address(shape + 8 * i).value = d
    return capsule


def test_overflowing_shapes_are_binding_errors_never_panics(native: NativeGraph) -> None:
    """Issue 25: a DLPack shape whose byte size overflows raised PanicException; every size
    computed from an untrusted shape (DLPack, __array_interface__, from_buffer) is checked."""
    for dims in ([2**62, 2], [2**61, 1], [2**63 - 1, 2**63 - 1]):
        cap = _reshaped(np.zeros((4, 16), np.float32).__dlpack__(), dims)
        refused("run.input_layout", _native.DLPackInput, cap)

    class Hostile:
        def __init__(self, shape: object) -> None:
            self.inner = np.zeros((4, 16), np.float32)
            self.__array_interface__ = {
                "shape": shape,
                "typestr": "<f4",
                "data": (self.inner.__array_interface__["data"][0], False),
                "strides": None,
                "version": 3,
            }

    for shape in ((2**62, 2**62), (2**64, 1), (4, -16), ("4", 16), None):
        refused("run.input_layout", native, Hostile(shape))
    raw = np.zeros(6, np.uint16)
    for shape in ([2**62, 2**62], [2**64], [-1, 6], ["a"]):
        refused("run.input_layout", from_buffer, raw, "bfloat16", shape)
