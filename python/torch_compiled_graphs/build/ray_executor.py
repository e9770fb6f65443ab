"""The ``ray`` executor: one Ray task per cell, placed by a custom resource per target.

Each task asks for ``num_cpus`` (``[ray] num_cpus``, default 1), the resource
``tcg-target-<target>`` (one unit; the nodes that may build a target carry it: ``ray start
--resources '{"tcg-target-cpu": 8}'``), and for an ``sm_NN`` cell one GPU (and the
``accelerator_type`` named for the target in ``[ray.accelerator_types]``, if any). Tasks run
with ``max_calls=1`` (a fresh worker per cell) and start the cell step in a fresh process of
their own with the device visibility set. Ray's own retries are off: the driver resubmits a
cell only when its outcome is transient (the transient exit code, a killed cell process, a
lost worker or node), up to ``[ray] retries`` (default 2) times.

``ray`` is imported only here (the ``torch-compiled-graphs[ray]`` extra).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from typing import Any

from .matrix import Cell, Matrix
from .run import CellRun, Progress, parse_cell_output

__all__ = ["RESOURCE_PREFIX", "resource_name", "run_ray", "task_options", "unplaceable"]

#: Custom resource of a target: ``tcg-target-cpu``, ``tcg-target-sm_90``.
RESOURCE_PREFIX = "tcg-target-"


def resource_name(target: str) -> str:
    return RESOURCE_PREFIX + target


def task_options(matrix: Matrix, cell: Cell) -> dict[str, Any]:
    """The ``.options(...)`` of a cell's task."""
    options: dict[str, Any] = {
        "num_cpus": float(matrix.ray.get("num_cpus", 1)),
        "num_gpus": 1 if cell.gpu else 0,
        "resources": {resource_name(cell.target): 1},
        "max_retries": 0,
        "retry_exceptions": False,
        "name": f"tcg-build-cell-{cell.index}",
    }
    accelerator = dict(matrix.ray.get("accelerator_types") or {}).get(cell.target)
    if cell.gpu and accelerator:
        options["accelerator_type"] = str(accelerator)
    return options


def _demand(options: dict[str, Any]) -> dict[str, float]:
    demand = {"CPU": float(options["num_cpus"]), **{k: float(v) for k, v in options["resources"].items()}}
    if options["num_gpus"]:
        demand["GPU"] = float(options["num_gpus"])
    if "accelerator_type" in options:
        demand[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return {k: v for k, v in demand.items() if v}


def unplaceable(demand: dict[str, float], nodes: list[dict[str, float]]) -> bool:
    """Whether no node's total resources can ever hold ``demand`` (Ray would wait forever)."""
    return not any(all(node.get(k, 0.0) >= v for k, v in demand.items()) for node in nodes)


def _cell_task(matrix_text: str, lock_text: str, matrix_name: str, cell_index: int, gpu: bool) -> dict[str, Any]:
    """On the worker: write the matrix and lock to a private directory, run the cell step."""
    import sys

    import ray

    node = ray.get_runtime_context().get_node_id()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tcg-ray-cell-") as work:
        matrix_path = os.path.join(work, matrix_name)
        lock_path = os.path.join(work, "fleet-toolchain.json")
        with open(matrix_path, "w", encoding="utf-8") as fh:
            fh.write(matrix_text)
        with open(lock_path, "w", encoding="utf-8") as fh:
            fh.write(lock_text)
        env = dict(os.environ)
        if not gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["NVIDIA_VISIBLE_DEVICES"] = "none"
        argv = [sys.executable, "-m", "torch_compiled_graphs", "build-cell", matrix_path]
        argv += ["--toolchain", lock_path, "--index", str(cell_index)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=os.getcwd())
    return {
        "rc": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr[-4000:],
        "node": node,
        "host": socket.gethostname(),
        "seconds": time.monotonic() - started,
    }


def run_ray(
    matrix: Matrix,
    cells: list[Cell],
    *,
    address: str | None = None,
    retries: int | None = None,
    progress: Progress | None = None,
) -> list[CellRun]:
    """Run ``cells`` on the Ray cluster at ``address`` (else ``[ray] address``, else ``RAY_ADDRESS``)."""
    import ray
    from ray.exceptions import RayError

    from .errors import BuildError

    target = address or matrix.ray.get("address") or os.environ.get("RAY_ADDRESS")
    if not target:
        raise BuildError(
            "the ray executor needs a cluster: --ray-address, [ray] address or RAY_ADDRESS", "build.executor_invalid"
        )
    tries = 1 + max(0, int(matrix.ray.get("retries", 2) if retries is None else retries))
    lock_text = matrix.toolchain_path.read_text(encoding="utf-8")
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=target, logging_level=logging.ERROR, log_to_driver=False)
    try:
        task = ray.remote(max_calls=1)(_cell_task)
        results: dict[int, CellRun] = {}
        attempts: dict[int, int] = {}
        pending: dict[Any, Cell] = {}

        def submit(cell: Cell) -> None:
            attempts[cell.index] = attempts.get(cell.index, 0) + 1
            ref = task.options(**task_options(matrix, cell)).remote(
                matrix.text, lock_text, matrix.path.name, cell.index, cell.gpu
            )
            pending[ref] = cell
            if progress is not None:
                progress.update(started=1)

        nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call,unused-ignore]
        for cell in cells:
            demand = _demand(task_options(matrix, cell))
            if unplaceable(demand, nodes):
                # Never submitted: a task no node can hold would wait forever.
                wanted = ", ".join(f"{k}={v:g}" for k, v in sorted(demand.items()))
                results[cell.index] = CellRun(
                    cell.index,
                    cell.name,
                    cell.target,
                    None,
                    "refused",
                    "build.no_node",
                    f"no node of the Ray cluster at {target} has {wanted}; start one with "
                    f"--resources '{{\"{resource_name(cell.target)}\": N}}'",
                )
                continue
            submit(cell)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                cell = pending.pop(ref)
                try:
                    out = ray.get(ref)
                    run, retry = parse_cell_output(cell, int(out["rc"]), str(out["stdout"]), str(out["stderr"]))
                    run.node, run.host, run.seconds = str(out["node"]), str(out["host"]), float(out["seconds"])
                except RayError as exc:  # the worker or its node died: transient
                    run = CellRun(cell.index, cell.name, cell.target, None, "failed", "build.worker_lost")
                    run.message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    retry = True
                run.attempts = attempts[cell.index]
                again = retry and attempts[cell.index] < tries
                if progress is not None:
                    progress.update(finished=run, retried=again)
                if again:
                    submit(cell)
                else:
                    results[cell.index] = run
        return [results[c.index] for c in cells]
    finally:
        if started_here:
            ray.shutdown()
