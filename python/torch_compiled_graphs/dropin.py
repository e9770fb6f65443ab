"""A loaded graph in place of a module: :meth:`LoadedGraph.as_module` (imports torch).

``graph.as_module(like=model)`` returns a :class:`GraphModule`, an
``nn.Module`` that a diffusers pipeline or a transformers model can hold where
``model`` was (``pipe.unet = graph.as_module(like=pipe.unet)``). It is called
the way ``model`` is: positional and keyword arguments are bound to
``model.forward``'s signature and rearranged into the call the program was
exported with; ``return_dict`` picks the library's output class or a tuple; and
it carries what pipelines read from the module (``config``, ``dtype``,
``device``). See docs/run.md, "Drop-in use".

What is not supported is refused with a code, never silently run differently:
an argument the program was not exported with is taken only when it equals the
signature's default (``run.call_invalid``); a non-tensor argument the export
specialised on (other than ``return_dict``) must be stated at ``as_module``
with the value the export used (``constants=``), and calls must pass that
value or leave it at a default equal to it; ``.to()`` another device or dtype
is ``run.device_mismatch``.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .errors import BindingError

if TYPE_CHECKING:
    from .runner import LoadedGraph

__all__ = ["GraphModule"]

_SIMPLE = (type(None), bool, int, float, str)


def _same_value(a: object, b: object) -> bool:
    """Whether a passed value is the default (or stated constant) ``b``: the same object,
    or equal simple values of one type (``True`` is not ``1``)."""
    if a is b:
        return True
    return isinstance(a, _SIMPLE) and type(a) is type(b) and a == b


class GraphModule(torch.nn.Module):
    """A :class:`LoadedGraph` as an ``nn.Module`` with the call convention and the
    attributes of the module it stands in for (see :meth:`LoadedGraph.as_module`)."""

    def __init__(
        self, graph: LoadedGraph, like: torch.nn.Module, *, constants: Mapping[str, object] | None = None
    ) -> None:
        super().__init__()
        if not isinstance(like, torch.nn.Module):
            raise BindingError(
                f"as_module(like=...) takes the nn.Module the graph replaces, got {type(like).__qualname__}",
                "run.call_invalid",
            )
        self.graph = graph
        self.like_class = f"{type(like).__module__}.{type(like).__qualname__}"
        signature = inspect.signature(like.forward)
        self._signature = signature
        params = signature.parameters
        self._var_keyword = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
        self._var_positional = next((p.name for p in params.values() if p.kind is p.VAR_POSITIONAL), None)
        positional = [p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        in_spec = graph._in_spec
        count = in_spec.child(0).num_children
        if count > len(positional):
            raise BindingError(
                f"the graph was exported with {count} positional arguments; {self.like_class}.forward takes "
                f"{len(positional)}",
                "run.call_invalid",
            )
        self._positional = positional[:count]
        self._keywords = list(graph._kwarg_names)
        for name in self._keywords:
            if name not in params and self._var_keyword is None:
                raise BindingError(
                    f"the graph was exported with keyword {name!r}, which {self.like_class}.forward does not take",
                    "run.call_invalid",
                )
        ingress = graph._stored.metadata["graph_class"]["graph"].get("pytree", {}).get("ingress")
        excluded = [str(n) for n in ingress.get("excluded_inputs", [])] if isinstance(ingress, dict) else []
        exported = [str(n) for n in ingress.get("parameters", [])] if isinstance(ingress, dict) else []
        foreign = [n for n in exported if n not in params and not re.fullmatch(r"arg\d+", n)]
        if foreign and self._var_keyword is None:
            raise BindingError(
                f"the graph was exported from a forward with parameters {exported}; {self.like_class}.forward has "
                f"no {foreign}: pass like= the module it was exported from",
                "run.call_invalid",
            )
        given = dict(constants or {})
        unknown = sorted(set(given) - set(excluded))
        if unknown:
            raise BindingError(
                f"constants {unknown} are not non-tensor arguments of the exported call (those are {excluded})",
                "run.call_invalid",
            )
        missing = [n for n in excluded if n != "return_dict" and n not in given]
        if missing:
            raise BindingError(
                f"the program was exported with non-tensor arguments {missing}, whose values the artifact does not "
                "record; pass constants={name: value} with the values the export used",
                "run.call_invalid",
            )
        self._constants = given
        self.config = getattr(like, "config", None)
        self._dtype = self._like_dtype(like)
        self._rebuild = "return_dict" in params
        out_root = json.loads(graph._out_text)[1]
        self._exported_return_dict = out_root.get("type") != "builtins.tuple"

        # Tools that inspect the module's forward (pipelines do) see the original signature.
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._forward(*args, **kwargs)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        forward.__doc__ = f"{self.like_class}.forward, run by the compiled graph {graph._stored.key}"
        object.__setattr__(self, "forward", forward)

    @staticmethod
    def _like_dtype(like: torch.nn.Module) -> torch.dtype:
        dtype = getattr(like, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        for tensor in (*like.parameters(), *like.buffers()):
            if tensor.is_floating_point():
                return tensor.dtype
        return torch.get_default_dtype()

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the module the graph stands in for."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """The device the graph runs on."""
        device: torch.device = self.graph.device
        return device

    def to(self, *args: Any, **kwargs: Any) -> GraphModule:
        """A compiled graph stays where it was loaded: moving it to its own device and
        dtype is a no-op, anything else is ``run.device_mismatch``."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            here = self.device
            if device.type != here.type or (device.index is not None and device.index != here.index):
                raise BindingError(
                    f"the graph runs on {here}; load it there (graph.load(..., device=...)) instead of moving it to "
                    f"{device}",
                    "run.device_mismatch",
                )
        if dtype is not None and dtype != self._dtype:
            raise BindingError(f"the graph was compiled for {self._dtype}, not {dtype}", "run.device_mismatch")
        return self

    def _return_dict(self, value: object) -> bool:
        if value is None:
            config = self.config
            for name in ("use_return_dict", "return_dict"):
                found = getattr(config, name, None)
                if isinstance(found, bool):
                    return found
            return True
        if not isinstance(value, bool):
            raise BindingError(f"return_dict must be a bool or None, got {value!r}", "run.call_invalid")
        return value

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise BindingError(f"{self.like_class}.forward: {exc}", "run.call_invalid") from exc
        passed = dict(bound.arguments)
        if self._var_positional is not None and passed.pop(self._var_positional, ()):
            raise BindingError(
                f"the graph takes no extra positional arguments (*{self._var_positional})", "run.call_invalid"
            )
        if self._var_keyword is not None:
            passed.update(passed.pop(self._var_keyword, {}))
        params = self._signature.parameters
        return_dict = self._return_dict(passed.pop("return_dict", None)) if self._rebuild else None
        exported = {*self._positional, *self._keywords}
        for name, value in passed.items():
            default = params[name].default if name in params else inspect.Parameter.empty
            if name in self._constants:
                if not _same_value(value, self._constants[name]):
                    raise BindingError(
                        f"{name}={_short(value)}: the graph was exported with {name}={self._constants[name]!r}",
                        "run.call_invalid",
                    )
            elif name not in exported and (default is inspect.Parameter.empty or not _same_value(value, default)):
                raise BindingError(
                    f"argument {name!r} is not in the exported call; it is taken only at its default "
                    f"({'none' if default is inspect.Parameter.empty else repr(default)}), got {_short(value)}",
                    "run.call_invalid",
                )
        for name, value in self._constants.items():
            default = params[name].default if name in params else inspect.Parameter.empty
            if name not in passed and not _same_value(default, value):
                raise BindingError(
                    f"the graph was exported with {name}={value!r}; a call that leaves {name} at its default "
                    f"is not that graph: pass {name}={value!r}",
                    "run.call_invalid",
                )
        call_args = [self._take(passed, name) for name in self._positional]
        call_kwargs = {name: self._take(passed, name) for name in self._keywords}
        outputs = self.graph(*call_args, **call_kwargs)
        if return_dict is None:
            return outputs
        return self._shape_output(outputs, return_dict)

    def _take(self, passed: Mapping[str, Any], name: str) -> Any:
        """The value of an exported argument: the caller's, a stated constant, or (for
        ``return_dict``, whose effect is the output's structure) what the export used."""
        if name in passed:
            return passed[name]
        if name in self._constants:
            return self._constants[name]
        if name == "return_dict":
            return self._exported_return_dict
        raise BindingError(f"the graph was exported with {name!r} passed; pass it", "run.call_invalid")

    def _shape_output(self, outputs: Any, return_dict: bool) -> Any:
        to_tuple: Callable[[], tuple[Any, ...]] | None = getattr(outputs, "to_tuple", None)
        if to_tuple is not None:
            return outputs if return_dict else to_tuple()
        if isinstance(outputs, tuple) and not return_dict:
            return outputs
        if isinstance(outputs, tuple):
            raise BindingError(
                f"the graph was exported returning a tuple (return_dict=False); {self.like_class}'s output class "
                "cannot be rebuilt from it: call with return_dict=False, or export with return_dict=True",
                "run.call_invalid",
            )
        if not return_dict:
            raise BindingError(
                f"return_dict=False asks for {self.like_class}'s tuple; the graph returns a "
                f"{type(outputs).__qualname__}, which it cannot be made from: call with return_dict=True",
                "run.call_invalid",
            )
        return outputs

    def extra_repr(self) -> str:
        return f"like={self.like_class}, key={self.graph._stored.key!r}, device={self.device}"


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
