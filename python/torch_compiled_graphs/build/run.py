"""Planning a matrix and running its cells: the executors' shared half.

Every executor runs the same cell step (``build-cell``) in a fresh process per cell with
an explicit device visibility, reads its one JSON line, and retries only transient
outcomes: the step's transient exit code, or a cell process killed by a signal.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import EXIT_DETERMINISTIC, EXIT_DONE, EXIT_TRANSIENT, EXIT_USAGE
from .matrix import Cell, Matrix

__all__ = [
    "CellRun",
    "PlanRow",
    "Progress",
    "cell_command",
    "cell_env",
    "plan",
    "run_cell_process",
    "run_local",
    "visible_gpus",
]


@dataclass
class PlanRow:
    """What the planner found for one cell before anything ran."""

    index: int
    name: str
    target: str
    machine: str
    key: str | None
    state: str  # present | needs-mint | unknown
    reason: str | None = None
    #: For a present cell: signed as :class:`~.verdict.RemoteVerdict` says.
    signed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "cell": self.name,
            "target": self.target,
            "machine": self.machine,
            "key": self.key,
            "state": self.state,
            "reason": self.reason,
            "signed": self.signed,
        }


@dataclass
class CellRun:
    """One cell's final outcome in a build report."""

    index: int
    name: str
    target: str
    key: str | None
    outcome: str  # present | minted | refused | failed
    code: str | None = None
    message: str | None = None
    fact: dict[str, Any] | None = None
    host: str | None = None
    node: str | None = None
    seconds: float = 0.0
    attempts: int = 0
    signed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

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
            "host": self.host,
            "node": self.node,
            "seconds": round(self.seconds, 3),
            "attempts": self.attempts,
            "signed": self.signed,
        }


# ------------------------------------------------------------------------------- planning


def plan(matrix: Matrix, indices: Iterable[int] | None = None) -> list[PlanRow]:
    """Export and declare every cell here, derive its key under the lock and ask the remote.

    A cell whose key has a ref on the remote is ``present`` only when a fresh worker with
    this process's trust policy can take it (fetched into a private store and verified:
    :func:`~.verdict.remote_verdict`); otherwise it ``needs-mint`` with the reason.

    A cell whose recipe cannot run on this machine (a GPU model, say) or whose state the
    remote cannot tell is ``unknown``: it is run, and its cell step decides. A ``cpu``
    cell's key uses this machine's CPU level (name a concrete ``cpu-<level>`` when the
    builders' level differs).
    """
    import tempfile

    from ..engine import Engine
    from .cell import CELL_ENV, _call_recipe, cell_key
    from .verdict import remote_verdict

    lock = matrix.lock()
    rows: list[PlanRow] = []
    wanted = range(len(matrix.cells)) if indices is None else indices
    saved = os.environ.pop(CELL_ENV, None)
    with tempfile.TemporaryDirectory(prefix="tcg-build-plan-") as work:
        engine = Engine(os.path.join(work, "store"), remote=matrix.remote or "")
        if not matrix.remote and matrix.store:
            engine = Engine(matrix.store, remote="")
        for i in wanted:
            cell = matrix.cell(i)
            row = PlanRow(cell.index, cell.name, cell.target, cell.machine, None, "unknown")
            rows.append(row)
            try:
                spec = _call_recipe(cell)
                row.key = cell_key(spec, cell, lock)
                explanation = engine.explain(spec.declare(), target=cell.target, toolchain=lock, limit=0)
            except Exception as exc:
                row.reason = f"{getattr(exc, 'code', type(exc).__name__)}: {exc}"
                continue
            if matrix.remote:
                state = explanation.remote or {}
                if state.get("state") == "present":
                    # The ref names something: present only if a fresh worker can take it.
                    verdict = remote_verdict(matrix.remote, row.key)
                    row.state = "present" if verdict.present else "needs-mint"
                    row.reason, row.signed = verdict.reason, verdict.signed
                elif state.get("state") == "absent":
                    row.state = "needs-mint"
                else:
                    row.reason = f"the remote cannot tell: {state.get('reason', 'no answer')}"
            else:
                row.state = "present" if explanation.present else "needs-mint"
                row.signed = row.state == "present" and bool(engine.signers(row.key))
    if saved is not None:
        os.environ[CELL_ENV] = saved
    return rows


# ------------------------------------------------------------------------------- the cell process


def cell_command(matrix: Matrix, index: int | None = None, *, python: str | None = None) -> list[str]:
    """The command line of the cell step (``--index`` omitted: the Job's index decides)."""
    argv = [python or sys.executable, "-m", "torch_compiled_graphs", "build-cell", str(matrix.path)]
    argv += ["--toolchain", str(matrix.toolchain_path)]
    if index is not None:
        argv += ["--index", str(index)]
    return argv


def cell_env(cell: Cell, base: Mapping[str, str] | None = None, gpu: str | None = None) -> dict[str, str]:
    """The cell process's environment: no GPU for a CPU cell, exactly ``gpu`` for a GPU cell."""
    env = dict(os.environ if base is None else base)
    if cell.gpu:
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["NVIDIA_VISIBLE_DEVICES"] = "none"
    return env


def parse_cell_output(cell: Cell, proc_rc: int, stdout: str, stderr: str) -> tuple[CellRun, bool]:
    """A finished cell process as a :class:`CellRun` and whether it may be retried."""
    line = None
    for text in reversed(stdout.splitlines()):
        if text.startswith("{"):
            line = text
            break
    row: dict[str, Any] = {}
    if line is not None:
        try:
            row = json.loads(line)
        except ValueError:
            row = {}
    run = CellRun(cell.index, cell.name, cell.target, row.get("key"), str(row.get("outcome", "failed")))
    run.code, run.message, run.fact = row.get("code"), row.get("message"), row.get("fact")
    run.host, run.signed = row.get("host"), bool(row.get("signed", False))
    if proc_rc == EXIT_DONE and row:
        return run, False
    if proc_rc < 0 or proc_rc in (128 + 9, 128 + 15):
        signal_number = -proc_rc if proc_rc < 0 else proc_rc - 128
        run.outcome, run.code = "failed", "build.killed"
        run.message = f"the cell process was killed by signal {signal_number} (preempted or out of memory?)"
        return run, True
    if proc_rc == EXIT_TRANSIENT:
        return run, True
    if proc_rc in (EXIT_DETERMINISTIC, EXIT_USAGE) and row:
        return run, False
    tail = stderr.strip().splitlines()[-3:]
    run.outcome = "failed"
    run.code = run.code or ("build.cell_usage" if proc_rc == EXIT_USAGE else "build.cell_crashed")
    run.message = run.message or f"the cell process exited {proc_rc}: {' | '.join(tail)}"
    return run, False


def run_cell_process(
    matrix: Matrix, cell: Cell, *, gpu: str | None = None, timeout: float | None = None
) -> tuple[CellRun, bool]:
    """Run one cell step in a fresh process; ``(result, retryable)``."""
    started = time.monotonic()
    proc = subprocess.run(
        cell_command(matrix, cell.index),
        env=cell_env(cell, gpu=gpu),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run, retry = parse_cell_output(cell, proc.returncode, proc.stdout, proc.stderr)
    run.seconds = time.monotonic() - started
    run.host = run.host or socket.gethostname()
    run.node = run.node or socket.gethostname()
    return run, retry


# ------------------------------------------------------------------------------- progress


class Progress:
    """Cells done / running / failed on one stderr line, only on a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.running = self.failed = 0
        self._lock = threading.Lock()

    def update(self, *, started: int = 0, finished: CellRun | None = None, retried: bool = False) -> None:
        with self._lock:
            self.running += started
            if finished is not None:
                self.running -= 1
                if not retried:
                    if finished.outcome in ("present", "minted"):
                        self.done += 1
                    else:
                        self.failed += 1
            if self.enabled:
                sys.stderr.write(
                    f"\rcells: {self.done}/{self.total} done, {self.running} running, {self.failed} failed\x1b[K"
                )
                sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ------------------------------------------------------------------------------- the local executor


def visible_gpus() -> list[tuple[str, str]]:
    """``(index, sm_NN)`` of this machine's GPUs from ``nvidia-smi`` (none without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        index, _, cap = (part.strip() for part in line.partition(","))
        if index.isdigit() and cap:
            gpus.append((index, "sm_" + cap.replace(".", "")))
    return gpus


def run_local(
    matrix: Matrix,
    cells: list[Cell],
    *,
    parallelism: int | None = None,
    retries: int | None = None,
    progress: Progress | None = None,
    gpus: list[tuple[str, str]] | None = None,
) -> list[CellRun]:
    """Run ``cells`` in a pool of ``parallelism`` cell processes on this machine.

    A GPU cell also holds one GPU whose capability equals its target (one cell per GPU);
    with none here it runs seeing no GPU and its cell step refuses it.
    """
    width = max(1, int(parallelism or matrix.local.get("parallelism") or os.cpu_count() or 1))
    tries = 1 + max(0, int(matrix.local.get("retries", 2) if retries is None else retries))
    free = visible_gpus() if gpus is None else list(gpus)
    has = {sm for _, sm in free}
    cond = threading.Condition()
    results: dict[int, CellRun] = {}
    queue = list(cells)
    running = 0

    def take(cell: Cell) -> tuple[bool, str | None]:
        """Whether ``cell`` may start now, and the GPU it gets (caller holds ``cond``)."""
        if running >= width:
            return False, None
        if not cell.gpu or cell.target.rstrip("a") not in has:
            return True, None
        for n, (index, sm) in enumerate(free):
            if sm == cell.target.rstrip("a"):
                free.pop(n)
                return True, index
        return False, None

    def work(cell: Cell, gpu: str | None) -> None:
        nonlocal running
        attempts = 0
        run: CellRun | None = None
        try:
            while attempts < tries:
                attempts += 1
                try:
                    run, retry = run_cell_process(matrix, cell, gpu=gpu)
                except Exception as exc:  # the process could not even start
                    run = CellRun(cell.index, cell.name, cell.target, None, "failed", "build.cell_crashed", str(exc))
                    retry = False
                run.attempts = attempts
                final = not retry or attempts >= tries
                if progress is not None:
                    progress.update(finished=run, retried=not final)
                    if not final:
                        progress.update(started=1)
                if final:
                    break
        finally:
            with cond:
                results[cell.index] = run or CellRun(
                    cell.index, cell.name, cell.target, None, "failed", "build.cell_crashed"
                )
                running -= 1
                if gpu is not None:
                    free.append((gpu, cell.target.rstrip("a")))
                cond.notify_all()

    threads: list[threading.Thread] = []
    with cond:
        while queue:
            for cell in list(queue):
                ok, gpu = take(cell)
                if ok:
                    queue.remove(cell)
                    running += 1
                    if progress is not None:
                        progress.update(started=1)
                    t = threading.Thread(target=work, args=(cell, gpu), name=f"tcg-cell-{cell.index}", daemon=True)
                    threads.append(t)
                    t.start()
            if queue:
                cond.wait()
    for t in threads:
        t.join()
    return [results[c.index] for c in cells]


RunFn = Callable[..., list[CellRun]]
