"""Runtime compatibility: the ``sm`` and ``toolchain`` axes of a key, and the host-code clamp.

``RuntimeCompatibility`` (SPEC-v1 §4) turns a caller's target and toolchain
block into the two non-graph key axes. For minting it also imposes the
host-ISA requirement on inductor (the clamp, §5.4), process-wide.

The ``sm`` value of a CPU target, the host requirement and the toolchain fold
come from the native core. torch is imported lazily: only a CUDA target and
the clamp need it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import CompiledGraphError, DeclarationError
from .identity import CompiledGraphKey

if TYPE_CHECKING:
    from .identity import GraphClassDeclaration

__all__ = ["RuntimeCompatibility", "impose_clamp"]

_CUDA_TARGET = re.compile(r"sm_([0-9]+)a?")
_TARGET_MESSAGE = "runtime target must be 'cpu' or a concrete 'sm_NN'"

#: Serialises every change to inductor's process-wide clamp entries.
_CLAMP_LOCK = threading.Lock()
#: The inductor config entries the clamp owns.
_CLAMP_ENTRIES = ("cpp.march", "cpp.simdlen")


def _normalise_target(target: object) -> str:
    if not isinstance(target, str):
        raise DeclarationError(_TARGET_MESSAGE, "declaration.target_unsupported")
    return target.strip().lower()


def _cuda_sm(target: str) -> str:
    """Check ``sm_NN[a]`` against the visible device; the axis is the target verbatim (§4.3)."""
    match = _CUDA_TARGET.fullmatch(target)
    if match is None:
        raise DeclarationError(_TARGET_MESSAGE, "declaration.target_unsupported")
    import torch

    if not torch.cuda.is_available():
        raise DeclarationError(
            f"runtime target {target!r} needs CUDA, but no CUDA device is available",
            "declaration.cuda_unavailable",
        )
    major, minor = torch.cuda.get_device_capability()
    found = f"{major}{minor}"
    if match.group(1) != found:
        raise DeclarationError(
            f"runtime target {target!r} does not match the current device (capability {major}.{minor}, sm_{found})",
            "declaration.device_mismatch",
        )
    return target


def _clamp_values(requirement: Mapping[str, str]) -> tuple[str | None, int | None]:
    """The ``(cpp.march, cpp.simdlen)`` values that state ``requirement`` to inductor."""
    march = requirement["cpp_march"]
    simdlen = requirement["cpp_simdlen"]
    if march == "native" and simdlen == "native":
        return None, None  # torch's own native choice on a non-x86 host (§5.4 step 2)
    return march, int(simdlen)


def _read_clamp(config: Any) -> tuple[object, object]:
    return config.cpp.march, config.cpp.simdlen


def impose_clamp(error: type[CompiledGraphError], code: str) -> dict[str, str]:
    """Impose the host requirement on inductor, process-wide, and prove it holds (SPEC-v1 §5.4).

    Computes the requirement through the native core, sets ``cpp.march`` and
    ``cpp.simdlen`` both as inductor's process-wide defaults and as the current
    values, then reads both back on this thread and on a fresh thread. Any
    failure raises ``error(message, code)``; nothing falls back to a default.
    Returns the requirement (the five ``host_isa`` facts recorded at mint).
    """
    try:
        requirement = dict(_native.host_requirement())
    except CompiledGraphError as exc:
        raise error(f"cannot state the host ISA requirement: {exc}", code) from exc
    march, simdlen = _clamp_values(requirement)
    want = (march, simdlen)
    with _CLAMP_LOCK:
        try:
            import torch._inductor.config as config
        except Exception as exc:
            raise error(f"cannot import inductor's config: {exc}", code) from exc
        entries = getattr(config, "_config", None)
        if not isinstance(entries, dict) or any(
            name not in entries or not hasattr(entries[name], "default") for name in _CLAMP_ENTRIES
        ):
            raise error(
                "inductor config has no process-wide entries for cpp.march and cpp.simdlen; cannot clamp host code",
                code,
            )
        unset = _unset_sentinel()
        for name, value in zip(_CLAMP_ENTRIES, want, strict=True):
            entry = entries[name]
            forced = getattr(entry, "env_value_force", unset)
            if forced is not unset and forced != value:
                raise error(
                    f"inductor config {name} is forced to {forced!r} by the environment; the clamp needs {value!r}",
                    code,
                )
            entry.default = value
            if getattr(entry, "env_value_default", unset) is not unset:
                entry.env_value_default = value
        config.cpp.march = march
        config.cpp.simdlen = simdlen
        # Derived caches of the config (its hash, its dict) must see the new defaults.
        dirty = getattr(config, "_get_dict_dirty_keys_var", None)
        if dirty is not None:
            dirty.set(None)
        hash_dirty = getattr(config, "_hash_dirty_var", None)
        if hash_dirty is not None:
            hash_dirty.set(True)

        here = _read_clamp(config)
        there: list[object] = []

        def probe() -> None:
            try:
                there.append(_read_clamp(config))
            except Exception as exc:  # reported below as a mismatch
                there.append(exc)

        thread = threading.Thread(target=probe, name="tcg-clamp-probe")
        thread.start()
        thread.join()
    if here != want:
        raise error(f"clamp did not take: cpp.march/simdlen read {here!r}, want {want!r}", code)
    if there != [want]:
        raise error(
            f"clamp is thread-local: a fresh thread reads cpp.march/simdlen {there!r}, want {want!r}",
            code,
        )
    return requirement


def _unset_sentinel() -> object:
    try:
        from torch.utils import _config_module
    except Exception:  # pragma: no cover - the entries check above already needs it
        return object()
    return getattr(_config_module, "_UNSET_SENTINEL", object())


class RuntimeCompatibility:
    """The runtime half of a key: target (``sm``) and toolchain, and the minting host's clamp.

    ``target`` is lower-cased and trimmed: ``"cpu"`` maps to the native core's
    CPU ``sm`` (``cpu-x86-64-v3`` and so on); ``sm_NN`` / ``sm_NNa`` must match
    the visible CUDA device. ``toolchain`` is a block of build facts (see
    :func:`torch_compiled_graphs.toolchain.record_toolchain`); keys and values
    pass through ``str()``. Construction validates both and imposes the clamp
    (``declaration.host_policy`` on failure).
    """

    __slots__ = ("_host_isa", "_sm", "_target", "_toolchain", "_toolchain_axis")

    def __init__(self, target: str, *, toolchain: Mapping[str, object]) -> None:
        normalised = _normalise_target(target)
        if normalised == "cpu":
            sm = _native.cpu_sm()
        else:
            sm = _cuda_sm(normalised)
        if not isinstance(toolchain, Mapping):
            raise DeclarationError(
                f"toolchain block must be a mapping, got {type(toolchain).__qualname__}",
                "declaration.toolchain_invalid",
            )
        block = {str(k): str(v) for k, v in toolchain.items()}
        axis = _native.toolchain_axis(block)  # raises declaration.toolchain_invalid
        host_isa = impose_clamp(DeclarationError, "declaration.host_policy")
        self._target = normalised
        self._sm = sm
        self._toolchain = block
        self._toolchain_axis = axis
        self._host_isa = host_isa

    @property
    def target(self) -> str:
        """The normalised target: ``cpu`` or ``sm_NN[a]``."""
        return self._target

    @property
    def sm(self) -> str:
        """The ``sm`` axis value."""
        return self._sm

    @property
    def toolchain(self) -> dict[str, str]:
        """A copy of the validated toolchain block (recorded verbatim in metadata)."""
        return dict(self._toolchain)

    @property
    def toolchain_axis(self) -> str:
        """The toolchain axis (16 hex) folded by the native core."""
        return self._toolchain_axis

    @property
    def host_isa(self) -> dict[str, str]:
        """The five host-ISA facts a mint on this host records (SPEC-v1 §5.3)."""
        return dict(self._host_isa)

    def key(self, declaration: GraphClassDeclaration) -> CompiledGraphKey:
        """The key of ``declaration`` compiled under this runtime."""
        return CompiledGraphKey(declaration.class_hash, self._sm, self._toolchain_axis)

    def __repr__(self) -> str:
        return f"RuntimeCompatibility(target={self._target!r}, sm={self._sm!r})"
