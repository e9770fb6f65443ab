"""Runtime compatibility: the ``sm`` and ``toolchain`` axes of a key, and the host-code clamp.

``RuntimeCompatibility`` (SPEC-v1 §4) turns a caller's target and toolchain
block into the two non-graph key axes. For minting it also imposes the
host-ISA requirement on inductor (the clamp, §5.4), process-wide.

The ``sm`` value of a CPU target, the host requirement and the toolchain fold
come from the native core. torch is imported lazily: only a CUDA target and
the clamp need it.

Two ways to state the clamp, chosen by what inductor offers:

- ``cpp.march`` + ``cpp.simdlen`` where inductor has a ``cpp.march`` entry
  (torch 2.15, the pinned version);
- ``cpp.cxx`` + ``cpp.simdlen`` where it has none (torch 2.11, for example,
  passes ``-march=native`` to the C++ compiler unconditionally on x86-64): the
  compiler becomes a small wrapper script (:func:`clamp_compiler`) that
  replaces every ``-march=native`` with the recorded level and runs the real
  compiler with everything else unchanged.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import CompiledGraphError, DeclarationError
from .identity import CompiledGraphKey

if TYPE_CHECKING:
    from .identity import GraphClassDeclaration

__all__ = ["RuntimeCompatibility", "clamp_compiler", "clamp_options", "impose_clamp"]

_CUDA_TARGET = re.compile(r"sm_([0-9]+)a?")
_TARGET_MESSAGE = "runtime target must be 'cpu' or a concrete 'sm_NN'"

#: Serialises every change to inductor's process-wide clamp entries.
_CLAMP_LOCK = threading.Lock()
#: The inductor config entries the clamp owns, where inductor has ``cpp.march``.
_CLAMP_ENTRIES = ("cpp.march", "cpp.simdlen")
#: The entries it owns where inductor has no ``cpp.march`` (the compiler-wrapper clamp).
_LEGACY_ENTRIES = ("cpp.cxx", "cpp.simdlen")
#: The compiler inductor would run before the wrapper clamp replaced it, per process.
_REAL_CXX: list[str] = []


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
    if "cpp.march" in config._config:
        return config.cpp.march, config.cpp.simdlen
    return config.cpp.cxx, config.cpp.simdlen


_WRAPPER = """#!/bin/sh
# torch-compiled-graphs host-code clamp: run {real} with -march=native replaced by -march={march}.
for arg do
  shift
  case "$arg" in
    -march=native) set -- "$@" "-march={march}" ;;
    *) set -- "$@" "$arg" ;;
  esac
done
exec '{real}' "$@"
"""


def _clamp_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    # Beside the default store root ($XDG_CACHE_HOME/torch-compiled-graphs), never
    # inside it: Engine() refuses a root holding anything but a store.
    return os.path.join(base, "torch-compiled-graphs-cxx-clamp")


def _private_dir(path: str) -> None:
    """Create ``path`` (0700) or accept it only if this user owns it and nobody else can write it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} is not a private directory of this user")


def clamp_compiler(real: str, march: str) -> str:
    """A compiler wrapper that runs ``real`` with ``-march=native`` replaced by ``-march=march``.

    The script lives under ``$XDG_CACHE_HOME/torch-compiled-graphs-cxx-clamp/<digest>/``
    (beside the default store root, not inside it)
    and keeps the real compiler's file name (inductor picks compiler-specific
    flags by name). Its content is checked on every call and rewritten
    atomically when it differs; the directories must be private to this user.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march) or "'" in real or "\n" in real:
        raise OSError(f"cannot wrap compiler {real!r} for -march={march!r}")
    text = _WRAPPER.format(real=real, march=march).encode()
    root = _clamp_root()
    os.makedirs(os.path.dirname(root), exist_ok=True)
    _private_dir(root)
    where = os.path.join(root, hashlib.sha256(text).hexdigest()[:16])
    _private_dir(where)
    path = os.path.join(where, os.path.basename(real))
    try:
        with open(path, "rb") as fh:
            if fh.read() == text and os.access(path, os.X_OK):
                return path
    except FileNotFoundError:
        pass
    temp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path


def _real_compiler(config: Any) -> str:
    """The compiler inductor runs without the wrapper: the first of ``cpp.cxx`` that is on PATH."""
    if not _REAL_CXX:
        search = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        for candidate in search:
            found = shutil.which(candidate) if isinstance(candidate, str) else None
            if found is not None:
                _REAL_CXX.append(found)
                break
        else:
            raise OSError(f"none of inductor's C++ compilers {search!r} is on PATH")
    return _REAL_CXX[0]


def clamp_options(config: Any, requirement: Mapping[str, str]) -> dict[str, object]:
    """The inductor options that state ``requirement`` on this torch (see the module docstring)."""
    march, simdlen = _clamp_values(requirement)
    if "cpp.march" in config._config:
        return {"cpp.march": march, "cpp.simdlen": simdlen}
    if march is None:
        return {"cpp.cxx": config.cpp.cxx, "cpp.simdlen": simdlen}
    return {"cpp.cxx": (None, clamp_compiler(_real_compiler(config), march)), "cpp.simdlen": simdlen}


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
    with _CLAMP_LOCK:
        try:
            import torch._inductor.config as config
        except Exception as exc:
            raise error(f"cannot import inductor's config: {exc}", code) from exc
        entries = getattr(config, "_config", None)
        owned = _CLAMP_ENTRIES if isinstance(entries, dict) and "cpp.march" in entries else _LEGACY_ENTRIES
        if not isinstance(entries, dict) or any(
            name not in entries or not hasattr(entries[name], "default") for name in owned
        ):
            raise error(
                f"inductor config has no process-wide entries for {' and '.join(owned)}; cannot clamp host code",
                code,
            )
        try:
            options = clamp_options(config, requirement)
        except OSError as exc:
            raise error(f"cannot clamp host code through the C++ compiler: {exc}", code) from exc
        want = tuple(options[name] for name in owned)
        unset = _unset_sentinel()
        for name, value in zip(owned, want, strict=True):
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
        for name, value in options.items():
            setattr(config.cpp, name.removeprefix("cpp."), value)
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
            f"clamp is thread-local: a fresh thread reads {'/'.join(owned)} {there!r}, want {want!r}",
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
