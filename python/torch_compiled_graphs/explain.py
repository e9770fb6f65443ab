"""Explaining a miss: which fact made a requested key differ from what is stored.

:meth:`Engine.explain <torch_compiled_graphs.Engine.explain>` answers for a
``GraphClassSpec`` (then the program's canonical lines are compared too) or a
``GraphClassDeclaration`` alone (without torch); ``Engine.ensure`` attaches the
same explanation to a minting result and logs it once on the logger
``torch_compiled_graphs``. The diff and its text come from the native core,
which the CLI's ``explain`` command uses too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import CompiledGraphError, DeclarationError

if TYPE_CHECKING:
    from .declaration import GraphClassSpec
    from .identity import GraphClassDeclaration

__all__ = ["Difference", "Explanation", "Neighbour", "sm_of_target"]

LOGGER = logging.getLogger("torch_compiled_graphs")

_CUDA_SM = re.compile(r"sm_[0-9]+a?")
_CPU_SM = re.compile(r"cpu-[a-z0-9_.-]+")


@dataclass(frozen=True)
class Difference:
    """One fact that differs: its axis (``graph``, ``sm``, ``toolchain``), name and both values.

    ``detail`` holds names added and removed (``graph.constant_fqns``), leaf
    differences (``range_digest``: the call ingress; ``graph.pytree.*``) or
    the first differing canonical lines (``graph_witness``).
    """

    axis: str
    fact: str
    requested: Any
    stored: Any
    detail: Any = None

    def __hash__(self) -> int:
        # The values may be lists or objects: hash the names only.
        return hash((self.axis, self.fact))

    @classmethod
    def _from(cls, d: Mapping[str, Any]) -> Difference:
        return cls(d["axis"], d["fact"], d["requested"], d["stored"], d.get("detail"))


@dataclass(frozen=True)
class Neighbour:
    """A stored entry of the same graph class and how it differs from the request."""

    key: str
    axes: dict[str, str]
    differing_axes: tuple[str, ...]
    differences: tuple[Difference, ...]
    lines_kept: bool

    @property
    def facts(self) -> tuple[str, ...]:
        """The names of the differing facts."""
        return tuple(d.fact for d in self.differences)

    def __hash__(self) -> int:
        return hash((self.key, self.facts))

    @classmethod
    def _from(cls, d: Mapping[str, Any]) -> Neighbour:
        return cls(
            d["key"],
            dict(d["axes"]),
            tuple(d["differing_axes"]),
            tuple(Difference._from(x) for x in d["differences"]),
            bool(d["lines_kept"]),
        )


@dataclass(frozen=True)
class Explanation:
    """Whether a key is stored and, if not, its nearest stored neighbours with their differences.

    ``remote`` is ``None`` without a fleet remote (and after a mint); with one, whether the
    remote has a ref for the key: ``{"state": "present", "manifest": <64 hex>}``,
    ``{"state": "absent"}``, or ``{"state": "unknown", "reason": ...}`` when it cannot be
    asked (never an error). Nothing is fetched to say so.
    ``report`` is the stable JSON form (the CLI's ``--json``); ``str()`` is its text.
    """

    key: str
    graph_class: str
    axes: dict[str, str]
    present: bool
    quarantined: bool
    remote: Any
    neighbours: tuple[Neighbour, ...]
    report: dict[str, Any]

    @property
    def nearest(self) -> Neighbour | None:
        """The nearest stored neighbour, if any."""
        return self.neighbours[0] if self.neighbours else None

    def __str__(self) -> str:
        return _native.render_explanation("explain", self.report).rstrip("\n")

    def __hash__(self) -> int:
        return hash((self.key, self.present, self.neighbours))

    @classmethod
    def _from(cls, report: dict[str, Any]) -> Explanation:
        return cls(
            report["key"],
            report["graph_class"],
            dict(report["axes"]),
            bool(report["present"]),
            bool(report["quarantined"]),
            report["remote"],
            tuple(Neighbour._from(n) for n in report["neighbours"]),
            report,
        )


def sm_of_target(target: str) -> str:
    """The ``sm`` axis a target asks for, without a device check and without torch.

    ``cpu`` is this host's CPU level; ``sm_NN[a]`` and a concrete
    ``cpu-<level>`` (another host's, say) are taken verbatim.
    """
    if not isinstance(target, str):
        raise DeclarationError("target must be 'cpu', 'sm_NN[a]' or 'cpu-<level>'", "declaration.target_unsupported")
    t = target.strip().lower()
    if t == "cpu":
        return str(_native.cpu_sm())
    if _CUDA_SM.fullmatch(t) or _CPU_SM.fullmatch(t):
        return t
    raise DeclarationError(
        f"target {target!r} must be 'cpu', 'sm_NN[a]' or 'cpu-<level>'", "declaration.target_unsupported"
    )


def explain_request(
    native: Any,
    what: GraphClassSpec | GraphClassDeclaration,
    target: str,
    toolchain: Mapping[str, object],
    limit: int,
) -> Explanation:
    """Explain the key ``what`` derives under ``target`` and ``toolchain``."""
    from .identity import GraphClassDeclaration

    lines: list[str] | None = None
    if isinstance(what, GraphClassDeclaration):
        declaration = what
    else:
        from .declaration import GraphClassSpec, canonical_lines

        if not isinstance(what, GraphClassSpec):
            raise DeclarationError(
                f"explain needs a GraphClassSpec or a GraphClassDeclaration, got {type(what).__qualname__}",
                "declaration.program_invalid",
            )
        declaration = what.declare()
        lines = canonical_lines(what.program)
    if not isinstance(toolchain, Mapping):
        raise DeclarationError(
            f"toolchain block must be a mapping, got {type(toolchain).__qualname__}", "declaration.toolchain_invalid"
        )
    block = {str(k): str(v) for k, v in toolchain.items()}
    report = native.explain(declaration.to_dict(), sm_of_target(target), block, lines, limit)
    return Explanation._from(report)


def explain_miss(native: Any, key: str) -> Explanation | None:
    """After ``ensure`` minted ``key``: why it missed, logged once when a neighbour is stored.

    Best effort: the compile already succeeded, so a failure to explain is
    logged at debug level and yields ``None``.
    """
    try:
        report = native.explain_stored(key)
    except (CompiledGraphError, OSError) as exc:
        LOGGER.debug("cannot explain the miss of %s: %s", key, exc)
        return None
    if report is None:
        return None
    # The explanation is of the miss: the key was not stored when ensure asked.
    report["present"] = False
    report["quarantined"] = False
    explanation = Explanation._from(report)
    if explanation.neighbours:
        LOGGER.warning("compiled graph miss, compiled it: %s", explanation)
    return explanation
