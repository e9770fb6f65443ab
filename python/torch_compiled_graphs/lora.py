"""LoRA checkpoints read for fusing into a weights set (docs/run.md, "Weights once").

The format is diffusers'/PEFT's: per adapted module ``<path>.lora_A.weight``
(rank x in, or a conv kernel rank x in x kh x kw), ``<path>.lora_B.weight``
(out x rank, or out x rank x 1 x 1) and optionally ``<path>.alpha``; names as
``save_lora_weights`` writes them (a pipeline component's prefix ``unet.``,
``transformer.``, ``text_encoder.``) or as PEFT saves them (``base_model.model.``).
The scale of a module is alpha / rank x the user's scale (no alpha anywhere:
1 x the user's scale, as diffusers does), where alpha comes from the module's
``.alpha`` tensor, else from the adapter's config (the ``lora_adapter_metadata``
that diffusers writes into the safetensors header, or PEFT's
``adapter_config.json`` beside the file: ``lora_alpha``, ``alpha_pattern``,
``use_rslora``).

Everything is checked here, before any weight is touched: a LoRA that does not
fit is refused (``run.lora_invalid``) and changes nothing.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BindingError

#: Pipeline components whose prefix ``save_lora_weights`` writes before the names.
COMPONENT_PREFIXES = ("unet.", "transformer.", "text_encoder.", "text_encoder_2.", "text_encoder_3.", "prior.")
PEFT_PREFIX = "base_model.model."
#: File names a LoRA directory holds (diffusers', then PEFT's).
LORA_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")

INVALID = "run.lora_invalid"


@dataclass(frozen=True)
class LoraTarget:
    """One weight of the set a LoRA changes: ``W + scale · B @ A``."""

    weight: str
    down: Any  # lora_A
    up: Any  # lora_B
    scale: float


def _read(source: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """The LoRA's tensors and its adapter config (possibly empty)."""
    import torch

    if isinstance(source, Mapping):
        tensors: dict[str, Any] = {}
        for name, value in source.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise BindingError(
                    f"a LoRA state_dict maps names to tensors; {name!r} maps to {type(value).__qualname__}", INVALID
                )
            tensors[name] = value
        return tensors, {}
    if not isinstance(source, (str, os.PathLike)):
        raise BindingError(
            f"a LoRA is a safetensors file, a directory holding one or a state_dict, got {type(source).__qualname__}",
            INVALID,
        )
    path = Path(source)
    if path.is_dir():
        found = [path / name for name in LORA_FILES if (path / name).is_file()]
        if not found:
            raise BindingError(f"{path} holds none of {list(LORA_FILES)}", INVALID)
        path = found[0]
    config: dict[str, Any] = {}
    try:
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            header = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise BindingError(f"cannot read the LoRA {path}: {exc}", INVALID) from exc
    raw = header.get("lora_adapter_metadata")
    if raw:
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise BindingError(f"the LoRA {path} has malformed lora_adapter_metadata: {exc}", INVALID) from exc
    beside = path.parent / "adapter_config.json"
    if not config and beside.is_file():
        try:
            config = json.loads(beside.read_text())
        except ValueError as exc:
            raise BindingError(f"cannot read {beside}: {exc}", INVALID) from exc
    if not isinstance(config, dict):
        raise BindingError(f"the LoRA {path} has an adapter config that is not an object", INVALID)
    return tensors, config


def _component_config(config: Mapping[str, Any], component: str) -> dict[str, Any]:
    """diffusers packs each component's config under ``<component>.<key>``."""
    packed = {k[len(component) :]: v for k, v in config.items() if component and k.startswith(component)}
    return packed or {k: v for k, v in config.items() if not any(k.startswith(p) for p in COMPONENT_PREFIXES)}


def _alpha(config: Mapping[str, Any], module: str) -> float | None:
    pattern = config.get("alpha_pattern") or {}
    if isinstance(pattern, dict):
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return float(value)
    alpha = config.get("lora_alpha")
    return float(alpha) if isinstance(alpha, (int, float)) else None


def read_lora(
    source: object, names: Mapping[str, Any], *, scale: float = 1.0, prefix: str | None = None
) -> list[LoraTarget]:
    """The targets of a LoRA checked against a weights set's tensors ``names``:
    every module it adapts exists (``<path>.weight``), ranks agree, and the delta
    has the weight's shape. Refused, with every reason found, otherwise."""
    import torch

    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise BindingError(f"the LoRA scale must be a finite number, got {scale!r}", INVALID)
    tensors, config = _read(source)
    if not tensors:
        raise BindingError("the LoRA holds no tensors", INVALID)
    component = ""
    if prefix is not None:
        if not isinstance(prefix, str):
            raise BindingError("prefix must be a string", INVALID)
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not tensors:
            raise BindingError(f"the LoRA holds no names under {prefix!r}", INVALID)
        component = prefix
    else:
        present = sorted({p for p in COMPONENT_PREFIXES for k in tensors if k.startswith(p)})
        if len(present) > 1:
            raise BindingError(
                f"the LoRA adapts several components ({', '.join(present)}): pass prefix= for this weights set", INVALID
            )
        if present and all(k.startswith(present[0]) for k in tensors):
            component = present[0]
            tensors = {k[len(component) :]: v for k, v in tensors.items()}
    tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}
    config = _component_config(config, component)
    rslora = bool(config.get("use_rslora", False))

    modules: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    for name, value in tensors.items():
        for part in (".lora_A.weight", ".lora_B.weight", ".alpha"):
            if name.endswith(part):
                modules.setdefault(name[: -len(part)], {})[part] = value
                break
        else:
            unknown.append(name)
    problems: list[str] = []
    if unknown:
        problems.append(f"names that are not LoRA weights: {sorted(unknown)[:5]}")
    targets: list[LoraTarget] = []
    for module, parts in sorted(modules.items()):
        down, up = parts.get(".lora_A.weight"), parts.get(".lora_B.weight")
        if down is None or up is None:
            problems.append(f"{module}: lora_A and lora_B must both be present")
            continue
        weight_name = f"{module}.weight"
        weight = names.get(weight_name)
        if weight is None:
            problems.append(f"{module}: the weights set has no {weight_name!r}")
            continue
        if not (down.is_floating_point() and up.is_floating_point() and weight.is_floating_point()):
            problems.append(f"{module}: LoRA and weight must be floating point")
            continue
        if down.dim() < 2 or up.dim() < 2 or any(d != 1 for d in up.shape[2:]):
            problems.append(
                f"{module}: lora_A {list(down.shape)} / lora_B {list(up.shape)} are not a LoRA pair "
                "(lora_B must be out x rank, or a 1 x 1 conv kernel)"
            )
            continue
        rank = int(down.shape[0])
        if int(up.shape[1]) != rank:
            problems.append(f"{module}: lora_A has rank {rank}, lora_B has {int(up.shape[1])}")
            continue
        delta_shape = (int(up.shape[0]), *[int(d) for d in down.shape[1:]])
        if list(delta_shape) != [int(d) for d in weight.shape]:
            problems.append(
                f"{module}: the LoRA changes a {list(delta_shape)} weight, {weight_name} is {list(weight.shape)}"
            )
            continue
        alpha_tensor = parts.get(".alpha")
        alpha = float(alpha_tensor.reshape(-1)[0]) if isinstance(alpha_tensor, torch.Tensor) else _alpha(config, module)
        if alpha is None:
            factor = 1.0
        else:
            factor = alpha / (math.sqrt(rank) if rslora else rank)
        targets.append(LoraTarget(weight_name, down, up, factor * float(scale)))
    if problems:
        raise BindingError("the LoRA does not fit this weights set: " + "; ".join(problems), INVALID)
    return targets


def delta(target: LoraTarget, weight: Any) -> Any:
    """``scale · B @ A`` in float32 on the weight's device, in the weight's shape (a conv
    LoRA's ``B @ A`` over the flattened kernel, reshaped to it)."""
    import torch

    down = target.down.to(device=weight.device, dtype=torch.float32).flatten(1)
    up = target.up.to(device=weight.device, dtype=torch.float32).flatten(1)
    return (up @ down).reshape(weight.shape) * target.scale
