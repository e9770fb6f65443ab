"""The CUDA end-to-end suite and benchmark, in one command, for a machine with a GPU.

    python3 scripts/cuda_e2e.py --wheel dist/torch_compiled_graphs-*.whl --out OUT [--no-bench] [--no-tests]
        [--serve-bin target/release/examples/serve]

1. Installs the wheel (no dependencies, no index) into a private directory;
   torch, safetensors and pytest come from the interpreter running this script.
2. Runs ``tests/test_cuda.py`` (mint, verification of the CUDA package, restart
   reuse without torch on the hit path, weight swap, refusals) with pytest;
   writes ``cuda-tests.xml`` (JUnit) and ``cuda-tests.log``.
3. Benchmarks a medium model, a bf16 transformer block (dim 1024, 16 heads,
   MLP 4096, sequence 256, dynamic batch), each figure in fresh processes:
   mint time (against a plain AOTInductor compile and package of the same
   program, cold caches for both), resolve time (against ``python -c pass``)
   and time to first inference of (a) the torch-free ``load_native`` on the GPU,
   (b) the torch-based ``load``, (c) ``torch.compile`` with a warm inductor
   cache and (d) ``torch._inductor.aoti_load_package``, plus the steady-state
   latency of one call of (a) and (b), and of the Rust ``serve`` example when
   ``--serve-bin`` names it (which the tests run too).
4. With ``--coldstart``, the cold-start benchmark (``scripts/coldstart.py``):
   the hardware floor (CUDA context, a multi-threaded read of the weights from
   the page cache, pinned host-to-device bandwidth) and the ways to a first
   output for a ~0.8 GB and a ~13 GB model, in fresh processes; written to
   ``OUT/coldstart.json`` (``--no-tests --no-bench`` runs it alone).
5. With ``--graphs``, the steady-state benchmark of CUDA-graph replay
   (:func:`graphs_bench`): a bf16 ``UNet2DConditionModel`` and a bf16 stack of
   transformer blocks at batch 1 and 8, eager, ``torch.compile`` (default,
   ``reduce-overhead``, and ``max-autotune`` for the block stack only: its
   autotuning of the UNet alone would take minutes), ours through ``load()``
   with and without CUDA graphs and through ``load_native``, with the first-call
   and capture costs; written to ``OUT/cuda-graphs.json`` (``--no-tests
   --no-bench --graphs`` runs it alone).
6. Writes everything to ``OUT/cuda-e2e.json`` and prints a summary.

On the device machine of this project (see docs/cuda.md), with the wheel
built here and carried as ``dist``:

    python3 scripts/cuda_e2e.py --wheel dist/*.whl --out $OUT
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from bench import CHILD_ENV  # children run as installed code runs (bytecode caches on)

ROOT = Path(__file__).resolve().parent.parent
MEDIUM = {"dim": 1024, "heads": 16, "hidden": 4096, "seq": 256, "batch": 4}

COMMON = f"""
import json, os, sys, time
t0 = time.perf_counter()
mode, work = sys.argv[1], sys.argv[2]
sys.path.insert(0, {str(ROOT / "scripts")!r})
CFG = {MEDIUM!r}
"""

MINT_CHILD = (
    COMMON
    + """
import torch
import demo
from safetensors.torch import load_file
model = demo.build_model(CFG["dim"], CFG["heads"], CFG["hidden"])
model.load_state_dict(load_file(os.path.join(work, "weights.safetensors")))
model = model.to("cuda", torch.bfloat16).eval()
x = torch.randn(CFG["batch"], CFG["seq"], CFG["dim"], device="cuda", dtype=torch.bfloat16)
batch = torch.export.Dim("batch", min=1, max=32)
program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
t1 = time.perf_counter()
if mode == "mint":
    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
    major, minor = torch.cuda.get_device_capability()
    sm = f"sm_{major}{minor}"
    spec = GraphClassSpec("bench/block-bf16", "bench", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility(sm, toolchain=toolchain).key(spec.declare())
    result = Engine(os.path.join(work, "store")).ensure(
        key, os.path.join(work, "minted"), target=sm, toolchain=toolchain, recipe=lambda: spec
    )
    out = {"key": str(key), "outcome": result.outcome.value}
else:
    torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(work, "plain.pt2"))
    out = {}
out["compile_s"] = time.perf_counter() - t1
print(json.dumps(out))
"""
)

TTFI_CHILD = (
    COMMON
    + """
if mode == "resolve-load":
    from torch_compiled_graphs import Engine
    graph = Engine(os.path.join(work, "store")).resolve(sys.argv[3], os.path.join(work, "r", str(os.getpid())))
    assert "torch" not in sys.modules
import torch
from safetensors.torch import load_file
weights = load_file(os.path.join(work, "weights.safetensors"), device="cuda")
x = torch.randn(CFG["batch"] - 1, CFG["seq"], CFG["dim"], device="cuda", dtype=torch.bfloat16)
if mode == "compile-warm":
    import demo
    model = demo.build_model(CFG["dim"], CFG["heads"], CFG["hidden"]).to("cuda", torch.bfloat16).eval()
    model.load_state_dict(weights)
    run = torch.compile(model, dynamic=True)
elif mode == "aoti-load-package":
    run = torch._inductor.aoti_load_package(os.path.join(work, "plain.pt2"))
else:
    run = graph.load(weights)
with torch.no_grad():
    y = run(x)
torch.cuda.synchronize()
print(json.dumps({"ttfi_s": time.perf_counter() - t0, "finite": bool(torch.isfinite(y).all())}))
"""
)

NATIVE_CHILD = (
    COMMON
    + """
from torch_compiled_graphs import Engine
from torch_compiled_graphs.native import from_buffer
graph = Engine(os.path.join(work, "store")).resolve(sys.argv[3], os.path.join(work, "r", str(os.getpid())))
native = graph.load_native(os.path.join(work, "weights.safetensors"), device="cuda:0")
with open(os.path.join(work, "x.bf16"), "rb") as f:
    x = from_buffer(f.read(), "bfloat16", [CFG["batch"] - 1, CFG["seq"], CFG["dim"]], device="cuda:0")
y = native(x).cpu()  # waits for the graph
import numpy as np
bits = np.asarray(y).view(np.uint16)
finite = bool(((bits & 0x7F80) != 0x7F80).all())
assert "torch" not in sys.modules
out = {"ttfi_s": time.perf_counter() - t0, "finite": finite}
if mode == "latency-native":
    for _ in range(20):
        native(x)
    native.synchronize()
    lat = []
    for _ in range(200):
        t = time.perf_counter()
        native(x)
        native.synchronize()
        lat.append(time.perf_counter() - t)
    lat.sort()
    out["call_median_s"] = lat[len(lat) // 2]
print(json.dumps(out))
"""
)

LATENCY_TORCH_CHILD = (
    COMMON
    + """
from torch_compiled_graphs import Engine
graph = Engine(os.path.join(work, "store")).resolve(sys.argv[3], os.path.join(work, "r", str(os.getpid())))
import torch
from safetensors.torch import load_file
run = graph.load(load_file(os.path.join(work, "weights.safetensors"), device="cuda"))
with open(os.path.join(work, "x.bf16"), "rb") as f:
    raw = bytearray(f.read())
x = torch.frombuffer(raw, dtype=torch.bfloat16).reshape(CFG["batch"] - 1, CFG["seq"], CFG["dim"]).cuda()
with torch.no_grad():
    for _ in range(20):
        run(x)
    torch.cuda.synchronize()
    lat = []
    for _ in range(200):
        t = time.perf_counter()
        run(x)
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - t)
lat.sort()
print(json.dumps({"call_median_s": lat[len(lat) // 2]}))
"""
)

RESOLVE_CHILD = """
import sys, time
t0 = time.perf_counter()
from torch_compiled_graphs import Engine
g = Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])
assert g is not None and "torch" not in sys.modules
print(time.perf_counter() - t0)
"""


def install(wheel: str, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target), wheel],
        check=True,
    )


#: The C++ compiler inductor runs in every child (``--cxx``).
CXX: list[str] = []
#: The Rust ``serve`` example binary (``--serve-bin``), for the tests and the benchmark.
SERVE_BIN: list[str] = []
#: Extra pytest arguments for the CUDA suite (``--tests-k``).
TEST_FILTER: list[str] = []


def child_env(site: Path, cache: Path | None = None) -> dict[str, str]:
    env = dict(CHILD_ENV)
    if CXX:
        env["CXX"] = CXX[0]
    if SERVE_BIN:
        env["TCG_SERVE_BIN"] = SERVE_BIN[0]
    # Carried wheels (diffusers on a machine without it) stay importable after ours.
    extra = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(site), str(ROOT), extra] if p)
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return env


def run_json(code: str, args: list[str], env: dict[str, str]) -> dict[str, object]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[:1]} failed:\n{proc.stderr[-4000:]}")
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def run_tests(site: Path, out: Path) -> dict[str, object]:
    xml = out / "cuda-tests.xml"
    junit = [f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    t = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rA",
            # Every CUDA test file (test_cuda*.py: the suite, the drop-in pipeline,
            # CUDA graphs, weights once) and the outputs suite.
            *sorted(str(p) for p in (ROOT / "tests").glob("test_cuda*.py")),
            str(ROOT / "tests" / "test_outputs.py"),
            *TEST_FILTER,
            *junit,
        ],
        capture_output=True,
        text=True,
        env=child_env(site),
        cwd=ROOT,
    )
    (out / "cuda-tests.log").write_text(proc.stdout + proc.stderr)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        tests = int(suite.get("tests", 0))
        counts["failed"] = int(suite.get("failures", 0))
        counts["errors"] = int(suite.get("errors", 0))
        counts["skipped"] = int(suite.get("skipped", 0))
        counts["passed"] = tests - counts["failed"] - counts["errors"] - counts["skipped"]
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - t, **counts}


def bench(
    site: Path, work: Path, repeat: int, result: dict[str, object], save: Callable[[], None], *, native_only: bool
) -> None:
    """Fill ``result`` stage by stage, calling ``save`` after each (a partial run still reports)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(site))  # the installed wheel, for the Rust example's reference output
    import demo

    torch.manual_seed(0)
    model = demo.build_model(MEDIUM["dim"], MEDIUM["heads"], MEDIUM["hidden"])
    state = model.state_dict()  # type: ignore[attr-defined]
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, work / "weights.safetensors")
    x = torch.randn(MEDIUM["batch"] - 1, MEDIUM["seq"], MEDIUM["dim"], dtype=torch.bfloat16)
    (work / "x.bf16").write_bytes(x.view(torch.int16).numpy().tobytes())
    mint_code, ttfi_code = MINT_CHILD, TTFI_CHILD
    result["model"] = {"kind": "transformer block, bf16", **MEDIUM}

    mint = run_json(mint_code, ["mint", str(work)], child_env(site, work / "cache-mint"))
    key = str(mint["key"])
    result["mint"] = {"outcome": mint["outcome"], "mint_s": mint["compile_s"], "key": key}
    if not native_only:
        plain = run_json(mint_code, ["plain", str(work)], child_env(site, work / "cache-plain"))
        result["mint"]["plain_aoti_compile_and_package_s"] = plain["compile_s"]  # type: ignore[index]
        result["mint"]["mint_over_plain"] = float(mint["compile_s"]) / float(plain["compile_s"])  # type: ignore[index, arg-type]
    save()

    resolve: list[float] = []
    bare: list[float] = []
    for i in range(5):
        dest = work / "resolved" / str(i)
        proc = subprocess.run(
            [sys.executable, "-c", RESOLVE_CHILD, str(work / "store"), key, str(dest)],
            capture_output=True,
            text=True,
            env=child_env(site),
            check=True,
        )
        resolve.append(float(proc.stdout.strip().splitlines()[-1]))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=child_env(site))
        bare.append(time.perf_counter() - t)
    result["resolve"] = {
        "import_and_resolve_in_fresh_process_median_s": statistics.median(resolve),
        "python_pass_median_s": statistics.median(bare),
    }
    save()

    # The torch-free path first: a failure there is recorded and the other figures still run.
    try:
        lat = run_json(NATIVE_CHILD, ["latency-native", str(work), key], child_env(site, work / "cache-native"))
        lat_torch = run_json(LATENCY_TORCH_CHILD, ["latency", str(work), key], child_env(site, work / "cache-ours"))
        result["latency"] = {
            "load_native_call_median_s": lat["call_median_s"],
            "load_call_median_s": lat_torch["call_median_s"],
            "note": "one call of the bf16 block at batch 3, each followed by a device synchronisation; median of 200; "
            "load() replays a CUDA graph (its default since issue 32; --graphs compares with and without)",
        }
    except Exception as exc:
        result["latency_error"] = f"{type(exc).__name__}: {exc}"
    save()
    if SERVE_BIN:
        result["rust_serve"] = rust_serve(work, key)
        save()

    if not native_only:
        run_json(ttfi_code, ["compile-warm", str(work), key], child_env(site, work / "cache-warm"))  # warm it
    samples: dict[str, list[float]] = {
        "load-native": [],
        "compile-warm": [],
        "aoti-load-package": [],
        "resolve-load": [],
    }
    for _ in range(repeat):
        for mode, cache in (
            ("load-native", "cache-native"),
            ("compile-warm", "cache-warm"),
            ("aoti-load-package", "cache-aoti"),
            ("resolve-load", "cache-ours"),
        ):
            if native_only and mode in ("compile-warm", "aoti-load-package"):
                continue
            code = NATIVE_CHILD if mode == "load-native" else ttfi_code
            try:
                got = run_json(code, [mode, str(work), key], child_env(site, work / cache))
            except RuntimeError as exc:
                if mode != "load-native":
                    raise
                result["load_native_error"] = str(exc)[-4000:]
                continue
            assert got["finite"], mode
            samples[mode].append(float(got["wall_s"]))  # type: ignore[arg-type]
        result["ttfi_samples_s"] = samples
        save()
    med = {m: statistics.median(v) for m, v in samples.items() if v}
    ttfi: dict[str, object] = {"median_wall_s": med, "samples_s": samples}
    for slow in ("compile-warm", "aoti-load-package"):
        for fast in ("resolve-load", "load-native"):
            if slow in med and fast in med:
                ttfi[f"{slow}_over_{fast}"] = med[slow] / med[fast]
    if "resolve-load" in med and "load-native" in med:
        ttfi["resolve-load_over_load-native"] = med["resolve-load"] / med["load-native"]
    result["ttfi"] = ttfi


GRAPHS_CHILD = """
import json, os, statistics, sys, time
which, work, scripts = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, scripts)
import torch
from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

torch.manual_seed(0)
dt = torch.bfloat16
batch = torch.export.Dim("batch", min=1, max=8)
if which == "unet":
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=8,
    )

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states):
            return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    model = Model()
    config = {"kind": "UNet2DConditionModel, bf16", "latents": [4, 32, 32], "tokens": 77, "cross_attention_dim": 64,
              "block_out_channels": [32, 64]}
    step = torch.tensor(10.0, device="cuda")
    def inputs(b):
        return (torch.randn(b, 4, 32, 32, device="cuda", dtype=dt), step,
                torch.randn(b, 77, 64, device="cuda", dtype=dt))
    dynamic = ({0: batch}, None, {0: batch})
    modes = ["default", "reduce-overhead"]
else:
    import demo

    dim, heads, hidden, seq, depth = 512, 8, 2048, 128, 8
    class Model(torch.nn.Module):
        # Under a name: AOTInductor records a top-level Sequential's "0.weight" as a literal.
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[demo.build_model(dim, heads, hidden) for _ in range(depth)])

        def forward(self, x):
            return self.blocks(x)

    model = Model()
    config = {"kind": "transformer block stack, bf16", "dim": dim, "heads": heads, "hidden": hidden, "seq": seq,
              "blocks": depth}
    def inputs(b):
        return (torch.randn(b, seq, dim, device="cuda", dtype=dt),)
    dynamic = ({0: batch},)
    modes = ["default", "reduce-overhead", "max-autotune"]
model = model.to("cuda", dt).eval()
out = {"model": config, "batches": {}, "first_call_s": {}, "errors": {}}

def latency(fn, args, calls=200, warm=20):
    # Each call between two CUDA events on the current stream, after the device went
    # idle: launch overhead and kernel time together, as a batch-1 server sees them.
    stream = torch.cuda.current_stream()
    for _ in range(warm):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn(*args)
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)

def first(fn, args):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t

with torch.no_grad():
    t = time.perf_counter()
    program = torch.export.export(model, inputs(2), dynamic_shapes=dynamic)
    major, minor = torch.cuda.get_device_capability()
    sm = f"sm_{major}{minor}"
    spec = GraphClassSpec(f"bench/graphs-{which}", "bench", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility(sm, toolchain=toolchain).key(spec.declare())
    graph = Engine(os.path.join(work, "store")).ensure(
        key, os.path.join(work, "minted"), target=sm, toolchain=toolchain, recipe=lambda: spec
    ).compiled_graph
    out["mint_s"] = time.perf_counter() - t
    runs = {"eager": model}
    for mode in modes:
        runs["compile-" + mode] = torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)
    t = time.perf_counter()
    runs["load"] = graph.load(model, cuda_graphs=False)
    out["load_s"] = time.perf_counter() - t
    runs["load-cuda-graphs"] = graph.load(model)
    weights = os.path.join(work, "weights.safetensors")
    graph.write_weights(model, weights)
    try:
        native = graph.load_native(weights, device="cuda:0")
        native.stream = torch.cuda.current_stream().cuda_stream
        runs["load_native"] = native
    except Exception as exc:
        out["errors"]["load_native"] = f"{type(exc).__name__}: {exc}"[-2000:]
    for b in (1, 8):
        args = inputs(b)
        row = {}
        firsts = {}
        reference = model(*args)
        for name, fn in runs.items():
            try:
                firsts[name] = first(fn, args)
                if name == "load-cuda-graphs":
                    firsts[name + " (capture call)"] = [first(fn, args) for _ in range(2)][-1]
                    firsts["capture"] = fn.timings["capture"]
                    same = torch.equal(fn(*args), runs["load"](*args))
                    row["load-cuda-graphs_bitwise_equal_to_load"] = bool(same)
                row[name] = latency(fn, args)
                if name != "load_native":
                    got = fn(*args)
                    row[name + "_max_abs_diff_vs_eager"] = float((got.float() - reference.float()).abs().max())
            except Exception as exc:
                out["errors"][f"{name}@{b}"] = f"{type(exc).__name__}: {exc}"[-2000:]
        for name in runs:
            if name != "eager" and name in row and "eager" in row:
                row[name + "_speedup_vs_eager"] = row["eager"] / row[name]
        out["batches"][str(b)] = row
        out["first_call_s"][str(b)] = firsts
    out["load-cuda-graphs_stats"] = runs["load-cuda-graphs"].stats
print(json.dumps(out))
"""


def graphs_bench(site: Path, work: Path, result: dict[str, object], save: Callable[[], None]) -> None:
    """Steady-state latency with and without CUDA graphs (``--graphs``), one fresh
    process per model: the block stack first (the cheaper one), then the UNet.
    Latencies are medians of 200 calls between CUDA events, in seconds."""
    result["note"] = (
        "median of 200 calls after 20 warm-up calls, CUDA events around each call after the device went idle; "
        "max-autotune for the block stack only (the UNet's autotuning alone takes minutes); load_native has no "
        "CUDA graphs yet"
    )
    for which in ("blocks", "unet"):
        dest = work / which
        dest.mkdir(parents=True, exist_ok=True)
        try:
            result[which] = run_json(
                GRAPHS_CHILD, [which, str(dest), str(ROOT / "scripts")], child_env(site, dest / "cache")
            )
        except Exception as exc:
            result[which] = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
        save()


def rust_serve(work: Path, key: str) -> dict[str, object]:
    """The Rust ``serve`` example on the GPU: whole-process TTFI (3 fresh processes)
    and its call latency; expected output computed here by the torch-based load."""
    import torch
    from safetensors.torch import load_file, save_file

    from torch_compiled_graphs import Engine
    from torch_compiled_graphs.native import find_torch_lib

    try:
        graph = Engine(work / "store").resolve(key, work / "serve-ref")
        assert graph is not None
        run = graph.load(load_file(str(work / "weights.safetensors"), device="cuda"))
        raw = bytearray((work / "x.bf16").read_bytes())
        shape = (MEDIUM["batch"] - 1, MEDIUM["seq"], MEDIUM["dim"])
        x = torch.frombuffer(raw, dtype=torch.bfloat16).reshape(shape)
        with torch.no_grad():
            y = run(x.cuda()).cpu()
        save_file({"x": x, "y": y}, str(work / "serve-io.safetensors"))
        walls: list[float] = []
        reports: list[object] = []
        for i in range(3):
            argv = [SERVE_BIN[0], "--store", str(work / "store"), "--key", key, "--dest", str(work / f"serve-{i}")]
            argv += ["--torch-lib", find_torch_lib(), "--weights", str(work / "weights.safetensors")]
            argv += ["--io", str(work / "serve-io.safetensors"), "--in", "x", "--out", "y", "--device", "cuda:0"]
            argv += ["--repeat", "200" if i == 0 else "0", "--rtol", "2e-2", "--atol", "2e-2"]
            t = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True)
            walls.append(time.perf_counter() - t)
            if proc.returncode != 0:
                return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
            reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        return {"wall_s": walls, "median_wall_s": statistics.median(walls), "reports": reports}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _tier_model(args: tuple[str, Path, Path]) -> dict[str, object]:
    """One model of the real-model tier on ``cuda:0``: every stage in a fresh process,
    then the Rust serve example from the checkpoints a user has."""
    name, site, work = args
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(site)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "tests")])
    out: dict[str, object] = {"model": name}
    for step in ("mint", "load", "native", "reuse"):
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "realmodels.py"), step, name, str(work), "cuda:0"],
            capture_output=True,
            text=True,
            env=env,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            out[step] = {"error": (proc.stdout[-1500:] + proc.stderr[-3000:]), "returncode": proc.returncode}
            return out
        got = json.loads(lines[-1])
        got.pop("contract", None)
        got["wall_s"] = time.perf_counter() - t
        out[step] = got
    if SERVE_BIN:
        meta = json.loads((work / "mint.json").read_text())
        sys.path.insert(0, str(site))
        from torch_compiled_graphs.native import find_torch_lib

        serves = {}
        for label, path in meta["checkpoints"].items():
            argv = [SERVE_BIN[0], "--store", str(work / "store"), "--key", meta["key"]]
            argv += ["--dest", str(work / f"serve-{label}"), "--torch-lib", find_torch_lib(), "--device", "cuda:0"]
            for w in [path, *meta["extra"]]:
                argv += ["--weights", w]
            if meta["add_prefix"]:
                argv += ["--add-prefix", meta["add_prefix"]]
            argv += ["--io", str(work / "io.safetensors")]
            for i in range(meta["flat_inputs"]):
                argv += ["--in", f"in{i}"]
            argv += ["--out", "out0", "--rtol", "1e-2", "--atol", "1e-2"]
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            tail = proc.stdout.strip().splitlines()
            serves[label] = (
                json.loads(tail[-1])
                if proc.returncode == 0 and tail
                else {"error": proc.stdout[-800:] + proc.stderr[-1500:]}
            )
        out["serve"] = serves
    return out


def realmodels(site: Path, work: Path, workers: int, only: str | None = None) -> dict[str, object]:
    """The real-model tier on the GPU, models in parallel (each compile is single-threaded)."""
    from concurrent.futures import ThreadPoolExecutor

    sys.path.insert(0, str(ROOT / "tests"))
    from realmodels import MODELS

    jobs = [(m, site, work / m) for m in MODELS if not only or m in only.split(",")]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_tier_model, jobs))
    table = {}
    for r in results:
        row = {}
        for step in ("mint", "load", "native", "reuse"):
            got = r.get(step)
            row[step] = "missing" if not isinstance(got, dict) else ("error" if "error" in got else "ok")
            if step in ("load", "native") and isinstance(got, dict) and "ok" in got:
                row[step] = "ok" if got["ok"] else "wrong"
        serve = r.get("serve")
        if isinstance(serve, dict):
            row["serve"] = "ok" if all(isinstance(v, dict) and v.get("ok") for v in serve.values()) else "error"
        table[str(r["model"])] = row
    return {"table": table, "models": results}


def static_runtime(site: Path, work: Path) -> dict[str, object]:
    """The device's default CXX links libstdc++ statically, and torch's package loader
    crashes on such packages (in the minting process too): the mint must succeed (parity
    through the torch-free runner, recorded as ``parity.runner``), and ``load()`` and
    ``load_native`` must run the artifact and agree with eager (issue 31)."""
    code = """
import json, os, sys, torch
from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs.errors import CompileError
work = sys.argv[1]
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
m = M().cuda().eval()
x = torch.randn(4, 16, device="cuda")
spec = GraphClassSpec("e2e/static-cxx", "serve", torch.export.export(m, (x,)))
major, minor = torch.cuda.get_device_capability()
sm = f"sm_{major}{minor}"
tc = record_toolchain()
key = RuntimeCompatibility(sm, toolchain=tc).key(spec.declare())
out = {"cxx": os.environ.get("CXX")}
try:
    result = Engine(os.path.join(work, "store")).ensure(key, os.path.join(work, "out"), target=sm, toolchain=tc,
                                                        recipe=lambda: spec)
    out["mint"] = "minted"
except CompileError as e:
    out["mint"] = e.code
    out["message"] = str(e)[:600]
    print(json.dumps(out))
    sys.exit(0)
from safetensors.torch import save_file
from torch.utils.dlpack import from_dlpack
from torch_compiled_graphs import _native
g = result.compiled_graph
out["own_cxx_runtime"] = _native.package_own_cxx_runtime(str(g.package_path), g.graph_class)
out["parity_runner"] = g.mint_record["parity"].get("runner")
with torch.no_grad():
    want = m(x)
loaded = g.load(m)
out["load_runner"] = loaded.runner
out["load_max_abs"] = float((loaded(x) - want).abs().max())
w = os.path.join(work, "w.safetensors")
save_file({k: v.detach().cpu().contiguous() for k, v in m.state_dict().items()}, w)
native = g.load_native(w, device="cuda:0")
out["load_native_max_abs"] = float((from_dlpack(native(x)) - want).abs().max())
out["ok"] = max(out["load_max_abs"], out["load_native_max_abs"]) < 1e-3
print(json.dumps(out))
"""
    env = child_env(site)
    env.pop("CXX", None)  # the device's own default compiler
    default_cxx = os.environ.get("CXX")
    if default_cxx:
        env["CXX"] = default_cxx
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", code, str(work)], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stdout[-1500:] + proc.stderr[-3000:], "returncode": proc.returncode}
    result: dict[str, object] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", required=True, help="the abi3 wheel (a glob is expanded)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve-bin", help="the Rust serve example (cargo build --release --example serve)")
    parser.add_argument("--realmodels", action="store_true", help="run the real-model tier on the GPU")
    parser.add_argument("--workers", type=int, default=6, help="models of the tier run at once")
    parser.add_argument("--models", help="comma-separated models of the tier (default: all)")
    parser.add_argument("--tests-k", help="pytest -k expression for the CUDA suite")
    parser.add_argument(
        "--test-workers", type=int, default=0, help="run the suite's files on N pytest-xdist workers (loadfile)"
    )
    parser.add_argument("--graphs", action="store_true", help="benchmark CUDA-graph replay (graphs_bench)")
    parser.add_argument("--coldstart", action="store_true", help="run the cold-start benchmark (scripts/coldstart.py)")
    parser.add_argument("--sizes", default="small,large", help="the cold-start models (small: 0.8 GB, large: 13 GB)")
    parser.add_argument("--coldstart-work", help="where the cold-start models go (default: a temporary folder)")
    parser.add_argument(
        "--native-only",
        action="store_true",
        help="benchmark only our two loads (no plain compile, warm torch.compile or aoti_load_package)",
    )
    parser.add_argument(
        "--cxx",
        default=None,
        help="the C++ compiler for inductor (CXX) in every child; default: the machine's own environment, "
        "as users find it (its default compiler may link libstdc++ statically: such packages run through "
        "the torch-free runner)",
    )
    args = parser.parse_args()
    if args.cxx:
        CXX.append(args.cxx)
    if args.serve_bin:
        SERVE_BIN.append(os.path.abspath(args.serve_bin))
    if args.test_workers > 0:
        TEST_FILTER.extend(["-n", str(args.test_workers), "--dist", "loadfile"])
    if args.tests_k:
        TEST_FILTER.extend(["-k", args.tests_k])
    wheels = sorted(glob.glob(args.wheel))
    if len(wheels) != 1:
        raise SystemExit(f"--wheel must name exactly one wheel, found {wheels}")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    report: dict[str, object] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "wheel": os.path.basename(wheels[0]),
        "cxx": args.cxx or os.environ.get("CXX", "g++"),
    }

    def save() -> None:
        (args.out / "cuda-e2e.json").write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory(prefix="tcg-cuda-e2e-") as tmp:
        site = Path(tmp) / "site"
        install(wheels[0], site)
        if not args.no_tests and not args.realmodels:
            report["tests"] = run_tests(site, args.out)
            print(json.dumps({"tests": report["tests"]}), flush=True)
            save()
        if args.realmodels:
            from concurrent.futures import ThreadPoolExecutor

            # The static-runtime check runs beside the tier (both mostly wait on compiles).
            # The suite and the static-runtime check run beside the tier (all mostly wait on compiles).
            with ThreadPoolExecutor(max_workers=2) as side:
                static = side.submit(static_runtime, site, Path(tmp) / "static")
                suite = None if args.no_tests else side.submit(run_tests, site, args.out)
                report["realmodels"] = realmodels(site, Path(tmp) / "realmodels", args.workers, args.models)
                print(json.dumps({"realmodels": report["realmodels"]["table"]}, indent=1), flush=True)  # type: ignore[index]
                save()
                report["static_cxx_runtime"] = static.result()
                if suite is not None:
                    report["tests"] = suite.result()
                    print(json.dumps({"tests": report["tests"]}), flush=True)
            print(json.dumps({"static_cxx_runtime": report["static_cxx_runtime"]}), flush=True)
            save()
        if args.coldstart:
            import coldstart

            argv = ["--out", str(args.out), "--site", str(site), "--sizes", args.sizes, "--repeat", str(args.repeat)]
            argv += ["--work", args.coldstart_work or str(Path(tmp) / "coldstart")]
            if args.serve_bin:
                argv += ["--serve-bin", os.path.abspath(args.serve_bin)]
            if args.cxx:
                argv += ["--cxx", args.cxx]
            try:
                report["coldstart"] = coldstart.main(argv)
            except Exception as exc:  # recorded, and the run fails below
                report["bench_error"] = f"coldstart: {type(exc).__name__}: {exc}"[-4000:]
            save()
        if args.graphs:
            graphs: dict[str, object] = {}
            report["graphs"] = graphs

            def save_graphs() -> None:
                (args.out / "cuda-graphs.json").write_text(json.dumps(graphs, indent=1))
                save()

            graphs_bench(site, Path(tmp) / "graphs", graphs, save_graphs)
            print(json.dumps({"graphs": graphs}, indent=1), flush=True)
            if any(isinstance(v, dict) and "error" in v for v in graphs.values()):
                report["bench_error"] = "graphs: a model failed (see graphs)"
        if not args.no_bench:
            work = Path(tmp) / "bench"
            work.mkdir()
            report["bench"] = {}
            try:
                bench(site, work, args.repeat, report["bench"], save, native_only=args.native_only)  # type: ignore[arg-type]
            except Exception as exc:  # recorded, and the run fails below
                report["bench_error"] = f"{type(exc).__name__}: {exc}"
    save()
    print(json.dumps(report, indent=1))
    tests = report.get("tests")
    failed = isinstance(tests, dict) and (tests["returncode"] != 0 or tests["passed"] == 0)
    if failed or "bench_error" in report:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
