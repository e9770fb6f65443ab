"""The one idempotent cell step: ``build-cell MATRIX --index N`` and :func:`build_cell`.

Declare the cell, derive its key under the locked toolchain, refuse when this machine's
toolchain or visible device differs from the lock and the cell's target, skip when the
remote holds the key as a fresh worker would take it (fetched, verified and, under a trust
policy, signed by an allowed signer: :func:`~.verdict.remote_verdict`; a ref alone is not
enough), otherwise mint through ``Engine(remote=...)``'s ``ensure`` (the fleet's
single-flight; signed when a signing key is configured) and check the remote again.
"""

from __future__ import annotations

import inspect
import os
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from ..errors import CompiledGraphError
from .errors import EXIT_DETERMINISTIC, EXIT_DONE, EXIT_TRANSIENT, BuildError
from .matrix import Cell, Matrix
from .verdict import remote_verdict

__all__ = [
    "CELL_ENV",
    "CellResult",
    "build_cell",
    "cell_key",
    "cell_toolchain",
    "classify",
    "device_refusal",
    "load_recipe",
    "toolchain_refusal",
]

#: The cell step's own transient codes (besides the remote's, ``remote.*``).
TRANSIENT_CODES = frozenset({"build.remote_unavailable", "build.publish_failed"})

#: Set in every cell process to the cell's matrix index (recipes may read it).
CELL_ENV = "TORCH_COMPILED_GRAPHS_BUILD_CELL"


@dataclass
class CellResult:
    """What one cell step concluded; :meth:`to_json` is the one JSON line it prints."""

    index: int
    name: str
    target: str
    key: str | None
    outcome: str  # present | minted | refused | failed
    code: str | None = None
    message: str | None = None
    fact: dict[str, Any] | None = None
    transient: bool = False
    signed: bool = False
    host: str = ""
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.outcome in ("present", "minted"):
            return EXIT_DONE
        return EXIT_TRANSIENT if self.transient else EXIT_DETERMINISTIC

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "cell": self.name,
            "target": self.target,
            "key": self.key,
            "outcome": self.outcome,
            "code": self.code,
            "message": self.message,
            "fact": self.fact,
            "transient": self.transient,
            "signed": self.signed,
            "host": self.host,
            "seconds": round(self.seconds, 3),
        }


class _Refused(Exception):
    def __init__(self, code: str, message: str, fact: dict[str, Any]) -> None:
        super().__init__(message)
        self.code = code
        self.fact = fact


def load_recipe(cell: Cell) -> Callable[..., Any]:
    """Import ``module:function`` (``build.recipe_invalid`` when it cannot be)."""
    module_name, _, attr = cell.callable.partition(":")
    try:
        obj: Any = import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise BuildError(f"cannot import recipe {cell.callable!r}: {exc}", "build.recipe_invalid") from exc
    if not callable(obj):
        raise BuildError(f"recipe {cell.callable!r} is not callable", "build.recipe_invalid")
    return obj  # type: ignore[no-any-return]


def _call_recipe(cell: Cell) -> Any:
    from ..declaration import GraphClassSpec

    fn = load_recipe(cell)
    kwargs = dict(cell.params)
    try:
        parameters = inspect.signature(fn).parameters
        if "target" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            kwargs["target"] = cell.target
    except (TypeError, ValueError):
        kwargs["target"] = cell.target
    try:
        spec = fn(**kwargs)
    except CompiledGraphError:
        raise
    except Exception as exc:
        raise BuildError(
            f"recipe {cell.callable} failed for {cell.name}: {type(exc).__name__}: {exc}", "build.recipe_failed"
        ) from exc
    if not isinstance(spec, GraphClassSpec):
        raise BuildError(
            f"recipe {cell.callable} must return a GraphClassSpec, got {type(spec).__qualname__}",
            "build.recipe_invalid",
        )
    return spec


def toolchain_refusal(lock: Mapping[str, str], here: Mapping[str, str]) -> _Refused | None:
    """The refusal when this machine's toolchain block differs from the lock, or ``None``.

    The message names the first differing member (sorted by name) and counts the others;
    ``fact`` holds every difference as ``{member: {"lock": ..., "here": ...}}`` (``None``
    for a member one side lacks).
    """
    differing = sorted(set(lock) | set(here), key=lambda m: (m != "torch", m))
    diffs = {m: {"lock": lock.get(m), "here": here.get(m)} for m in differing if lock.get(m) != here.get(m)}
    if not diffs:
        return None
    first = next(iter(diffs))
    values = diffs[first]
    more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
    message = (
        f"this machine's toolchain differs from the lock in {first!r}: the lock has {values['lock']!r}, "
        f"this machine {values['here']!r}{more}"
    )
    return _Refused("build.toolchain_mismatch", message, {"axis": "toolchain", "member": first, **values, "all": diffs})


def _visible_gpus() -> list[str]:
    """``sm_NN`` of every CUDA device this process sees (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        out.append(f"sm_{major}{minor}")
    return out


def device_refusal(target: str, gpus: list[str], cpu_sm: str) -> _Refused | None:
    """The refusal when the visible devices do not fit ``target``, or ``None``.

    A CPU cell must see no GPU (and a ``cpu-<level>`` one must run on that level); an
    ``sm_NN`` cell must see exactly one GPU, of capability NN.
    """
    if not target.startswith("sm_"):
        if gpus:
            return _Refused(
                "build.device_mismatch",
                f"a {target} cell must see no GPU, but this process sees {len(gpus)} ({', '.join(gpus)}); "
                "run it with CUDA_VISIBLE_DEVICES= (empty)",
                {"axis": "device", "member": "visible_gpus", "lock": [], "here": gpus},
            )
        if target != "cpu" and target != cpu_sm:
            return _Refused(
                "build.device_mismatch",
                f"the cell's target is {target}, but this machine's CPU level is {cpu_sm}",
                {"axis": "sm", "member": "cpu_level", "lock": target, "here": cpu_sm},
            )
        return None
    wanted = target.rstrip("a")
    if len(gpus) != 1 or gpus[0] != wanted:
        seen = ", ".join(gpus) if gpus else "none"
        return _Refused(
            "build.device_mismatch",
            f"a {target} cell must see exactly one GPU of capability {wanted}; this process sees {seen}",
            {"axis": "device", "member": "visible_gpus", "lock": [wanted], "here": gpus},
        )
    return None


def cell_toolchain(cell: Cell, lock: Mapping[str, str]) -> dict[str, str]:
    """The toolchain the cell's key is derived under: the lock, with the ``settings_declaration``
    of the cell's variant when it is not the default (docs/keys.md, "Variants")."""
    if cell.variant == "default":
        return dict(lock)
    from ..toolchain import variant_toolchain

    return variant_toolchain(lock, cell.variant)


def cell_key(spec: Any, cell: Cell, lock: Mapping[str, str]) -> str:
    """The cell's key: its declaration, the target's ``sm`` here, the locked toolchain (under
    the cell's variant)."""
    from ..explain import sm_of_target
    from ..identity import CompiledGraphKey

    declaration = spec.declare()
    return str(
        CompiledGraphKey.for_declaration(
            declaration, sm=sm_of_target(cell.target), toolchain=cell_toolchain(cell, lock)
        )
    )


def classify(exc: BaseException) -> tuple[str, bool]:
    """``(code, transient)`` of a failure: remote and I/O trouble is transient, the rest is not."""
    code = getattr(exc, "code", None)
    if isinstance(exc, CompiledGraphError) and isinstance(code, str):
        return code, code in TRANSIENT_CODES or (code.startswith("remote.") and code != "remote.config_invalid")
    if isinstance(exc, OSError):
        return (code if isinstance(code, str) else "build.io_error"), True
    return "build.cell_failed", False


def _ensure_target(target: str) -> str:
    return "cpu" if not target.startswith("sm_") else target


def build_cell(
    matrix: Matrix,
    index: int,
    *,
    store: str | os.PathLike[str] | None = None,
    here: Mapping[str, str] | None = None,
) -> CellResult:
    """Run cell ``index`` of ``matrix`` here; never raises for the cell's own failures.

    ``here`` is this machine's toolchain block (default: :func:`record_toolchain`). The
    store is ``store``, else the matrix's ``store``, else a private temporary store when
    a remote is configured (the remote is the state), else the default store.
    """
    started = time.monotonic()
    cell = matrix.cell(index)
    result = CellResult(cell.index, cell.name, cell.target, None, "failed", host=socket.gethostname())
    saved = os.environ.get(CELL_ENV)
    os.environ[CELL_ENV] = str(cell.index)
    try:
        _run(matrix, cell, result, store, here)
    except _Refused as r:
        result.outcome, result.code, result.message, result.fact = "refused", r.code, str(r), r.fact
    except Exception as exc:
        result.outcome = "failed"
        result.code, result.transient = classify(exc)
        result.message = str(exc) or type(exc).__name__
    finally:
        if saved is None:
            os.environ.pop(CELL_ENV, None)
        else:
            os.environ[CELL_ENV] = saved
    result.seconds = time.monotonic() - started
    return result


def _run(
    matrix: Matrix,
    cell: Cell,
    result: CellResult,
    store: str | os.PathLike[str] | None,
    here: Mapping[str, str] | None,
) -> None:
    from .. import _native
    from ..engine import Engine, EnsureOutcome, default_store_root

    lock = matrix.lock()
    if here is None:
        from ..toolchain import record_toolchain

        here = record_toolchain()
    refusal = toolchain_refusal(lock, here)
    if refusal is not None:
        raise refusal
    refusal = device_refusal(cell.target, _visible_gpus(), str(_native.cpu_sm()))
    if refusal is not None:
        raise refusal
    spec = _call_recipe(cell)
    key = cell_key(spec, cell, lock)
    result.key = key
    root = store if store is not None else matrix.store
    with tempfile.TemporaryDirectory(prefix="tcg-build-cell-") as work:
        if root is None:
            root = os.path.join(work, "store") if matrix.remote else default_store_root()
        engine = Engine(root, remote=matrix.remote or "")
        toolchain = cell_toolchain(cell, lock)
        explanation = engine.explain(spec.declare(), target=cell.target, toolchain=toolchain, limit=0)
        if explanation.key != key:
            raise BuildError(f"explain derived {explanation.key}, the cell {key}", "build.cell_failed")
        state = explanation.remote
        if matrix.remote:
            if state is None or state.get("state") not in ("present", "absent"):
                reason = (state or {}).get("reason", "no answer")
                raise BuildError(
                    f"cannot ask the remote {matrix.remote} for {key}: {reason}", "build.remote_unavailable"
                )
            if state["state"] == "present":
                # A ref is not an artifact: present only when a fresh worker can take it.
                verdict = remote_verdict(matrix.remote, key)
                if verdict.present:
                    result.outcome, result.signed = "present", verdict.signed
                    return
                result.fact = {"remote_before": verdict.fact()}
        elif explanation.present:
            result.outcome, result.signed = "present", _signed_locally(engine, key)
            return
        done = engine.ensure(
            key,
            os.path.join(work, "graph"),
            target=_ensure_target(cell.target),
            toolchain=toolchain,
            recipe=lambda: spec,
            variant=cell.variant,
        )
        minted = done.outcome is EnsureOutcome.MINTED and done.compiled_graph.source == "compiled"
        if not matrix.remote:
            result.outcome, result.signed = ("minted" if minted else "present"), _signed_locally(engine, key)
            return
        published = done.remote_publication
        if minted and published is None:
            raise BuildError(
                f"{key} was compiled but not published to {matrix.remote}; a retry mints it again",
                "build.publish_failed",
            )
        # What the fleet can take now, whatever ensure did (minted and published, fetched
        # what another builder published meanwhile, or found it in a persistent store).
        verdict = remote_verdict(matrix.remote, key)
        if not verdict.present:
            result.fact = {
                **(result.fact or {}),
                "remote_after": verdict.fact(),
                "publication": None if published is None else str(published["outcome"]),
                "source": done.compiled_graph.source,
            }
            raise BuildError(
                _unservable(key, matrix.remote, done.compiled_graph.source, published, verdict, root),
                "build.remote_unservable",
            )
        result.outcome = "minted" if minted else "present"
        result.signed = verdict.signed


def _signed_locally(engine: Any, key: str) -> bool:
    """Without a remote: whether the stored artifact carries a valid signature record."""
    return bool(engine.signers(key))


def _unservable(key: str, remote: str, source: str, published: Any, verdict: Any, root: Any) -> str:
    where = {"compiled": "minted", "remote": "fetched", "local": "found in the store"}.get(source, source)
    text = f"{key} was {where} here, but a worker of this fleet cannot take it from {remote}: {verdict.reason}"
    if source == "local":
        return text + f" (the store {root} has it and the remote does not: `torch-compiled-graphs push {key}`)"
    if published is not None and str(published["outcome"]).lower() == "divergent":
        text += (
            "; the remote's ref names another artifact (first writer wins): an operator mends it with "
            f"`torch-compiled-graphs fleet repair {key}` from a store that has this one"
        )
    if verdict.trusting:
        text += "; under this trust policy the artifact must be signed by an allowed signer (docs/trust.md)"
    return text
