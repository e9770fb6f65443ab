"""Kernel choices fit for both ends of a dynamic range (the tuning rule ``"range-ends/8x"``).

AOTInductor compiles one kernel per GEMM (and flex-attention) template for every size a
dynamic dimension takes, and autotuning picks it by timing the candidates at one size,
the dimension's hint. A tile timed at the top of the range can be slow at its bottom
(few thread blocks) and the other way round. So the compile of a variant under this rule
runs in two passes over the same program:

1. the *probe*: lowered with every dynamic dimension at the bottom of its range; each
   autotuning call's timings are recorded (:class:`ChoiceTable`), and the compile stops
   once the scheduler has settled its templates, before any kernel or C++ is built;
2. the *compile*: at the top of each range, where autotuning only sees the candidates
   that were within :data:`SLACK` of the fastest at the bottom, and picks the fastest of
   those at the top.

A call of the compile is matched to the probe's by what it computes (its inputs' and
output's dtypes, sizes and strides as expressions of the graph's symbols, which are the
same in both passes) and a candidate by its template and configuration (tile sizes,
stages, warps). A call the probe did not time, or whose timed
candidates none survive, keeps all of its candidates: the rule never leaves a call
without a choice, it only narrows one.

The hooks are inductor's own: a feedback saver and a preprocessing function of the
algorithm selector, and the scheduler's construction (``GraphLowering._update_scheduler``)
as the probe's end. Where a torch lacks the last, the probe runs to the end.

torch is imported lazily, inside functions.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

LOGGER = logging.getLogger("torch_compiled_graphs")

#: A candidate survives the probe when its time at the bottom is at most this times the fastest's.
SLACK = 1.10

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

    def fit(self, key: str) -> set[str] | None:
        """The configurations within :data:`SLACK` of the fastest for ``key``; ``None`` if untimed."""
        row = self.timings.get(key)
        if not row:
            return None
        best = min(row.values())
        return {config for config, time in row.items() if time <= best * SLACK}


@dataclass
class Narrowing:
    """What the compile's narrowing did: calls narrowed, and calls left whole (untimed or none fit)."""

    narrowed: int = 0
    whole: int = 0
    kept: int = 0
    offered: int = 0


def narrow(table: ChoiceTable, choices: list[Any], tally: Narrowing | None = None) -> list[Any]:
    """The candidates of one autotuning call less those the probe found slow at the
    bottom; all of them where the probe did not time the call or none of them fit."""
    fit = table.fit(call_key(choices))
    kept = [c for c in choices if choice_config(c) in fit] if fit is not None else []
    if tally is not None and len(choices) > 1:
        tally.offered += len(choices)
        tally.kept += len(kept or choices)
        if kept:
            tally.narrowed += 1
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

    def update_scheduler(self: Any) -> None:
        assert original is not None
        original(self)
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
def narrowed(table: ChoiceTable) -> Iterator[Narrowing]:
    """Autotuning inside it sees only the candidates :func:`narrow` keeps."""
    tally = Narrowing()

    def preprocess(choices: list[Any]) -> list[Any]:
        return narrow(table, list(choices), tally)

    selector = _selector()
    selector.preprocessing_fns.append(preprocess)
    try:
        yield tally
    finally:
        with contextlib.suppress(ValueError):
            selector.preprocessing_fns.remove(preprocess)
