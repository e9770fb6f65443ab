"""The ``build`` section of ``make bench``: a matrix of 8 small CPU cells through the local
and the ray executor, against the same 8 mints run one after another by hand (one
``build-cell`` process each), and the cost of a re-run whose keys are all present.

Each phase gets a fresh bucket on one moto server and a fresh inductor cache, so that no
phase reuses another's compile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDTHS = [8, 16, 24, 32, 40, 48, 56, 64]


def _matrix(work: Path, remote: str) -> Path:
    path = work / "matrix.toml"
    path.write_text(
        f'remote = "{remote}"\ntoolchain = "{work.parent / "lock.json"}"\ntargets = ["cpu"]\n'
        f'[[recipes]]\ncallable = "tests.build_recipes:mlp"\ngrid = {{width = {WIDTHS}}}\n'
    )
    return path


def bench_build(child_env: dict[str, str]) -> dict[str, Any]:
    from tests.fleet_support import free_port, moto_server, wait_port

    parallelism = os.cpu_count() or 1
    out: dict[str, Any] = {"cells": len(WIDTHS), "parallelism": parallelism}
    with tempfile.TemporaryDirectory(prefix="tcg-bench-build-") as tmp, moto_server() as moto:
        root = Path(tmp)
        env = {**child_env, **moto.env(), "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
        cli = [sys.executable, "-m", "torch_compiled_graphs"]
        lock = subprocess.run([*cli, "toolchain", "record"], capture_output=True, text=True, env=env, check=True)
        (root / "lock.json").write_text(lock.stdout)

        def phase(name: str) -> tuple[Path, dict[str, str]]:
            work = root / name
            work.mkdir()
            remote = f"s3://{moto.create_bucket()}/fleet"
            return _matrix(work, remote), {
                **env,
                "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
                "XDG_CACHE_HOME": str(work / "cache"),
            }

        # 1. By hand: the 8 mints one after another.
        matrix, penv = phase("by-hand")
        mints = []
        for i in range(len(WIDTHS)):
            t = time.perf_counter()
            proc = subprocess.run(
                [*cli, "build-cell", str(matrix), "--index", str(i)], capture_output=True, text=True, env=penv, cwd=ROOT
            )
            mints.append(time.perf_counter() - t)
            assert proc.returncode == 0 and '"minted"' in proc.stdout, proc.stderr
        out["sum_of_mints_s"] = sum(mints)
        out["mints_s"] = mints
        ideal = sum(mints) / parallelism
        out["ideal_s"] = ideal

        def build(matrix: Path, penv: dict[str, str], *extra: str) -> tuple[float, dict[str, Any]]:
            t = time.perf_counter()
            proc = subprocess.run(
                [*cli, "build", str(matrix), "--json", *extra], capture_output=True, text=True, env=penv, cwd=ROOT
            )
            wall = time.perf_counter() - t
            assert proc.returncode == 0, proc.stderr
            report: dict[str, Any] = json.loads(proc.stdout)
            return wall, report

        # 2. The local executor.
        matrix, penv = phase("local")
        wall, report = build(matrix, penv, "--parallelism", str(parallelism))
        assert report["summary"]["minted"] == len(WIDTHS), report
        out["local_s"] = wall
        out["local_over_ideal"] = wall / ideal

        # 3. A re-run with every key present: the plan only (one export and declaration per cell).
        rerun, report = build(matrix, penv)
        assert report["summary"]["present"] == len(WIDTHS), report
        assert all(c["node"] == "plan" and c["attempts"] == 0 for c in report["cells"]), report
        out["rerun_s"] = rerun
        out["rerun_per_cell_s"] = rerun / len(WIDTHS)
        out["rerun_per_cell_over_mean_mint"] = (rerun / len(WIDTHS)) / (sum(mints) / len(mints))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, torch_compiled_graphs.build"], env=penv, check=True)
        out["rerun_python_and_torch_import_s"] = time.perf_counter() - t

        # 4. The ray executor: one local head node carrying tcg-target-cpu.
        matrix, penv = phase("ray")
        port = free_port()
        ray_temp = tempfile.mkdtemp(prefix="tcgray", dir="/tmp")
        head = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "ray"),
                "start",
                "--head",
                "--block",
                "--port",
                str(port),
                "--node-ip-address",
                "127.0.0.1",
                "--num-cpus",
                str(parallelism),
                "--num-gpus",
                "0",
                "--resources",
                json.dumps({"tcg-target-cpu": parallelism}),
                "--include-dashboard=false",
                "--disable-usage-stats",
                "--temp-dir",
                ray_temp,
            ],
            env=penv,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_port(port, timeout=120)
            time.sleep(5)
            wall, report = build(matrix, penv, "--executor", "ray", "--ray-address", f"127.0.0.1:{port}")
            assert report["summary"]["minted"] == len(WIDTHS), report
            out["ray_s"] = wall
            out["ray_over_ideal"] = wall / ideal
        finally:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(timeout=90)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait()
            shutil.rmtree(ray_temp, ignore_errors=True)
    return out
