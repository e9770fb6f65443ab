"""`make bench`: the project's benchmarks, each as a ratio against a baseline run
in the same session. Results go to bench-out/ (JSON) and are summarised on
stdout; docs/benchmarks.md records them with this command.

    python scripts/bench.py [section ...]     sections: resolve, store, verify (default: all)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-out"
REFERENCE = ROOT / "testdata" / "reference-0.2.0" / "mlp-cpu.tar.gz"
KEY = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a"
CLI = ROOT / "target" / "release" / "torch-compiled-graphs"


def timed(run: Callable[[], None]) -> float:
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def medians(cases: dict[str, Callable[[int], None]], repeat: int) -> dict[str, float]:
    """Median wall time of each case, interleaving the cases round by round."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeat):
        for name, case in cases.items():
            samples[name].append(timed(lambda case=case, i=i: case(i)))
    return {name: statistics.median(s) for name, s in samples.items()}


def sh(*args: str | os.PathLike[str]) -> None:
    subprocess.run([os.fspath(a) for a in args], check=True, stdout=subprocess.DEVNULL)


def build_cli() -> None:
    sh("cargo", "build", "--release", "--quiet", "-p", "tcg-cli")


def big_artifact(work: Path, mib: int) -> tuple[Path, Path]:
    """The reference package plus `mib` MiB of incompressible bytes in its entry, packed anew."""
    from torch_compiled_graphs import artifact

    members = work / "members"
    members.mkdir()
    with tarfile.open(REFERENCE) as tar:
        tar.extractall(members, filter="data")
    pkg = work / "big.pt2"
    shutil.copy(members / "model.pt2", pkg)
    with zipfile.ZipFile(pkg, "a", compression=zipfile.ZIP_STORED) as z:
        with z.open("model/data/aotinductor/model/mlp/incompressible.bin", "w", force_zip64=True) as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
    metadata = artifact.read_metadata(REFERENCE)
    env = work / "big.tar.gz"
    artifact.pack(pkg, metadata, env)
    unpacked = work / "big-members"
    artifact.unpack(env, unpacked)
    return env, unpacked


def bench_resolve(repeat: int) -> dict[str, object]:
    from torch_compiled_graphs import Engine

    build_cli()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="tcg-bench-") as tmp:
        work = Path(tmp)
        engine = Engine(work / "store")
        engine.import_artifact(KEY, REFERENCE)
        members = work / "ref-members"
        engine.resolve(KEY, members)
        py = sys.executable
        resolve_code = (
            f"import torch_compiled_graphs as t, sys; t.Engine({str(engine.root)!r}).resolve({KEY!r}, sys.argv[1])"
        )
        small = medians(
            {
                "python -c pass": lambda i: sh(py, "-c", "pass"),
                "python import + Engine.resolve": lambda i: sh(py, "-c", resolve_code, work / f"py-{i}"),
                "cp -r members": lambda i: sh("cp", "-r", members, work / f"cp-{i}"),
                "cli resolve": lambda i: sh(CLI, "resolve", "--cas-root", engine.root, KEY, work / f"cli-{i}"),
            },
            repeat,
        )
        results["small"] = {
            "artifact_bytes": REFERENCE.stat().st_size,
            "median_s": small,
            "import_plus_resolve_over_bare_python": small["python import + Engine.resolve"] / small["python -c pass"],
            "cli_resolve_over_cp_r": small["cli resolve"] / small["cp -r members"],
        }
        env, unpacked = big_artifact(work, 256)
        big_store = Engine(work / "big-store")
        big_store.import_artifact(KEY, env)
        big = medians(
            {
                "cp -r members": lambda i: sh("cp", "-r", unpacked, work / f"bigcp-{i}"),
                "cli resolve": lambda i: sh(CLI, "resolve", "--cas-root", big_store.root, KEY, work / f"bigcli-{i}"),
                "gzip -dc > /dev/null": lambda i: subprocess.run(f"gzip -dc {env} > /dev/null", shell=True, check=True),
            },
            max(3, repeat // 3),
        )
        for p in work.glob("bigcp-*"):
            shutil.rmtree(p)
        results["large"] = {
            "artifact_bytes": env.stat().st_size,
            "median_s": big,
            "cli_resolve_over_cp_r": big["cli resolve"] / big["cp -r members"],
        }
    return results


def run_example(package: str, example: str) -> dict[str, object]:
    out = subprocess.run(
        ["cargo", "run", "--release", "--quiet", "-p", package, "--example", example],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return {"stdout": out.stdout}


def main() -> None:
    sections = sys.argv[1:] or ["resolve", "store", "verify"]
    OUT.mkdir(exist_ok=True)
    results: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    if "resolve" in sections:
        results["resolve"] = bench_resolve(repeat=15)
    if "store" in sections:
        results["store"] = run_example("tcg-cas", "bench_store")
    if "verify" in sections:
        results["verify"] = run_example("tcg-core", "bench_verify")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (OUT / f"bench-{stamp}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
