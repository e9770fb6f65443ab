"""The build farm on a GPU machine: a matrix with one ``sm_NN`` cell and one ``cpu`` cell
through the Ray executor on one local node, and the report.

    python3 scripts/build_farm_gpu.py --wheel dist/torch_compiled_graphs-*.whl --out OUT
        [--wheelhouse WHEELS] [--remote s3://bucket/prefix] [--target sm_90]

1. Installs the wheel (no dependencies, no index) into a private directory, and ``ray``
   from ``--wheelhouse`` (a folder of wheels, ``pip download``-ed elsewhere: no index is
   asked) when ray is not importable already.
2. Writes a lock (``toolchain record``) and a matrix of two cells of a small MLP: one for
   ``--target`` (default: this GPU's ``sm_NN``) and one for ``cpu``.
3. The remote: ``--remote`` when given (credentials from the ``AWS_*`` variables); else a
   moto server started here when moto is importable; else no remote (a local store).
4. The executor: ``ray`` (a head node started here with ``--block``, carrying one GPU and the
   resources ``tcg-target-cpu`` and ``tcg-target-<target>``, stopped by its pid afterwards)
   when ray is importable; else ``local``.
5. Runs ``build --json`` twice (the second must build nothing), writes ``OUT/build-farm.json``
   and prints it, with ``executor`` and ``remote_kind`` saying what ran. Exit 1 unless the
   first run minted both cells and the second found both present.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RECIPE = """
import torch
from torch import nn
from torch_compiled_graphs import GraphClassSpec


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.l1 = nn.Linear(64, width)
        self.l2 = nn.Linear(width, 16)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def mlp(width, target):
    device = "cuda" if target.startswith("sm_") else "cpu"
    torch.manual_seed(0)
    model = Net(width).eval().to(device)
    program = torch.export.export(model, (torch.randn(4, 64, device=device),))
    return GraphClassSpec(f"build-farm-gpu/mlp-w{width}", target, program)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", required=True, help="the abi3 wheel (a glob is expanded)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wheelhouse", help="a folder of wheels with ray and its dependencies")
    parser.add_argument("--remote", help="an s3:// remote (default: a moto server if moto is importable)")
    parser.add_argument("--target", help="the GPU cell's target (default: this GPU's sm_NN)")
    parser.add_argument("--cxx", default="/usr/bin/g++", help="the C++ compiler for inductor (CXX)")
    args = parser.parse_args()
    wheels = sorted(glob.glob(args.wheel))
    if len(wheels) != 1:
        raise SystemExit(f"--wheel must name exactly one wheel, found {wheels}")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    target = args.target
    if target is None:
        major, minor = torch.cuda.get_device_capability()
        target = f"sm_{major}{minor}"
    report: dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__, "target": target}
    processes: list[subprocess.Popen[bytes]] = []
    runs: list[dict[str, object]] = []
    ray_temp: str | None = None
    with tempfile.TemporaryDirectory(prefix="tcg-farm-") as tmp:
        work = Path(tmp)
        site = work / "site"
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--target", str(site)]
        subprocess.run([*pip, "--no-deps", wheels[0]], check=True)
        has_ray = importlib.util.find_spec("ray") is not None
        if not has_ray and args.wheelhouse:
            subprocess.run([*pip, "--find-links", args.wheelhouse, "ray"], check=True)
            has_ray = True
        (work / "recipes").mkdir()
        (work / "recipes" / "farm_recipes.py").write_text(RECIPE)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        # Carried wheels installed beside this script (ray on a machine without it) stay importable.
        extra = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(site), str(work / "recipes"), extra] if p)
        env["XDG_CACHE_HOME"] = str(work / "cache")
        env["CXX"] = args.cxx
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        try:
            remote, remote_kind = args.remote, "given"
            if remote is None and importlib.util.find_spec("moto") is not None:
                port = free_port()
                moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
                processes.append(
                    subprocess.Popen(
                        [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                    )
                )
                wait_port(port)
                import http.client

                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("PUT", "/farm")
                conn.getresponse().read()
                env.update(
                    {
                        "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_REGION": "us-east-1",
                        "AWS_ALLOW_HTTP": "true",
                        "AWS_ENDPOINT": f"http://127.0.0.1:{port}",
                    }
                )
                remote, remote_kind = "s3://farm/fleet", "moto"
            elif remote is None:
                remote_kind = "none (local store)"
            report["remote_kind"] = remote_kind
            lock = subprocess.run(
                [sys.executable, "-m", "torch_compiled_graphs", "toolchain", "record"],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            ).stdout
            (work / "lock.json").write_text(lock)
            lines = [f'toolchain = "{work / "lock.json"}"']
            lines.append(f'remote = "{remote}"' if remote else f'store = "{work / "store"}"')
            lines += [
                "[[recipes]]",
                'callable = "farm_recipes:mlp"',
                f'targets = ["{target}", "cpu"]',
                "params = {width = 256}",
            ]
            (work / "matrix.toml").write_text("\n".join(lines) + "\n")
            executor = "ray" if has_ray else "local"
            report["executor"] = executor
            build = [sys.executable, "-m", "torch_compiled_graphs", "build", str(work / "matrix.toml"), "--json"]
            if has_ray:
                port = free_port()
                resources = json.dumps({"tcg-target-cpu": 1, f"tcg-target-{target}": 1})
                ray_temp = tempfile.mkdtemp(prefix="tcgray", dir="/tmp")
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            "import sys; from ray.scripts.scripts import main; sys.exit(main())",
                            "start",
                            "--head",
                            "--block",
                            "--port",
                            str(port),
                            "--node-ip-address",
                            "127.0.0.1",
                            "--num-cpus",
                            "2",
                            "--num-gpus",
                            "1",
                            "--resources",
                            resources,
                            "--include-dashboard=false",
                            "--disable-usage-stats",
                            "--temp-dir",
                            ray_temp,
                        ],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                wait_port(port, timeout=120)
                time.sleep(5)
                build += ["--executor", "ray", "--ray-address", f"127.0.0.1:{port}"]
            for _ in range(2):
                proc = subprocess.run(build, capture_output=True, text=True, env=env, timeout=3600)
                row = {"returncode": proc.returncode, "stderr": proc.stderr[-3000:]}
                try:
                    row["report"] = json.loads(proc.stdout)
                except ValueError:
                    row["stdout"] = proc.stdout[-3000:]
                runs.append(row)
                print(json.dumps(row, indent=1), flush=True)
            report["runs"] = runs
        finally:
            for proc in reversed(processes):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            if ray_temp is not None:
                shutil.rmtree(ray_temp, ignore_errors=True)
    (args.out / "build-farm.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

    def outcomes(i: int) -> list[str]:
        rep = runs[i].get("report") if len(runs) > i else None
        return [str(c["outcome"]) for c in rep["cells"]] if isinstance(rep, dict) else []

    if outcomes(0) != ["minted", "minted"] or outcomes(1) != ["present", "present"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
