"""One model's weights held once on a device, bound by several graphs
(docs/run.md, "Weights once").

The graphs of one model (per-resolution graph classes, a prefill and a decode
graph) each read the same weights. Each ``stored.load(weights_set)`` binds the
set's tensors in place, checked against that graph's own weights contract:
names one graph's compiler dropped and another's kept are both served from the
one set. Graphs keep the tensors they bind alive, so graphs and set are released
in any order.

A set made from a module or a state_dict **borrows** the caller's tensors (no
copy); one made from checkpoint files **owns** one allocation, read by the
weights pipeline. A LoRA is fused into the set in place (so into every graph
bound to it, without recompiling, and captured CUDA graphs stay valid), with the
base values of the targeted tensors kept for a bit-for-bit ``remove_lora``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .binding import SharedLock
from .errors import BindingError

__all__ = ["WeightsSet"]


class WeightsSet:
    """A model's weights, once, for every graph that binds them.

    ``weights`` is what :meth:`StoredCompiledGraph.load` takes: an ``nn.Module``
    or a state_dict (borrowed: the set holds the caller's tensors), or a
    checkpoint on disk (a ``.safetensors`` file, a ``save_pretrained`` directory or
    index, a list of those), read once onto ``device`` (default: the CPU).
    ``strip_prefix`` / ``add_prefix`` rename as in ``load``.
    """

    def __init__(self, weights: object, *, device: object = None, strip_prefix: str = "", add_prefix: str = "") -> None:
        import torch

        from ._loadpath import naming as _naming
        from ._loadpath import renamed as _renamed
        from ._torch_weights import named_tensors as _weights
        from ._torch_weights import read_checkpoint as _read_checkpoint

        naming = _naming(strip_prefix, add_prefix)
        self._naming = naming
        self._lock = SharedLock()
        self._module: Any = None
        #: Tensors skipped for lying outside ``strip_prefix``.
        self.outside_prefix = 0
        self.timings: dict[str, float] = {}
        if isinstance(weights, (str, os.PathLike, list, tuple)):
            target = torch.device(device if device is not None else "cpu")  # type: ignore[call-overload]
            if target.type == "cuda" and target.index is None:
                target = torch.device("cuda", torch.cuda.current_device())
            named, self.outside_prefix, self.timings, _ = _read_checkpoint(
                weights, naming, target, lambda names: {"bind": [(n, n) for n in names], "duplicates": []}, None
            )
            self.borrowed = False
            self.device = target
        else:
            if isinstance(weights, torch.nn.Module):
                self._module = weights
            named, self.outside_prefix = _renamed(_weights(weights), *naming)
            devices = {t.device for t in named.values()}
            if len(devices) > 1:
                raise BindingError(
                    f"the weights lie on several devices ({sorted(map(str, devices))}): move them to one first",
                    "run.device_mismatch",
                )
            self.device = devices.pop() if devices else torch.device("cpu")
            if device is not None and torch.device(device) != self.device:  # type: ignore[call-overload]
                raise BindingError(
                    f"the weights are on {self.device}, not {device}: a set borrows the caller's tensors "
                    "(move the module with .to() first, or open a checkpoint file onto the device)",
                    "run.device_mismatch",
                )
            self.borrowed = True
        self._tensors: dict[str, Any] = named
        #: Per targeted name, the base values a fused LoRA replaced (bit for bit).
        self._base: dict[str, Any] = {}
        self._lora: dict[str, Any] | None = None
        self._stream: Any = None

    # -- what graphs bind ---------------------------------------------------------

    @property
    def tensors(self) -> Mapping[str, Any]:
        """The set's tensors by name (a read-only view; change values only through
        the LoRA methods or in place)."""
        return MappingProxyType(self._tensors)

    @property
    def module(self) -> Any:
        """The module the set borrows from (``None`` otherwise): its graphs watch it
        for reassigned tensors (``run.weights_stale``)."""
        return self._module

    @property
    def lock(self) -> SharedLock:
        """Calls on the set's graphs hold it shared; a LoRA update exclusive."""
        return self._lock

    @property
    def nbytes(self) -> int:
        """Bytes the set holds: its tensors (each storage once; borrowed ones are the
        caller's memory) plus the base copies kept for a fused LoRA."""
        storages: dict[int, int] = {}
        for tensor in [*self._tensors.values(), *self._base.values()]:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = int(storage.nbytes())
        return sum(storages.values())

    def source_name(self, name: str) -> str:
        """The caller's name of the set's tensor ``name`` (before the set's prefixes)."""
        strip_prefix, add_prefix = self._naming
        return strip_prefix + name[len(add_prefix) :]

    def tensors_for_binding(self, device: Any) -> dict[str, Any]:
        if device != self.device:
            raise BindingError(
                f"the weights set is on {self.device}, the graph runs on {device}", "run.device_mismatch"
            )
        return dict(self._tensors)

    # -- LoRA -------------------------------------------------------------------------

    @property
    def lora(self) -> dict[str, Any] | None:
        """The fused LoRA: ``name``, ``scale``, ``targets`` (names changed) and
        ``nbytes`` (its tensors); ``None`` when none is fused."""
        return None if self._lora is None else dict(self._lora)

    def apply_lora(self, lora: object, scale: float = 1.0, prefix: str | None = None, name: str | None = None) -> None:
        """Fuse a LoRA (a diffusers/PEFT safetensors file, a directory holding one, or
        its state_dict) into the set's weights in place: ``W + scale_m · B @ A`` per
        adapted module, computed in float32 on the device and cast to W's dtype, where
        ``scale_m`` is alpha / rank x ``scale``. ``prefix`` selects one component of a
        pipeline's LoRA (``"unet."``). Refused (``run.lora_invalid``, nothing changed)
        when one is already fused (use :meth:`replace_lora`) or when it does not fit."""
        if self._lora is not None:
            raise BindingError(
                f"a LoRA ({self._lora['name']!r}) is already fused: replace_lora() or remove_lora() first",
                "run.lora_invalid",
            )
        self._fuse(lora, scale, prefix, name)

    def replace_lora(
        self, lora: object, scale: float = 1.0, prefix: str | None = None, name: str | None = None
    ) -> None:
        """Swap the fused LoRA for another in one step: every call sees the old one or
        the new one, never the base or a mix. Refused LoRAs change nothing."""
        self._fuse(lora, scale, prefix, name)

    def remove_lora(self) -> None:
        """Restore the base weights bit for bit (from the kept copies) and drop them."""
        if self._lora is None:
            return
        with self._exclusive():
            for target, base in self._base.items():
                self._tensors[target].copy_(base)
            self._base.clear()
            self._lora = None

    def _fuse(self, lora: object, scale: float, prefix: str | None, name: str | None) -> None:
        import torch

        from .lora import delta, read_lora

        if name is not None and not isinstance(name, str):
            raise BindingError("name must be a string", "run.lora_invalid")
        # Every check first: a LoRA that does not fit is refused before anything is written.
        targets = read_lora(lora, self._tensors, scale=scale, prefix=prefix)
        wanted = {t.weight for t in targets}
        if len(wanted) != len(targets):
            raise BindingError("the LoRA adapts one weight twice", "run.lora_invalid")
        with self._exclusive():
            try:
                for target in targets:
                    weight = self._tensors[target.weight]
                    if target.weight not in self._base:
                        self._base[target.weight] = weight.detach().clone()
                    # Always from the kept base, never from the fused value: a swap
                    # does not accumulate rounding.
                    base = self._base[target.weight]
                    weight.copy_((base.to(torch.float32) + delta(target, weight)).to(weight.dtype))
                # Weights the old LoRA changed and the new one does not: back to base.
                for unused in [n for n in self._base if n not in wanted]:
                    self._tensors[unused].copy_(self._base.pop(unused))
            except Exception:
                # Failing midway (out of memory for a base copy or a delta): nothing
                # half-applied survives, every weight goes back to its base.
                for target_name, base in self._base.items():
                    self._tensors[target_name].copy_(base)
                self._base.clear()
                self._lora = None
                raise
            nbytes = sum(int(t.down.numel() * t.down.element_size()) for t in targets)
            nbytes += sum(int(t.up.numel() * t.up.element_size()) for t in targets)
            self._lora = {"name": name, "scale": float(scale), "targets": sorted(wanted), "nbytes": nbytes}

    def _exclusive(self) -> Any:
        """The set's lock held exclusive, gradients off, and on a GPU: every call in
        flight on the device finished first, the update written on the set's own
        stream, and finished before the lock is released (so no call queued after it
        reads half-updated weights)."""
        import contextlib

        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(self._lock.exclusive())
        stack.enter_context(torch.no_grad())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            stack.enter_context(torch.cuda.stream(self._stream))
            stack.callback(self._stream.synchronize)
        return stack

    def __repr__(self) -> str:
        kind = "borrowed" if self.borrowed else "owned"
        return f"WeightsSet({len(self._tensors)} tensors, {kind}, device={str(self.device)!r})"
