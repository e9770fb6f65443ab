"""`make bench`: the project's benchmarks, each as a ratio against a baseline run
in the same session. Results go to bench-out/ (JSON) and are summarised on
stdout; docs/benchmarks.md records them with this command.

    python scripts/bench.py [--moto PATH] [section ...]
        sections: resolve, store, verify, ttfi, mint, fleet, build, coldstart, steady (default: all); fleet-io is fleet
        without the 8-worker cold start; fleet-cold is the 8-worker cold start alone; --moto
        names the moto_server to start (default: $TCG_MOTO_SERVER, the venv's, then PATH's)

TCG_BENCH_CLI names a prebuilt release CLI (no cargo build; for a machine without Rust, such as
the GPU machine), TCG_BENCH_OUT the folder for the JSON results (default bench-out/).
TCG_BENCH_FLEET_REPEAT sets the fleet rounds (default 9; the fetch cases run a third as many), and
TCG_BENCH_RESOLVE_REPEAT the resolve rounds (default 15; the 256 MiB cases run a third as many).
TCG_BENCH_CLI_BASE names another build of the CLI (an earlier commit): fleet-io then times its
pull and import in the same rounds, for a before/after in one run.

steady is the steady-state benchmark of CUDA-graph replay (issue 32), scripts/cuda_e2e.py's
graphs bench and its goals' ratios, when torch sees a CUDA device; the Rust rows run the serve
example named by TCG_BENCH_SERVE (default: target/release/examples/serve when it exists). On a
machine without a GPU it records "skipped: no CUDA device", which is not a result.
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
OUT = Path(os.environ.get("TCG_BENCH_OUT") or ROOT / "bench-out")
REFERENCE = ROOT / "testdata" / "reference-0.2.0" / "mlp-cpu.tar.gz"
KEY = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a"
CLI = Path(os.environ.get("TCG_BENCH_CLI") or ROOT / "target" / "release" / "torch-compiled-graphs")
CLI_BASE = os.environ.get("TCG_BENCH_CLI_BASE")


def timed(run: Callable[[], None]) -> float:
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


# Child processes run as installed code runs: with bytecode caches (a developer
# shell may set PYTHONDONTWRITEBYTECODE, which makes every import recompile).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def medians(cases: dict[str, Callable[[int], None]], repeat: int) -> dict[str, float]:
    """Median wall time of each case, interleaving the cases round by round (every other
    round in reverse order), after one untimed warm-up round (page cache, bytecode caches)."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for case in cases.values():
        case(repeat)
    for i in range(repeat):
        # Every other round in reverse order, so that no case always follows another.
        order = list(cases.items())
        if i % 2:
            order.reverse()
        for name, case in order:
            # Start every sample with no dirty pages, so that no case pays for
            # another's writeback.
            os.sync()
            samples[name].append(timed(lambda case=case, i=i: case(i)))
    return {name: statistics.median(s) for name, s in samples.items()}


def sh(*args: str | os.PathLike[str]) -> None:
    subprocess.run([os.fspath(a) for a in args], check=True, stdout=subprocess.DEVNULL, env=CHILD_ENV)


def build_cli() -> None:
    if os.environ.get("TCG_BENCH_CLI"):
        return
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
        root = str(engine.root)
        resolve_code = f"import torch_compiled_graphs as t, sys; t.Engine({root!r}).resolve({KEY!r}, sys.argv[1])"
        engine_code = f"import torch_compiled_graphs as t; t.Engine({root!r})"
        small = medians(
            {
                "python -c pass": lambda i: sh(py, "-c", "pass"),
                "python import + Engine.resolve": lambda i: sh(py, "-c", resolve_code, work / f"py-{i}"),
                # The same process stopped earlier: what the import and Engine() add.
                "python import": lambda i: sh(py, "-c", "import torch_compiled_graphs"),
                "python import + Engine()": lambda i: sh(py, "-c", engine_code),
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
            "stages_ms": hit_stages(py, root, work, repeat),
        }
        env, unpacked = big_artifact(work, 256)
        big_store = Engine(work / "big-store")
        big_store.import_artifact(KEY, env)
        big = medians(
            {
                "cp -r members": lambda i: sh("cp", "-r", unpacked, work / f"bigcp-{i}"),
                # A durable copy, as a resolve is (it fsyncs what it publishes): cp, then syncfs.
                "cp -r members + sync -f": lambda i: sh(
                    "sh", "-c", 'cp -r "$0" "$1" && sync -f "$1"', unpacked, work / f"bigcps-{i}"
                ),
                "cli resolve": lambda i: sh(CLI, "resolve", "--cas-root", big_store.root, KEY, work / f"bigcli-{i}"),
                "gzip -dc > /dev/null": lambda i: subprocess.run(f"gzip -dc {env} > /dev/null", shell=True, check=True),
            },
            max(3, repeat // 3),
        )
        for p in [*work.glob("bigcp-*"), *work.glob("bigcps-*")]:
            shutil.rmtree(p)
        results["large"] = {
            "artifact_bytes": env.stat().st_size,
            "median_s": big,
            "cli_resolve_over_cp_r": big["cli resolve"] / big["cp -r members"],
            "cli_resolve_over_cp_r_sync": big["cli resolve"] / big["cp -r members + sync -f"],
        }
    return results


HIT_STAGES_CHILD = """
import time
t0 = time.perf_counter()
import torch_compiled_graphs as t, sys
t1 = time.perf_counter()
engine = t.Engine(sys.argv[1])
t2 = time.perf_counter()
engine.resolve(sys.argv[2], sys.argv[3])
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def hit_stages(py: str, root: str, work: Path, repeat: int) -> dict[str, float]:
    """Medians (ms) of the hit path's stages timed inside fresh processes: the import, Engine()
    and the first resolve (the rest of the wall time is the interpreter's start and exit)."""
    stages: list[list[float]] = []
    for i in range(repeat):
        os.sync()
        out = subprocess.run(
            [py, "-c", HIT_STAGES_CHILD, root, KEY, str(work / f"stage-{i}")],
            check=True,
            capture_output=True,
            text=True,
            env=CHILD_ENV,
        )
        stages.append([float(x) * 1e3 for x in out.stdout.split()])
    names = ["import", "Engine()", "resolve"]
    return {n: statistics.median(s[k] for s in stages) for k, n in enumerate(names)}


TTFI_CHILD = """
import os, sys, time
t0 = time.perf_counter()
mode, work = sys.argv[1], sys.argv[2]
if mode == "resolve-native":
    import numpy as np
    from torch_compiled_graphs import Engine
    graph = Engine(os.path.join(work, "store")).resolve(sys.argv[3], os.path.join(work, "r", str(os.getpid())))
    run = graph.load_native(os.path.join(work, "weights.safetensors"))
    x = np.random.default_rng(0).standard_normal((3, {seq}, {dim}), dtype=np.float32)
    y = np.asarray(run(x))
    assert "torch" not in sys.modules
    print(f"{{time.perf_counter() - t0:.4f}}")
    sys.exit(0)
sys.path.insert(0, {scripts!r})
import torch
from safetensors.torch import load_file
import demo
cfg = demo.SIZES["default"]
x = torch.randn(3, cfg["seq"], cfg["dim"])
weights = load_file(os.path.join(work, "weights.safetensors"))
if mode in ("compile-cold", "compile-warm"):
    model = demo.build_model(cfg["dim"], cfg["heads"], cfg["hidden"])
    model.load_state_dict(weights)
    run = torch.compile(model, dynamic=True)
elif mode == "aoti-load-package":
    run = torch._inductor.aoti_load_package(os.path.join(work, "plain.pt2"))
else:
    from torch_compiled_graphs import Engine
    graph = Engine(os.path.join(work, "store")).resolve(sys.argv[3], os.path.join(work, "r", str(os.getpid())))
    run = graph.load(weights)
with torch.no_grad():
    y = run(x)
print(f"{{time.perf_counter() - t0:.4f}}")
"""


def bench_ttfi(repeat: int) -> dict[str, object]:
    """Time to first inference in a fresh process, four ways, for the demo's default model."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "scripts"))
    import demo

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="tcg-ttfi-") as tmp:
        work = Path(tmp)
        minted = demo.mint(work / "demo", "default")
        key = str(minted["key"])
        shutil.move(str(work / "demo" / "store"), work / "store")
        shutil.copy(work / "demo" / "demo-default.weights.safetensors", work / "weights.safetensors")
        cfg = demo.SIZES["default"]
        model = demo.build_model(cfg["dim"], cfg["heads"], cfg["hidden"])
        from safetensors.torch import load_file

        model.load_state_dict(load_file(work / "weights.safetensors"))  # type: ignore[attr-defined]
        example = torch.randn(4, cfg["seq"], cfg["dim"])
        batch = torch.export.Dim("batch", min=1, max=16)
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))  # type: ignore[arg-type]
        torch._inductor.aoti_compile_and_package(program, package_path=str(work / "plain.pt2"))
        del save_file
        child = TTFI_CHILD.format(scripts=str(ROOT / "scripts"), seq=cfg["seq"], dim=cfg["dim"])
        warm_cache = work / "inductor-warm"

        def run(mode: str, cache: Path) -> float:
            env = {**CHILD_ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-c", child, mode, str(work), key], check=True, env=env, stdout=subprocess.DEVNULL
            )
            return time.perf_counter() - t

        run("compile-warm", warm_cache)  # warm the inductor cache once
        samples: dict[str, list[float]] = {
            m: [] for m in ("compile-cold", "compile-warm", "aoti-load-package", "resolve-load", "resolve-native")
        }
        for i in range(repeat):
            samples["compile-cold"].append(run("compile-cold", work / f"inductor-cold-{i}"))
            samples["compile-warm"].append(run("compile-warm", warm_cache))
            samples["aoti-load-package"].append(run("aoti-load-package", work / "inductor-aoti"))
            samples["resolve-load"].append(run("resolve-load", work / "inductor-ours"))
            samples["resolve-native"].append(run("resolve-native", work / "inductor-ours"))
        med = {m: statistics.median(v) for m, v in samples.items()}
        bare = medians(
            {
                "python -c 'import torch'": lambda i: sh(sys.executable, "-c", "import torch"),
                "python -c 'import numpy'": lambda i: sh(sys.executable, "-c", "import numpy"),
            },
            repeat,
        )
        # (d) is the native path; the torch-based load is reported beside it.
        ours = med["resolve-native"]
        results = {
            "median_s": {**med, **bare},
            "samples_s": samples,
            "compile_warm_over_ours": med["compile-warm"] / ours,
            "aoti_load_package_over_ours": med["aoti-load-package"] / ours,
            "compile_cold_over_ours": med["compile-cold"] / ours,
            "compile_warm_over_torch_load": med["compile-warm"] / med["resolve-load"],
            "aoti_load_package_over_torch_load": med["aoti-load-package"] / med["resolve-load"],
        }
        write_ttfi_plot(med, bare["python -c 'import torch'"])
    return results


def write_ttfi_plot(med: dict[str, float], import_torch: float) -> None:
    """A horizontal bar chart (SVG, no plotting library needed) of docs/ttfi.svg."""
    labels = [
        ("compile-cold", "torch.compile, cold"),
        ("compile-warm", "torch.compile, warm inductor cache"),
        ("aoti-load-package", "aoti_load_package(.pt2)"),
        ("resolve-load", "resolve + load (torch) + first call"),
        ("resolve-native", "resolve + load_native + first call"),
    ]
    top = max(med.values())
    width, bar_h, left = 760, 26, 300
    rows = []
    for i, (k, label) in enumerate(labels):
        y = 40 + i * (bar_h + 14)
        w = (width - left - 90) * med[k] / top
        rows.append(f'<text x="{left - 10}" y="{y + 18}" text-anchor="end">{label}</text>')
        rows.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#4a78b5"/>')
        rows.append(f'<text x="{left + w + 6:.1f}" y="{y + 18}">{med[k]:.2f} s</text>')
    xt = left + (width - left - 90) * import_torch / top
    rows.append(
        f'<line x1="{xt:.1f}" y1="30" x2="{xt:.1f}" y2="{40 + len(labels) * (bar_h + 14)}" '
        'stroke="#c33" stroke-dasharray="4"/>'
    )
    rows.append(f'<text x="{xt + 4:.1f}" y="24" fill="#c33">python -c "import torch": {import_torch:.2f} s</text>')
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{60 + len(labels) * (bar_h + 14)}" '
        'font-family="sans-serif" font-size="13">'
        '<rect width="100%" height="100%" fill="white"/>' + "".join(rows) + "</svg>\n"
    )
    (ROOT / "docs" / "ttfi.svg").write_text(svg)


MINT_CHILD = """
import json, sys, time
sys.path.insert(0, {scripts!r})
import torch
import torch_compiled_graphs.compile as policy
import demo
spent = []
real = policy.compile_package
def timed_compile(*args, **kwargs):
    t = time.perf_counter()
    try:
        return real(*args, **kwargs)
    finally:
        spent.append(time.perf_counter() - t)
policy.compile_package = timed_compile
from pathlib import Path
result = demo.mint(Path(sys.argv[1]), sys.argv[2])
assert result["outcome"] == "minted", result
print(json.dumps({{"ensure_s": result["ensure_s"], "compile_s": sum(spent)}}))
"""


def bench_mint(repeat: int) -> dict[str, object]:
    """Mint overhead beyond the compile (declare, pack, verify, store, resolve), cold inductor cache."""
    results: dict[str, object] = {}
    child = MINT_CHILD.format(scripts=str(ROOT / "scripts"))
    for size in ("small", "default"):
        runs = []
        for _i in range(repeat):
            with tempfile.TemporaryDirectory(prefix="tcg-mint-") as tmp:
                env = {**CHILD_ENV, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
                out = subprocess.run(
                    [sys.executable, "-c", child, os.path.join(tmp, "demo"), size],
                    check=True,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        ensure = statistics.median(r["ensure_s"] for r in runs)
        compile_s = statistics.median(r["compile_s"] for r in runs)
        overheads = [(r["ensure_s"] - r["compile_s"]) / r["compile_s"] for r in runs]
        results[size] = {
            "median_ensure_s": ensure,
            "median_compile_s": compile_s,
            "overhead_fraction_of_compile": statistics.median(overheads),
            "runs": runs,
        }
    return results


def bench_fleet(repeat: int, cold_start: bool = True) -> dict[str, object]:
    """The fleet tier against moto on loopback: fetch of a 256 MiB artifact vs a raw GET of
    the same bytes; a local hit with a remote configured vs without; 8 workers' cold start
    vs one compile."""
    sys.path.insert(0, str(ROOT))
    import boto3
    from tests.fleet_support import moto_server

    from torch_compiled_graphs import Engine

    build_cli()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="tcg-bench-fleet-") as tmp, moto_server() as moto:
        work = Path(tmp)
        env = {**CHILD_ENV, **moto.env()}
        os.environ.update(moto.env())
        url = f"s3://{moto.create_bucket()}/bench"
        bucket = url[len("s3://") :].split("/")[0]
        envelope, _ = big_artifact(work, 256)
        a = Engine(work / "a", remote="")
        a.import_artifact(KEY, envelope)
        subprocess.run([CLI, "push", "--cas-root", a.root, "--remote", url, KEY], check=True, env=env)
        s3 = boto3.client(
            "s3",
            endpoint_url=moto.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        chunk_keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="bench/tcg/v1/chunks/")["Contents"]]

        def raw_get() -> None:
            # In this process (boto3 already imported): the GETs alone, no interpreter start.
            for k in chunk_keys:
                body = s3.get_object(Bucket=bucket, Key=k)["Body"]
                while body.read(1 << 20):
                    pass

        def run(*args: object) -> None:
            subprocess.run([os.fspath(x) for x in args], check=True, env=env, stdout=subprocess.DEVNULL)

        cases: dict[str, Callable[[int], None]] = {
            "raw GET of the chunks (boto3, streamed to nothing)": lambda i: raw_get(),
            "pull (fetch + full verification + local store)": lambda i: run(
                CLI, "pull", "--cas-root", work / f"pull-{i}", "--remote", url, KEY
            ),
            # The same, storing the admitted copy too (its members, uncompressed, durable).
            "pull --admitted-copy": lambda i: run(
                CLI, "pull", "--admitted-copy", "--cas-root", work / f"apull-{i}", "--remote", url, KEY
            ),
            # What the pull's parts cost without the network: the envelope's full
            # verification alone, and an import of the same file into a fresh store.
            "verify of the envelope file (no store)": lambda i: run(CLI, "verify", envelope),
            "import of the envelope file into a fresh store (no network)": lambda i: run(
                CLI, "import", "--cas-root", work / f"imp-{i}", KEY, envelope
            ),
        }
        if CLI_BASE:
            cases["pull, base CLI"] = lambda i: run(
                CLI_BASE, "pull", "--cas-root", work / f"bpull-{i}", "--remote", url, KEY
            )
            cases["import, base CLI"] = lambda i: run(
                CLI_BASE, "import", "--cas-root", work / f"bimp-{i}", KEY, envelope
            )
        fetch = medians(cases, max(3, repeat // 3))
        for prefix in ("pull", "apull", "imp", "bpull", "bimp"):
            for p in work.glob(f"{prefix}-*"):
                shutil.rmtree(p)
        results["fetch_256mib"] = {
            "artifact_bytes": envelope.stat().st_size,
            "chunks": len(chunk_keys),
            "median_s": fetch,
            "pull_over_raw_get": fetch["pull (fetch + full verification + local store)"]
            / fetch["raw GET of the chunks (boto3, streamed to nothing)"],
            "pull_admitted_copy_over_raw_get": fetch["pull --admitted-copy"]
            / fetch["raw GET of the chunks (boto3, streamed to nothing)"],
        }
        small = Engine(work / "small", remote="")
        small.import_artifact(KEY, REFERENCE)
        py = sys.executable
        code = (
            "import torch_compiled_graphs as t, sys; "
            "t.Engine(sys.argv[1], remote=sys.argv[2]).resolve({k!r}, sys.argv[3])"
        )
        hit = medians(
            {
                "resolve, no remote": lambda i: run(py, "-c", code.format(k=KEY), small.root, "", work / f"h0-{i}"),
                "resolve, remote configured": lambda i: run(
                    py, "-c", code.format(k=KEY), small.root, url, work / f"h1-{i}"
                ),
            },
            repeat,
        )
        # The same resolves in this process (no interpreter start, whose noise dwarfs a
        # hit's): the engines are made once, each sample is one resolve into a fresh directory.
        engines = {"no remote": Engine(small.root, remote=""), "remote configured": Engine(small.root, remote=url)}
        in_process = medians(
            {
                f"resolve in process, {name}": lambda i, name=name, e=e: e.resolve(KEY, work / f"ip-{name[0]}-{i}")
                for name, e in engines.items()
            },
            repeat * 10,
        )
        results["local_hit"] = {
            "median_s": {**hit, **in_process},
            "remote_over_none": hit["resolve, remote configured"] / hit["resolve, no remote"],
            "remote_over_none_in_process": in_process["resolve in process, remote configured"]
            / in_process["resolve in process, no remote"],
        }
        if cold_start:
            results["cold_start"] = bench_fleet_cold_start(work, moto, env)
    return results


def bench_fleet_cold_only() -> dict[str, object]:
    """The 8-worker cold start alone, on its own moto server."""
    sys.path.insert(0, str(ROOT))
    from tests.fleet_support import moto_server

    build_cli()
    with tempfile.TemporaryDirectory(prefix="tcg-bench-cold-") as tmp, moto_server() as moto:
        env = {**CHILD_ENV, **moto.env()}
        return bench_fleet_cold_start(Path(tmp), moto, env)


def bench_fleet_cold_start(work: Path, moto: object, env: dict[str, str]) -> dict[str, object]:
    """Wall time from a common start signal until every worker has its graph: one worker on
    a fresh bucket (one compile), then 8 workers with 8 stores on another fresh bucket; and a
    fetch of the same artifact by a fresh store."""
    from tests.test_fleet import WORKER

    script = work / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT)))

    def fleet(n: int, url: str, tag: str) -> tuple[float, list[dict[str, object]]]:
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(work / f"{tag}-s{i}"), url, str(work / f"{tag}-g{i}")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(n)
        ]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        t = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
        return time.perf_counter() - t, outs

    one, _ = fleet(1, f"s3://{moto.create_bucket()}/cold", "one")  # type: ignore[attr-defined]
    url8 = f"s3://{moto.create_bucket()}/cold"  # type: ignore[attr-defined]
    eight, outs = fleet(8, url8, "eight")
    key = str(outs[0]["key"])
    fetches = []
    for i in range(3):
        t = time.perf_counter()
        subprocess.run(
            [CLI, "pull", "--cas-root", work / f"cold-pull-{i}", "--remote", url8, key],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        fetches.append(time.perf_counter() - t)
    fetch = statistics.median(fetches)
    # The same comparison inside the 8-worker run, which no cross-run noise
    # touches: the last worker's time from the start signal against the
    # leader's (its compile and publication) + 2x a fetch.
    leader = max(float(str(o["elapsed_s"])) for o in outs if int(str(o["compiled"])))
    last = max(float(str(o["elapsed_s"])) for o in outs)
    return {
        "one_worker_s": one,
        "eight_workers_s": eight,
        "fetch_s": fetch,
        "compiles": sum(int(str(o["compiled"])) for o in outs),
        "sources": sorted(str(o["source"]) for o in outs),
        "eight_over_one_plus_two_fetches": eight / (one + 2 * fetch),
        "in_run_leader_s": leader,
        "in_run_last_worker_s": last,
        "in_run_last_over_leader_plus_two_fetches": last / (leader + 2 * fetch),
    }


def bench_steady() -> dict[str, object]:
    """Issue 32's steady-state benchmark through scripts/cuda_e2e.py's graphs bench (the
    same code, run on the package this checkout built), with its goals' ratios."""
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except ImportError:
        cuda = False
    if not cuda:
        return {"skipped": "no CUDA device"}
    import cuda_e2e

    serve = os.environ.get("TCG_BENCH_SERVE") or ROOT / "target" / "release" / "examples" / "serve"
    if Path(serve).is_file():
        cuda_e2e.SERVE_BIN.append(os.path.abspath(serve))
    graphs: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="tcg-steady-") as tmp:
        # The package as maturin develop installed it (python/ holds the built extension).
        cuda_e2e.graphs_bench(ROOT / "python", Path(tmp), graphs, lambda: None)
    graphs["ratios"] = cuda_e2e.graphs_ratios(graphs)
    if not cuda_e2e.SERVE_BIN:
        graphs["rust_serve"] = "skipped: no serve binary (TCG_BENCH_SERVE or target/release/examples/serve)"
    return graphs


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
    args = sys.argv[1:]
    if "--moto" in args:
        # The moto_server to start (a machine whose moto lives outside the venv); the
        # tests read the same variable.
        i = args.index("--moto")
        os.environ["TCG_MOTO_SERVER"] = args[i + 1]
        del args[i : i + 2]
    sections = args or ["resolve", "store", "verify", "ttfi", "mint", "fleet", "build", "coldstart", "steady"]
    OUT.mkdir(exist_ok=True)
    results: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    if "resolve" in sections:
        results["resolve"] = bench_resolve(repeat=int(os.environ.get("TCG_BENCH_RESOLVE_REPEAT") or 15))
    if "store" in sections:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "bench_store.sh"), "1024"],
            check=True,
            capture_output=True,
            text=True,
            env={**CHILD_ENV, "REPS": "3"},
        )
        results["store"] = {"stdout": out.stdout}
    if "verify" in sections:
        results["verify"] = run_example("tcg-core", "bench_verify")
    if "ttfi" in sections:
        results["ttfi"] = bench_ttfi(repeat=3)
    if "mint" in sections:
        results["mint"] = bench_mint(repeat=2)
    if "fleet" in sections or "fleet-io" in sections:
        repeat = int(os.environ.get("TCG_BENCH_FLEET_REPEAT") or 9)
        results["fleet"] = bench_fleet(repeat=repeat, cold_start="fleet" in sections)
    if "fleet-cold" in sections:
        results["fleet_cold_start"] = bench_fleet_cold_only()
    if "build" in sections:
        from bench_build import bench_build

        results["build"] = bench_build(CHILD_ENV)
    if "coldstart" in sections:
        # On this machine's CPU: the floor is the multi-threaded read (the GPU run,
        # with its CUDA context and copies, is scripts/cuda_e2e.py --coldstart).
        import coldstart

        sh("cargo", "build", "--release", "--quiet", "-p", "tcg-run", "--example", "serve")
        serve = ROOT / "target" / "release" / "examples" / "serve"
        with tempfile.TemporaryDirectory(prefix="tcg-coldstart-") as tmp:
            argv = ["--out", str(OUT), "--device", "cpu", "--sizes", "small", "--repeat", "3"]
            argv += ["--serve-bin", str(serve), "--work", tmp]
            results["coldstart"] = coldstart.main(argv)
    if "steady" in sections:
        results["steady"] = bench_steady()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (OUT / f"bench-{stamp}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
