"""torch's package loader's surface, over the torch-free runner, for packages torch's loader cannot load.

A graph ``.so`` that carries its own C++ runtime (a compiler that links
libstdc++ statically, the GPU machine's default GCC among them) crashes
torch's ``AOTIModelPackageLoader`` in its constructor. The torch-free runner
(``crates/tcg-run``) opens the same ``.so`` in a local namespace and runs it.
:class:`NativeLoader` gives ``load()`` (``runner.LoadedGraph``) and parity at
mint (``_parity.run_compiled``) the four calls they make of torch's loader,
answered by that runner with libtorch from this process's torch: constants are
bound from the caller's tensors through ``NativeModel.bind_buffers`` (the
container keeps the memory, the loader keeps the tensors alive for as long as
they are bound), inputs go in and outputs come out as torch tensors through
DLPack, on torch's current stream. torch is imported lazily.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from . import _native

__all__ = ["NativeLoader", "needs_native_loader"]


def needs_native_loader(package: str | os.PathLike[str], entry: str) -> bool:
    """Whether entry ``entry`` of ``package`` must run through :class:`NativeLoader`: its
    ``.so`` defines the C++ runtime's symbols (``_native.package_own_cxx_runtime``)."""
    return bool(_native.package_own_cxx_runtime(os.fspath(package), entry))


def _torch_lib() -> str:
    """The lib directory of the torch this process imported: the libtorch the runner
    must share with it (one libtorch per process)."""
    import torch

    return os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib")


class NativeLoader:
    """``AOTIModelPackageLoader``'s ``get_constant_fqns``, ``get_call_spec``,
    ``load_constants`` and ``boxed_run``, made by the torch-free runner."""

    def __init__(
        self,
        package: str | os.PathLike[str],
        entry: str,
        device_index: int,
        sm: str,
        rows: Sequence[Mapping[str, Any]],
        single_threaded: bool = False,
    ) -> None:
        self.device = "cpu" if device_index < 0 else f"cuda:{device_index}"
        constants = [(r["fqn"], r["source"], r["dtype"], [int(d) for d in r["shape"]]) for r in rows]
        self._model = _native.NativeModel(_torch_lib(), os.fspath(package), entry, self.device, sm, constants)
        if single_threaded:
            # The container's threaded run records an event per run, which a
            # CUDA-graph capture would leave unqueryable; the single-threaded
            # run does not (run.native_unsupported on a runtime without it).
            self._model.single_threaded = True
        self._folded = {fqn for fqn, folded in self._model.constants if folded}
        #: The tensors the container reads: referenced until the next bind.
        self._bound: dict[str, Any] = {}

    def get_constant_fqns(self) -> list[str]:
        """Every constant's fqn, folded ones included, as torch's loader lists them."""
        return [fqn for fqn, _ in self._model.constants]

    def get_call_spec(self) -> list[str]:
        """``[in_spec, out_spec]``: torch's treespec JSON from the container."""
        return list(self._model.call_spec)

    def load_constants(
        self,
        constants: Mapping[str, Any],
        use_inactive: bool = False,
        check_full_update: bool = True,
        user_managed: bool = False,
    ) -> None:
        """Bind ``constants`` (fqn to tensor; a full update: every constant that folding does
        not compute). Without ``user_managed`` each tensor is copied first, as torch's loader
        copies it into the container, so later changes to the caller's tensors stay theirs;
        with it the container reads the caller's memory. A tensor of another dtype, device or
        layout than the graph's is refused by the runner (callers pass checked tensors)."""
        del use_inactive, check_full_update  # always the active buffer, always a full update
        kept: dict[str, Any] = {}
        buffers: list[tuple[str, int, int, str, list[int], str]] = []
        for fqn, value in constants.items():
            if fqn in self._folded:
                continue  # recomputed by the graph from what is bound, as torch's loader does
            tensor = value.detach()
            tensor = tensor.contiguous() if user_managed else tensor.clone(memory_format=_contiguous())
            kept[fqn] = tensor
            dtype = str(tensor.dtype).removeprefix("torch.")
            nbytes = tensor.numel() * tensor.element_size()
            device = "cpu" if tensor.device.type == "cpu" else f"cuda:{tensor.device.index}"
            buffers.append((fqn, tensor.data_ptr(), nbytes, dtype, [int(d) for d in tensor.shape], device))
        if self.device != "cpu":
            import torch

            # The copies above are queued on torch's stream; the container reads them on its own.
            torch.cuda.current_stream(self.device).synchronize()
        self._model.bind_buffers(buffers)
        # The previous tensors are released only now, after the container stopped reading them.
        self._bound = kept

    def boxed_run(self, inputs: Sequence[Any]) -> list[Any]:
        """Run on ``inputs`` (torch tensors) on torch's current stream; torch tensors out."""
        import torch
        from torch.utils.dlpack import from_dlpack

        from ._loadpath import dlpack as _dlpack

        stream = 0
        if self.device != "cpu":
            stream = int(torch.cuda.current_stream(self.device).cuda_stream)
        held = [t.detach().contiguous() for t in inputs]
        taken = [_dlpack(f"[{i}]", t, stream) for i, t in enumerate(held)]
        outputs = self._model.run(taken, stream)
        del taken, held
        return [from_dlpack(out) for out in outputs]


def _contiguous() -> Any:
    import torch

    return torch.contiguous_format
