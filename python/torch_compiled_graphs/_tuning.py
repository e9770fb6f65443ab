"""Kernel choices fit for both ends of a dynamic range (the tuning rule ``"range-ends/8x"``).

AOTInductor compiles one kernel per GEMM (and flex-attention) template for every size a
dynamic dimension takes, and autotuning picks it by timing the candidates at one size,
the dimension's hint. A tile timed at the top of the range can be slow at its bottom
(few thread blocks) and the other way round. So the compile of a variant under this rule
lowers the same program three times:

1. two *probes*, one with every dynamic dimension at the bottom of its range and one at
   its top; each records every autotuning call's timings (:class:`ChoiceTable`) and
   stops once the scheduler has settled its templates, before any kernel or C++ is
   built;
2. the *compile*, at the top, where each autotuning call is offered only the candidate
   whose worse slowdown over the two ends is least (:func:`least_regret`: a slowdown is
   its time over the fastest candidate's at that end).

A call of the compile is matched to the probes' by what it computes (its inputs' and
output's dtypes, sizes and strides as expressions of the graph's symbols, which are the
same in every pass) and a candidate by its template and configuration (tile sizes,
stages, warps). A call the probes did not time, or with no candidate timed at both ends,
keeps all of its candidates: the rule never leaves a call without a choice, it only
narrows one.

The hooks are inductor's own: a feedback saver and a preprocessing function of the
algorithm selector, and the scheduler's construction (``GraphLowering._update_scheduler``)
as the probe's end. Where a torch lacks the last, a probe runs to the end. The hooks are
the process's while they are in place: a probe stops only its own thread's compile, and a
compile of another graph in another thread at the same time (inductor's options are
process-wide already) would be narrowed only in a call that computes exactly what one of
the probes' calls did.

torch is imported lazily, inside functions.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

LOGGER = logging.getLogger("torch_compiled_graphs")

_TRAILING_INDEX = re.compile(r"_?\d+$")


class ProbeDone(Exception):
    """Raised inside the probe's compile once its templates are settled (never escapes :func:`probe`)."""


def _layout_text(node: Any) -> str:
    """``dtype:sizes:strides`` of an IR node or layout, as expressions (never evaluated)."""
    try:
        layout = node.get_layout() if hasattr(node, "get_layout") else node
        return f"{layout.dtype}:{tuple(map(str, layout.size))}:{tuple(map(str, layout.stride))}"
    except Exception:  # a node without a fixed layout is named by its type
        return type(node).__name__


def call_key(choices: Iterable[Any]) -> str:
    """What an autotuning call over ``choices`` computes: its output's layout and the
    layouts its candidates read (a template may read a prepacked or expanded input that
    an extern does not), as expressions of the graph's symbols."""
    outputs: set[str] = set()
    inputs: set[str] = set()
    for choice in choices:
        layout = getattr(choice, "layout", None)
        if layout is not None:
            outputs.add(_layout_text(layout))
        inputs.update(_layout_text(node) for node in getattr(choice, "input_nodes", ()))
    return " | ".join([*sorted(inputs), "->", *sorted(outputs)])


def choice_config(choice: Any) -> str:
    """A candidate's identity within its call: its template's or extern's name (without
    the serial inductor appends) and its configuration (tile sizes, stages, warps)."""
    name = _TRAILING_INDEX.sub("", str(getattr(choice, "name", type(choice).__name__)))
    return f"{name}: {getattr(choice, 'description', '')}"


@dataclass
class ChoiceTable:
    """The probe's timings: ``call key -> {configuration: time}`` (the fastest seen)."""

    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def record(self, timings: dict[Any, float]) -> None:
        """Keep one autotuning call's timings (``choice -> time``; failed ones are infinite)."""
        if not timings:
            return
        row = self.timings.setdefault(call_key(timings), {})
        for choice, time in timings.items():
            if isinstance(time, (int, float)) and math.isfinite(time):
                config = choice_config(choice)
                row[config] = min(float(time), row.get(config, math.inf))


def least_regret(tables: Sequence[ChoiceTable], key: str) -> tuple[set[str], float] | None:
    """The configurations of call ``key`` whose worst slowdown over the ends' tables is
    least (a slowdown being a time over the fastest time at that end), with that
    slowdown; ``None`` where no table timed the call or no configuration was timed at
    every end that timed it."""
    rows = [table.timings[key] for table in tables if table.timings.get(key)]
    if not rows:
        return None
    common = set.intersection(*(set(row) for row in rows))
    if not common:
        return None
    bests = [min(row.values()) for row in rows]
    regret = {config: max(row[config] / best for row, best in zip(rows, bests, strict=True)) for config in common}
    least = min(regret.values())
    return {config for config, value in regret.items() if value <= least}, least


@dataclass
class Narrowing:
    """What the compile's narrowing did: calls narrowed, calls left whole (untimed, or no
    candidate timed at every end), and the worst slowdown at an end of a chosen one."""

    narrowed: int = 0
    whole: int = 0
    kept: int = 0
    offered: int = 0
    worst: float = 1.0


def narrow(tables: Sequence[ChoiceTable], choices: list[Any], tally: Narrowing | None = None) -> list[Any]:
    """The candidates of one autotuning call that the probes found least slow at their
    worst end (:func:`least_regret`); all of them where the probes did not time the call,
    or none of those chosen is offered."""
    configs, regret = least_regret(tables, call_key(choices)) or (set(), 1.0)
    kept = [c for c in choices if choice_config(c) in configs]
    if tally is not None and len(choices) > 1:
        tally.offered += len(choices)
        tally.kept += len(kept or choices)
        if kept:
            tally.narrowed += 1
            tally.worst = max(tally.worst, regret)
        else:
            tally.whole += 1
    return kept or choices


def _selector() -> Any:
    from torch._inductor import select_algorithm

    return select_algorithm.get_algorithm_selector_cache()


@contextlib.contextmanager
def probe() -> Iterator[ChoiceTable]:
    """Record every autotuning call's timings into the yielded table; a compile inside it
    raises :class:`ProbeDone` once the scheduler has been built (the caller catches it with
    :func:`is_probe_done`)."""
    from torch._inductor.graph import GraphLowering

    table = ChoiceTable()

    def saver(timings: Any, *_rest: Any) -> None:
        if isinstance(timings, dict):
            table.record(timings)

    selector = _selector()
    selector.feedback_saver_fns.append(saver)
    original = getattr(GraphLowering, "_update_scheduler", None)

    owner = threading.get_ident()

    def update_scheduler(self: Any) -> None:
        assert original is not None
        original(self)
        # Only the probe's own compile stops: another thread's compile goes on.
        if threading.get_ident() == owner:
            raise ProbeDone("the probe's templates are settled")

    if original is not None:
        GraphLowering._update_scheduler = update_scheduler  # type: ignore[method-assign]
    try:
        yield table
    finally:
        if original is not None:
            GraphLowering._update_scheduler = original  # type: ignore[method-assign]
        with contextlib.suppress(ValueError):
            selector.feedback_saver_fns.remove(saver)


#: What a compile may add to a shape environment: guards, replacements, narrowed ranges.
_ENV_STATE = ("guards", "axioms", "var_to_range", "replacements", "divisible", "deferred_runtime_asserts")


@contextlib.contextmanager
def kept_env(env: Any) -> Iterator[None]:
    """``env`` (the program's shape environment) as it was before, after the probe: the probe
    compiles at other hints, and a guard it added there (true at the bottom, not
    everywhere) must not reach the compile. Restored only where it changed; its caches
    then see a new version."""
    saved = {name: copy.copy(getattr(env, name)) for name in _ENV_STATE if hasattr(env, name)}
    try:
        yield
    finally:
        changed = [name for name, value in saved.items() if getattr(env, name) != value]
        if changed:
            LOGGER.debug("the probe changed the shape environment's %s; restored", ", ".join(changed))
            for name in changed:
                setattr(env, name, saved[name])
            for counter in ("_version_counter", "_replacements_version_counter"):
                if isinstance(getattr(env, counter, None), int):
                    setattr(env, counter, getattr(env, counter) + 1)
            if isinstance(getattr(env, "_symop_cache", None), dict):
                env._symop_cache.clear()
            if hasattr(env, "_resimplify_floor_div_axioms"):
                env._resimplify_floor_div_axioms = True
            get_key = getattr(env, "_get_key", None)
            if callable(get_key) and hasattr(env, "_prev_cache_key"):
                env._prev_cache_key = get_key()


def is_probe_done(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, the probe's stop (inductor may wrap it)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        if isinstance(current, ProbeDone):
            return True
        seen.add(id(current))
        stack.extend([current.__cause__, current.__context__, getattr(current, "inner_exception", None)])
    return False


@contextlib.contextmanager
def narrowed(tables: Sequence[ChoiceTable]) -> Iterator[Narrowing]:
    """Autotuning inside it sees only the candidates :func:`narrow` keeps."""
    tally = Narrowing()

    def preprocess(choices: list[Any]) -> list[Any]:
        return narrow(tables, list(choices), tally)

    selector = _selector()
    selector.preprocessing_fns.append(preprocess)
    try:
        yield tally
    finally:
        with contextlib.suppress(ValueError):
            selector.preprocessing_fns.remove(preprocess)
