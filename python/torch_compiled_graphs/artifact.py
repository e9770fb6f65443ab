"""Artifact operations for tools and tests: pack, unpack, read_metadata, inspect, verify.

An artifact is a deterministic ``compiled_graph.tar.gz`` envelope holding
``metadata.json``, ``model.pt2`` (the AOTInductor package, code only) and,
when the graph has literal constants, ``constants.safetensors``. Every check
runs in the native core; refusals raise ``ArtifactError`` with a stable code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import _native

__all__ = [
    "ENVELOPE_FILE_NAME",
    "constant_table",
    "inspect",
    "pack",
    "read_metadata",
    "unpack",
    "verify",
]

ENVELOPE_FILE_NAME: str = _native.ENVELOPE_FILE_NAME

StrPath = str | os.PathLike[str]


def pack(package: StrPath, metadata: Mapping[str, Any], out: StrPath, *, literals: StrPath | None = None) -> Path:
    """Verify ``package`` (and ``literals``) against ``metadata`` and write a new envelope at ``out``."""
    _native.artifact_pack(
        os.fspath(package), dict(metadata), None if literals is None else os.fspath(literals), os.fspath(out)
    )
    return Path(out)


def unpack(path: StrPath, destination: StrPath, *, admit_host: bool = True) -> dict[str, Any]:
    """Verify an envelope fully and publish its members at the new directory ``destination``."""
    return dict(_native.artifact_unpack(os.fspath(path), os.fspath(destination), admit_host))


def read_metadata(path: StrPath) -> dict[str, Any]:
    """The validated ``metadata.json`` of an envelope (reads only its first member)."""
    return dict(_native.artifact_read_metadata(os.fspath(path)))


def inspect(path: StrPath) -> dict[str, Any]:
    """A bounded look at an envelope: sizes and metadata."""
    return dict(_native.artifact_inspect(os.fspath(path)))


def verify(path: StrPath, *, host: bool = False) -> dict[str, Any]:
    """Verify an envelope completely; with ``host``, also admit it on this host."""
    return dict(_native.artifact_verify(os.fspath(path), host))


def constant_table(package: StrPath) -> list[dict[str, Any]]:
    """The wrapper constant table of an AOTInductor package, as metadata constant rows."""
    return list(_native.package_constant_table(os.fspath(package)))
