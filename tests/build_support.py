"""Helpers of the build-farm tests: matrix files, the cell command, a real local Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fleet_support import free_port

ROOT = Path(__file__).resolve().parent.parent


def record_lock(path: Path) -> dict[str, str]:
    """``torch-compiled-graphs toolchain record > path`` through the console script's module."""
    out = run_cli("toolchain", "record")
    assert out.returncode == 0, out.stderr
    path.write_text(out.stdout)
    block: dict[str, str] = json.loads(out.stdout)
    return block


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m torch_compiled_graphs ARGS`` from the repository root (recipes import as ``tests.*``)."""
    return subprocess.run(
        [sys.executable, "-m", "torch_compiled_graphs", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=timeout,
    )


def one_json_line(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    row: dict[str, Any] = json.loads(lines[0])
    return row


def write_matrix(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


@dataclass
class RayCluster:
    address: str
    head_node: str
    gpu_node: str
    processes: list[subprocess.Popen[bytes]]
    temp_dir: str


def _node_ids(python: str, address: str) -> dict[str, dict[str, float]]:
    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False);"
        "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    nodes: dict[str, dict[str, float]] = json.loads(out.stdout.strip().splitlines()[-1])
    return nodes


def _stop(proc: subprocess.Popen[bytes], temp_dir: str) -> None:
    """End one ``ray start --block`` we started, by its pid; it stops the node's processes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    # A node process that outlived its parent still names our private temp dir: end it by pid.
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if temp_dir.encode() in cmdline:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


@contextmanager
def ray_cluster(env: dict[str, str]) -> Iterator[RayCluster]:
    """A head node carrying ``tcg-target-cpu`` (2 CPUs) and a second node carrying
    ``tcg-target-sm_90`` (1 CPU, one GPU claimed, none there) on 127.0.0.1; both stopped
    however the test ends."""
    ray = str(Path(sys.executable).parent / "ray")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="tcgray", dir="/tmp")
    common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    node_env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **env}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes.append(
            subprocess.Popen(
                [
                    ray,
                    "start",
                    "--head",
                    "--port",
                    str(port),
                    "--num-cpus",
                    "2",
                    "--num-gpus",
                    "0",
                    "--resources",
                    json.dumps({"tcg-target-cpu": 2}),
                    "--include-dashboard=false",
                    "--temp-dir",
                    temp_dir,
                    *common,
                ],
                env=node_env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        nodes: dict[str, dict[str, float]] = {}
        while time.monotonic() < deadline:
            try:
                nodes = _node_ids(sys.executable, address)
                if nodes:
                    break
            except subprocess.SubprocessError:
                time.sleep(1)
        assert len(nodes) == 1, nodes
        (head,) = nodes
        processes.append(
            subprocess.Popen(
                # It claims one GPU that is not there: its sm_90 cell is placed here and refused
                # by the cell step, which checks the device it really sees.
                [
                    ray,
                    "start",
                    "--address",
                    address,
                    "--num-cpus",
                    "1",
                    "--num-gpus",
                    "1",
                    "--resources",
                    json.dumps({"tcg-target-sm_90": 1}),
                    *common,
                ],
                env=node_env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        while time.monotonic() < deadline:
            nodes = _node_ids(sys.executable, address)
            if len(nodes) == 2:
                break
            time.sleep(1)
        assert len(nodes) == 2, nodes
        (gpu,) = (n for n in nodes if n != head)
        assert "tcg-target-sm_90" in nodes[gpu] and "tcg-target-sm_90" not in nodes[head], nodes
        yield RayCluster(address, head, gpu, processes, temp_dir)
    finally:
        for proc in reversed(processes):
            _stop(proc, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
