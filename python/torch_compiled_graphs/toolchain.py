"""``record_toolchain()``: the installed compile stack as a toolchain block (SPEC-v1 §3.4).

The block holds build facts only, never host probes: digests of the installed
distributions' ``RECORD`` files (``torch``, ``triton`` and every ``nvidia-*``
distribution), of the C++ compiler inductor invokes, and of the compile
policy's settings. The toolchain *axis* is folded from the block by the native
core; the member digests here are opaque to the engine (§3.4), so they are
plain SHA-256 of file or command bytes. Every key is listed in
``docs/compile-policy.md``.

Importing torch is not needed and not done: the block can be recorded on the
hit path without pulling torch into the process.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import TYPE_CHECKING

from . import _native
from .errors import DeclarationError

if TYPE_CHECKING:
    from collections.abc import Mapping
    from importlib import metadata

__all__ = ["ABSENT", "record_toolchain", "settings_digest", "variant_of_block", "variant_toolchain"]

#: The value of an optional distribution (``triton``) that is not installed.
ABSENT = "absent"

_NAME = re.compile(r"[-_.]+")


def _hex16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _normalise(name: str) -> str:
    """PEP 503 normalised distribution name: ``nvidia_cublas`` -> ``nvidia-cublas``."""
    return _NAME.sub("-", name).lower()


def record_digest(record: str) -> str:
    """The toolchain member digest of a distribution's ``RECORD`` text.

    The one formula, shared with the native load path's torch check; this
    module imports ``importlib.metadata`` and ``subprocess`` only when a block
    is recorded, so that check stays cheap.
    """
    return _hex16(record.encode("utf-8"))


def _record_digest(distribution: metadata.Distribution) -> str:
    name = _normalise(distribution.metadata["Name"] or "")
    record = distribution.read_text("RECORD")
    if record is None:
        raise DeclarationError(
            f"installed distribution {name!r} has no RECORD file; cannot state the toolchain",
            "declaration.toolchain_invalid",
        )
    return record_digest(record)


def _distributions() -> dict[str, metadata.Distribution]:
    from importlib import metadata

    found: dict[str, metadata.Distribution] = {}
    for distribution in metadata.distributions():
        raw = distribution.metadata["Name"]
        if not raw:
            continue
        # The first one on sys.path wins, as it does for import.
        found.setdefault(_normalise(raw), distribution)
    return found


def _cxx_command() -> str:
    """The C++ compiler inductor invokes on Linux: ``$CXX``, else ``g++`` (torch 2.15 default)."""
    return os.environ.get("CXX") or "g++"


def _cxx_digest() -> str:
    import shutil
    import subprocess

    command = _cxx_command()
    resolved = shutil.which(command)
    if resolved is None:
        raise DeclarationError(
            f"the C++ compiler inductor invokes ({command!r}) is not on PATH",
            "declaration.toolchain_invalid",
        )
    real = os.path.realpath(resolved)
    try:
        version = subprocess.run([real, "--version"], check=True, capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise DeclarationError(
            f"cannot read the version of the C++ compiler {real}: {exc}",
            "declaration.toolchain_invalid",
        ) from exc
    return _hex16(real.encode("utf-8") + b"\0" + version)


def settings_digest(variant: str = "default") -> str:
    """The ``settings_declaration`` member of ``variant``'s compile policy (16 hex).

    ``declaration.variant_unknown`` for a name that is not a variant.
    """
    from .compile import policy_of

    return _hex16(_native.canonical_json(policy_of(variant).settings_declaration()))


def variant_of_block(block: Mapping[str, object]) -> str | None:
    """The variant whose policy a toolchain block's ``settings_declaration`` names, or ``None``
    when it names none of this version's policies (a caller's own block)."""
    from .variant import VARIANTS

    stated = block.get("settings_declaration")
    for variant in VARIANTS:
        if stated == settings_digest(variant):
            return variant
    return None


def variant_toolchain(block: Mapping[str, object], variant: str) -> dict[str, str]:
    """``block`` with its ``settings_declaration`` set to ``variant``'s: the toolchain under
    which ``variant``'s key is derived (a fleet's lock is recorded once, for the default)."""
    out = {str(k): str(v) for k, v in block.items()}
    out["settings_declaration"] = settings_digest(variant)
    _native.toolchain_axis(out)
    return out


def record_toolchain(variant: str = "default") -> dict[str, str]:
    """The toolchain block of this installation's compile stack.

    Keys: ``torch`` (required), ``triton`` (``"absent"`` when not installed),
    one ``nvidia-*`` key per installed NVIDIA distribution (PEP 503 name),
    ``cxx`` and ``settings_declaration``. Values are 16-hex digests. The block
    is checked by the native fold before it is returned. ``variant`` picks the
    compile policy ``settings_declaration`` states: ``"default"``, or
    ``"shim-v1"`` for the libtorch-free variant (docs/keys.md, "Variants").
    """
    digest = settings_digest(variant)
    installed = _distributions()
    if "torch" not in installed:
        raise DeclarationError("torch is not installed; cannot state the toolchain", "declaration.toolchain_invalid")
    block = {"torch": _record_digest(installed["torch"])}
    block["triton"] = _record_digest(installed["triton"]) if "triton" in installed else ABSENT
    for name in sorted(installed):
        if name.startswith("nvidia-"):
            block[name] = _record_digest(installed[name])
    block["cxx"] = _cxx_digest()
    block["settings_declaration"] = digest
    _native.toolchain_axis(block)  # the single validator of a block
    return block
