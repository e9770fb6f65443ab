"""The Python half of the command line: ``toolchain record``, ``build-cell`` and ``build``.

These need torch (or import user recipes), so the console script routes them here before
it forwards anything else to the native CLI. Exit codes follow the CLI's (0 success, 1 a
negative result, 2 usage); ``build-cell`` adds 3 (deterministic failure) and 75 (transient).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

from ..errors import CompiledGraphError
from .errors import EXIT_DETERMINISTIC, EXIT_TRANSIENT, EXIT_USAGE, BuildError

__all__ = ["COMMANDS", "main"]

#: The subcommands implemented here.
COMMANDS = ("build", "build-cell", "toolchain")

_BUILD_HELP = """\
Plan a build matrix (which cells are present, which need a mint, which machine each needs),
run the cells that need work through an executor, and report each cell's key, outcome
(present, minted, refused + code, failed + code), where it ran and how long it took.
A second run builds nothing; an interrupted run resumes (the remote is the state).
Exit: 0 every cell present or minted, 1 a cell refused or failed, 2 usage. See docs/build.md."""

_CELL_HELP = f"""\
Run one cell of a build matrix in this process: declare it, derive its key with the locked
toolchain, refuse when this machine's toolchain or visible device differs, skip when the
remote has the key, else mint and publish it. Prints one JSON line.
Exit: 0 present or minted, {EXIT_DETERMINISTIC} deterministic failure (never retry),
{EXIT_TRANSIENT} transient failure (retry), 2 usage. See docs/build.md."""


def _fail(exc: BaseException, hint: str | None = None) -> int:
    sys.stderr.write(f"error: {exc}\n")
    code = getattr(exc, "code", None)
    if code:
        sys.stderr.write(f"code: {code}\n")
    if hint:
        sys.stderr.write(f"hint: {hint}\n")
    return EXIT_USAGE


def _toolchain(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="torch-compiled-graphs toolchain",
        description="Record this installation's compile stack as a toolchain block (the fleet's lock file).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    record = sub.add_parser(
        "record", help="print record_toolchain()'s block as JSON: toolchain record > fleet-toolchain.json"
    )
    record.add_argument(
        "--variant",
        default="default",
        choices=("default", "shim-v1"),
        help="the graph variant whose compile policy settings_declaration names (default: default; "
        "shim-v1 is the libtorch-free variant, docs/keys.md)",
    )
    args = parser.parse_args(argv)
    from ..toolchain import record_toolchain

    try:
        block = record_toolchain(args.variant)
    except CompiledGraphError as exc:
        return _fail(exc)
    sys.stdout.write(json.dumps(block, indent=2, sort_keys=True) + "\n")
    return 0


def _cell_index(args: argparse.Namespace) -> int:
    position: int
    if args.index is not None:
        position = int(args.index)
    else:
        raw = os.environ.get("JOB_COMPLETION_INDEX")
        if raw is None or not raw.strip().isdigit():
            raise BuildError(
                "build-cell needs --index N (or JOB_COMPLETION_INDEX, as an Indexed Job sets it)", "build.index_missing"
            )
        position = int(raw)
    if args.cells is None:
        return position
    try:
        indices = [int(x) for x in args.cells.split(",") if x.strip()]
    except ValueError as exc:
        raise BuildError(
            f"--cells must be comma-separated cell indices, got {args.cells!r}", "build.index_missing"
        ) from exc
    if not 0 <= position < len(indices):
        raise BuildError(f"index {position} is outside --cells ({len(indices)} entries)", "build.index_out_of_range")
    return indices[position]


def _build_cell(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="torch-compiled-graphs build-cell",
        description=_CELL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("matrix", help="the build matrix (TOML)")
    parser.add_argument("--index", type=int, help="the cell's index (default: $JOB_COMPLETION_INDEX)")
    parser.add_argument("--cells", help="comma-separated cell indices: the index is a position in this list")
    parser.add_argument("--toolchain", help="the toolchain lock (default: the matrix's toolchain)")
    parser.add_argument("--cas-root", help="the local store (default: a private temporary one with a remote)")
    args = parser.parse_args(argv)
    from .cell import build_cell
    from .matrix import load_matrix

    try:
        matrix = load_matrix(args.matrix, toolchain=args.toolchain)
        index = _cell_index(args)
        matrix.cell(index)
    except CompiledGraphError as exc:
        return _fail(exc)
    result = build_cell(matrix, index, store=args.cas_root)
    sys.stdout.write(json.dumps(result.to_json(), sort_keys=True) + "\n")
    sys.stdout.flush()
    if result.outcome not in ("present", "minted"):
        sys.stderr.write(f"error: {result.name}: {result.message}\ncode: {result.code}\n")
    return result.exit_code


def _text_plan(rows: list[Any]) -> str:
    lines = [f"{'state':<11} {'machine':<16} {'cell':<40} key"]
    for r in rows:
        lines.append(f"{r.state:<11} {r.machine:<16} {r.name:<40} {r.key or '-'}")
    return "\n".join(lines)


def _text_report(runs: list[Any], seconds: float) -> str:
    lines = [f"{'outcome':<8} {'code':<26} {'seconds':>8} {'where':<20} {'cell':<40} key"]
    for r in runs:
        where = (r.node or r.host or "-")[:20]
        lines.append(f"{r.outcome:<8} {r.code or '-':<26} {r.seconds:>8.1f} {where:<20} {r.name:<40} {r.key or '-'}")
    counts = {k: sum(1 for r in runs if r.outcome == k) for k in ("present", "minted", "refused", "failed")}
    lines.append(", ".join(f"{v} {k}" for k, v in counts.items()) + f" in {seconds:.1f} s")
    return "\n".join(lines)


def report_json(matrix: Any, executor: str, runs: list[Any], seconds: float) -> dict[str, Any]:
    """The stable ``--json`` report of ``build``."""
    counts = {k: sum(1 for r in runs if r.outcome == k) for k in ("present", "minted", "refused", "failed")}
    return {
        "matrix": str(matrix.path),
        "executor": executor,
        "remote": matrix.remote,
        "cells": [r.to_json() for r in runs],
        "summary": {**counts, "cells": len(runs), "seconds": round(seconds, 3)},
    }


def _build(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="torch-compiled-graphs build",
        description=_BUILD_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("matrix", help="the build matrix (TOML)")
    parser.add_argument("--executor", choices=("local", "ray", "k8s"), default="local", help="default: local")
    parser.add_argument("--dry-run", action="store_true", help="plan only (k8s: print the manifest)")
    parser.add_argument("--json", action="store_true", help="print the stable JSON report (no progress)")
    parser.add_argument("--parallelism", type=int, help="local: cell processes at once (default: CPU count)")
    parser.add_argument("--retries", type=int, help="retries of a transient cell (default: 2)")
    parser.add_argument("--ray-address", help="ray: the cluster (default: [ray] address, else $RAY_ADDRESS)")
    parser.add_argument("--toolchain", help="the toolchain lock (default: the matrix's toolchain)")
    parser.add_argument("--kubectl", default="kubectl", help="k8s: the kubectl to run (default: kubectl)")
    args = parser.parse_args(argv)
    from .matrix import load_matrix
    from .run import CellRun, Progress, plan

    started = time.monotonic()
    try:
        matrix = load_matrix(args.matrix, toolchain=args.toolchain)
        matrix.lock()
        rows = plan(matrix)
    except CompiledGraphError as exc:
        return _fail(exc)
    needing = [matrix.cells[r.index] for r in rows if r.state != "present"]
    if args.executor == "k8s":
        from .k8s import apply, render

        try:
            manifest = render(matrix, needing)
            if args.dry_run:
                sys.stdout.write(json.dumps(manifest, indent=2) + "\n")
                return 0
            out = apply(manifest, args.kubectl) if manifest["items"] else ""
        except CompiledGraphError as exc:
            return _fail(exc)
        if args.json:
            jobs = [i["metadata"]["name"] for i in manifest["items"] if i["kind"] == "Job"]
            payload = {"plan": [r.to_json() for r in rows], "submitted": jobs}
            sys.stdout.write(json.dumps(payload, sort_keys=True) + "\n")
        else:
            sys.stdout.write(_text_plan(rows) + "\n" + out)
        return 0
    if args.dry_run:
        if args.json:
            sys.stdout.write(json.dumps({"plan": [r.to_json() for r in rows]}, sort_keys=True) + "\n")
        else:
            sys.stdout.write(_text_plan(rows) + "\n")
        return 0
    progress = Progress(len(needing), enabled=not args.json and sys.stderr.isatty() and bool(needing))
    try:
        if args.executor == "ray":
            from .ray_executor import run_ray

            ran = run_ray(matrix, needing, address=args.ray_address, retries=args.retries, progress=progress)
        else:
            from .run import run_local

            ran = run_local(matrix, needing, parallelism=args.parallelism, retries=args.retries, progress=progress)
    except CompiledGraphError as exc:
        progress.close()
        return _fail(exc)
    progress.close()
    by_index = {r.index: r for r in ran}
    host = socket.gethostname()
    runs: list[CellRun] = []
    for r in rows:
        if r.index in by_index:
            run = by_index[r.index]
            # A cell refused before its step derived the key (toolchain, device) or whose
            # process died still has the key the plan derived for it.
            if run.key is None:
                run.key = r.key
            runs.append(run)
        else:
            runs.append(CellRun(r.index, r.name, r.target, r.key, "present", host=host, node="plan", signed=r.signed))
    seconds = time.monotonic() - started
    if args.json:
        sys.stdout.write(json.dumps(report_json(matrix, args.executor, runs, seconds), sort_keys=True) + "\n")
    else:
        sys.stdout.write(_text_report(runs, seconds) + "\n")
    return 0 if all(r.outcome in ("present", "minted") for r in runs) else 1


def main(argv: list[str]) -> int:
    """Run ``argv`` (without the program name), whose first element is one of :data:`COMMANDS`."""
    command, rest = argv[0], argv[1:]
    if command == "toolchain":
        return _toolchain(rest)
    if command == "build-cell":
        return _build_cell(rest)
    return _build(rest)
