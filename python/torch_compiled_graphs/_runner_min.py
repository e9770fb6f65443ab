"""A minimal loader for code-only packages: load one entry, bind constants by fqn, run.

Enough to prove the weight-swap obligation (SPEC-v1 §13.3); the full runner
(resolved-graph loading, literal payloads, device placement) lives elsewhere.
torch is imported lazily.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["MinimalGraph"]


class MinimalGraph:
    """One AOTInductor package entry loaded on CPU, with constants bound by fqn."""

    def __init__(self, package: str | os.PathLike[str], entry: str) -> None:
        import torch
        from torch.export.pt2_archive._package import AOTICompiledModel

        # The package loader directly: torch's load_package first tries load_pt2, which keys
        # entries by their first path component, so an entry named "a/b" is not found there.
        loader = torch._C._aoti.AOTIModelPackageLoader(os.fspath(package), entry, False, 1, -1, False)
        self._model = AOTICompiledModel(loader)
        self._bound: dict[str, Any] = {}

    @property
    def constant_fqns(self) -> list[str]:
        """The fqns the compiled graph needs bound."""
        return list(self._model.get_constant_fqns())

    def bind(self, constants: Mapping[str, Any]) -> None:
        """Bind every constant by fqn; a missing fqn is refused by the loader (full update)."""
        bound = {fqn: constants[fqn].detach().contiguous() for fqn in self.constant_fqns if fqn in constants}
        self._model.load_constants(bound, check_full_update=True)
        self._bound = bound  # keep the tensors alive while bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)
