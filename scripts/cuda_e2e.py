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
   and ``load_native`` with and without CUDA graphs, and the Rust ``serve``
   example (``--serve-bin``, ``--cuda-graphs on|off``) on the block stack at
   batch 1 and 8 against ``load_native`` timed the same way, with the first-call
   and capture costs and the goals' ratios (``graphs.ratios``); written to
   ``OUT/cuda-graphs.json`` (``--no-tests --no-bench --graphs`` runs it alone).
6. With ``--weights-once``, issue 33's benchmark (:func:`weights_once`): a
   ~506 M-parameter bf16 ``UNet2DConditionModel`` (1.01 GB) minted in four
   resolution buckets in parallel, then in fresh processes the GPU memory of
   (a) the module and module + ``load(module)``, (b) ``WeightsSet(module)`` + four
   ``load(set)``, (c) ``NativeWeightsSet`` + four ``load_native(set)`` against one
   ``load_native(checkpoint)``, (d) LoRA apply / replace times (rank 16 on every
   attention projection, made with PEFT) against diffusers' load + fuse, on the
   native set too when it has ``apply_lora``, and (e) cold start of four buckets
   against one; ratios in ``weights_once.ratios``, written to
   ``OUT/weights-once.json``. The whole run may exceed one command's time:
   ``--weights-once-work DIR --weights-once-stages none`` sets up and mints, and
   later commands with the same DIR run chosen stages (``module,set,lora,native,cold``).
7. With ``--shim``, issue 34's stage (``scripts/shim_e2e.py``): the tcg-shim GPU
   tests (``--shim-test-bin``), the libtorch-free variant ``shim-v1`` minted for
   the block stack and the tier's smallest transformers and diffusers models (and
   the default variant of each), each admitted graph run torch-free on the shim
   and compared with eager, the Rust ``serve`` example on the shim, the torch-free
   hit path, the install bytes, the steady state of the variant against the
   default, and the cold start (``--shim-sizes``) against the libtorch path and the
   floor; written to ``OUT/shim.json`` after every step (``--shim-only`` runs some).
   ``--device cpu`` is its rehearsal on a machine without a GPU.
8. Writes everything to ``OUT/cuda-e2e.json`` and prints a summary.

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
from typing import Any

import shim_e2e
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
    import importlib.util

    if importlib.util.find_spec("pip") is None:
        # An interpreter without pip (a uv-made venv, as the CPU rehearsal's): the wheel
        # is unpacked as pip --target would lay it out (ours has no .data directory).
        import zipfile

        with zipfile.ZipFile(wheel) as zf:
            if any(".data/" in name for name in zf.namelist()):
                raise SystemExit(f"{wheel} has a .data directory: install it with pip")
            zf.extractall(target)
        return
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
        raise RuntimeError(f"child {args[:1]} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


#: Test files that measure the device's memory (``mem_get_info``, device-wide): run alone,
#: after the others, never beside another worker's allocations.
MEMORY_FILES = ("test_cuda_weights_once.py",)


def _pytest(site: Path, out: Path, name: str, files: list[str], extra: list[str]) -> dict[str, object]:
    xml = out / f"{name}.xml"
    junit = [f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *files, *extra, *junit],
        capture_output=True,
        text=True,
        env=child_env(site),
        cwd=ROOT,
    )
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        tests = int(suite.get("tests", 0))
        counts["failed"] = int(suite.get("failures", 0))
        counts["errors"] = int(suite.get("errors", 0))
        counts["skipped"] = int(suite.get("skipped", 0))
        counts["passed"] = tests - counts["failed"] - counts["errors"] - counts["skipped"]
    # pytest's 5: nothing collected (a -k that selects none of the files).
    rc = 0 if proc.returncode == 5 else proc.returncode
    return {"returncode": rc, "seconds": time.perf_counter() - t, **counts}


def run_tests(site: Path, out: Path) -> dict[str, object]:
    """Every CUDA test file (test_cuda*.py: the suite, the drop-in pipeline, CUDA graphs,
    weights once) and the outputs suite: the files that measure device memory alone,
    after the others (which may run on several workers)."""
    files = [*sorted(str(p) for p in (ROOT / "tests").glob("test_cuda*.py")), str(ROOT / "tests" / "test_outputs.py")]
    parallel = [f for f in files if Path(f).name not in MEMORY_FILES]
    alone = [f for f in files if Path(f).name in MEMORY_FILES]
    serial_filter: list[str] = []
    skip = 0
    for arg in TEST_FILTER:
        if skip:
            skip -= 1
            continue
        if arg in ("-n", "--dist"):
            skip = 1
            continue
        serial_filter.append(arg)
    first = _pytest(site, out, "cuda-tests", parallel, list(TEST_FILTER))
    second = _pytest(site, out, "cuda-tests-memory", alone, serial_filter) if alone else None
    if second is None:
        return first
    merged: dict[str, object] = {"returncode": first["returncode"] or second["returncode"], "memory_files": second}
    for k in ("seconds", "passed", "failed", "errors", "skipped"):
        merged[k] = first[k] + second[k]  # type: ignore[operator]
    return merged


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
                # Recorded, and the other ways still run: torch's own loader (a baseline)
                # has failed at exit on the device without a word on stderr.
                result[f"{mode.replace('-', '_')}_error"] = str(exc)[-4000:]
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
phase = sys.argv[4] if len(sys.argv) > 4 else ""
if phase == "autotune-warm":
    # Fills this work folder's inductor caches (the compiled graph and the autotuning
    # results) for max-autotune at batch 8 while another child mints: the measuring
    # child then compiles from the caches instead of autotuning for minutes.
    with torch.no_grad():
        t = time.perf_counter()
        torch.compile(model, mode="max-autotune", dynamic=False)(*inputs(8))
        torch.cuda.synchronize()
    print(json.dumps({"compile_s": time.perf_counter() - t}))
    sys.exit(0)

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

def wall_latency(fn, args, sync, calls=200, warm=20):
    # Wall time of a call and a wait for its stream, as the Rust serve example times
    # Served::run + Cuda::synchronize: the figure the Rust path is compared with.
    for _ in range(warm):
        fn(*args)
    sync()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)

def attr(obj, name):
    value = getattr(obj, name, None)
    return value() if callable(value) else value

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
    if phase == "autotune-mint":
        print(json.dumps(out, default=str))
        sys.exit(0)
    runs = {"eager": model}
    # "native": only the load_native rows, in a process started with libtorch's
    # stream-ordered allocator (what load_native chooses when it opens libtorch first;
    # the torch rows keep the allocator users get by default).
    native_only = len(sys.argv) > 4 and sys.argv[4] == "native"
    # "autotune": max-autotune against ours at batch 8 only (issue 32's kernel-choice
    # check; the UNet's autotuning takes minutes, so it runs on its own).
    autotune_only = len(sys.argv) > 4 and sys.argv[4] == "autotune"
    if autotune_only:
        modes = ["max-autotune"]
    out["allocator"] = torch.cuda.get_allocator_backend()
    for mode in [] if native_only else modes:
        runs["compile-" + mode] = torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)
    if not native_only:
        t = time.perf_counter()
        runs["load"] = graph.load(model, cuda_graphs=False)
        out["load_s"] = time.perf_counter() - t
        runs["load-cuda-graphs"] = graph.load(model)
    weights = os.path.join(work, "weights.safetensors")
    graph.write_weights(model, weights)
    out["key"], out["weights"] = str(key), weights
    out["inputs"] = [list(a.shape) for a in inputs(1)]
    from torch_compiled_graphs.native import find_torch_lib
    out["torch_lib"] = find_torch_lib()
    # The default (CUDA graphs where the native path captures) and the opt-out.
    natives = () if autotune_only else (("load_native", {}), ("load_native-no-cuda-graphs", {"cuda_graphs": False}))
    for name, options in natives:
        try:
            native = graph.load_native(weights, device="cuda:0", **options)
            native.stream = torch.cuda.current_stream().cuda_stream
            runs[name] = native
        except Exception as exc:
            out["errors"][name] = f"{type(exc).__name__}: {exc}"[-2000:]
    for b in (8,) if autotune_only else (1, 8):
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
                if name.startswith("load_native"):
                    # The second and third calls (the native path warms, then captures).
                    firsts[name + " (calls 2, 3)"] = [first(fn, args) for _ in range(2)]
                row[name] = latency(fn, args)
                if name.startswith("load_native"):
                    row[name + "_wall"] = wall_latency(fn, args, fn.synchronize)
                    got = torch.from_dlpack(fn(*args))
                else:
                    got = fn(*args)
                row[name + "_max_abs_diff_vs_eager"] = float((got.float() - reference.float()).abs().max())
            except Exception as exc:
                out["errors"][f"{name}@{b}"] = f"{type(exc).__name__}: {exc}"[-2000:]
        if "load_native" in runs and "load_native-no-cuda-graphs" in runs:
            try:
                with_graphs = torch.from_dlpack(runs["load_native"](*args)).clone()
                without = torch.from_dlpack(runs["load_native-no-cuda-graphs"](*args)).clone()
                row["load_native_bitwise_equal_to_no-cuda-graphs"] = bool(torch.equal(with_graphs, without))
            except Exception as exc:
                out["errors"][f"load_native equality@{b}"] = f"{type(exc).__name__}: {exc}"[-2000:]
        if not native_only and not autotune_only:
            # Inputs (in0, in1, ... in the graph's flat order) and the expected output
            # for the Rust serve example at this batch.
            try:
                from safetensors.torch import save_file
                io = {f"in{i}": a.cpu().contiguous() for i, a in enumerate(args)}
                io["y"] = runs["load"](*args).cpu().contiguous()
                save_file(io, os.path.join(work, f"serve-io-b{b}.safetensors"))
            except Exception as exc:
                out["errors"][f"serve-io@{b}"] = f"{type(exc).__name__}: {exc}"[-2000:]
        for name in runs:
            if name != "eager" and name in row and "eager" in row:
                row[name + "_speedup_vs_eager"] = row["eager"] / row[name]
        out["batches"][str(b)] = row
        out["first_call_s"][str(b)] = firsts
    if "load-cuda-graphs" in runs:
        out["load-cuda-graphs_stats"] = runs["load-cuda-graphs"].stats
    for name in ("load_native", "load_native-no-cuda-graphs"):
        if name in runs:
            out[name + "_stats"] = attr(runs[name], "stats")
print(json.dumps(out, default=str))
"""


def graphs_autotune(site: Path, work: Path, result: dict[str, object], save: Callable[[], None]) -> None:
    """``--graphs-autotune``: the UNet at batch 8 against ``torch.compile(mode="max-autotune")``
    in one child (eager, max-autotune, ours with and without CUDA graphs)."""
    dest = work / "unet-autotune"
    dest.mkdir(parents=True, exist_ok=True)
    env = child_env(site, dest / "cache")
    base = ["unet", str(dest), str(ROOT / "scripts")]
    try:
        # max-autotune's compile (autotuning) and our mint, at once in two children on
        # the machine's cores; then one child measures every way from warm caches.
        warm = subprocess.Popen(
            [sys.executable, "-c", GRAPHS_CHILD, *base, "autotune-warm"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        mint = run_json(GRAPHS_CHILD, [*base, "autotune-mint"], env)
        warm_out, warm_err = warm.communicate()
        if warm.returncode != 0:
            raise RuntimeError(f"max-autotune warm-up failed:\n{warm_err[-4000:]}")
        prepared = {"autotune_warm": json.loads(warm_out.strip().splitlines()[-1]), "mint_s": mint.get("mint_s")}
        result["unet_autotune_prepare"] = prepared
        save()
        got = run_json(GRAPHS_CHILD, [*base, "autotune"], env)
        row = got.get("batches", {}).get("8", {})
        got["ours_over_max_autotune"] = _ratio(row.get("load-cuda-graphs"), row.get("compile-max-autotune"))
        result["unet_autotune"] = got
    except Exception as exc:
        result["unet_autotune"] = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
    save()


def graphs_bench(site: Path, work: Path, result: dict[str, object], save: Callable[[], None]) -> None:
    """Steady-state latency with and without CUDA graphs (``--graphs``), one fresh
    process per model: the block stack first (the cheaper one), then the UNet.
    Latencies are medians of 200 calls between CUDA events, in seconds; ``load_native``
    also as wall time of a call and its stream's synchronisation (``*_wall``), the way
    the Rust ``serve`` example (``--serve-bin``) times ``Served``, which runs on the
    block stack and the UNet at batch 1 and 8 with CUDA graphs on and off (``<model>.rust_serve``).
    ``result["ratios"]`` holds the goals' ratios (:func:`graphs_ratios`)."""
    result["note"] = (
        "median of 200 calls after 20 warm-up calls, CUDA events around each call after the device went idle; "
        "max-autotune for the block stack only (the UNet's autotuning alone takes minutes); load_native and Rust "
        "Served with and without CUDA graphs, compared by wall time of a call + synchronize (*_wall, call_median_s)"
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
        got = result[which]
        if isinstance(got, dict) and "batches" in got:
            # The load_native rows again, in a process on the stream-ordered allocator
            # (the native path captures only there); they replace the default child's.
            env = child_env(site, dest / "cache")
            env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
            try:
                native = run_json(GRAPHS_CHILD, [which, str(dest), str(ROOT / "scripts"), "native"], env)
                got["native_child"] = {k: v for k, v in native.items() if k != "batches"}
                for b, row in native.get("batches", {}).items():
                    mine = got["batches"].setdefault(b, {})
                    for k in [k for k in mine if k.startswith("load_native")]:
                        mine[k + " (caching allocator)"] = mine.pop(k)
                    mine.update({k: v for k, v in row.items() if k.startswith("load_native")})
                for b, firsts in native.get("first_call_s", {}).items():
                    got.setdefault("first_call_s", {}).setdefault(b, {}).update(
                        {k: v for k, v in firsts.items() if k.startswith("load_native")}
                    )
            except Exception as exc:
                got["native_child"] = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
            save()
        if isinstance(got, dict) and "key" in got:
            got["rust_serve"] = serve_steady(dest, got) if SERVE_BIN else {"skipped": "no --serve-bin"}
        result["ratios"] = graphs_ratios(result)
        save()


def serve_steady(dest: Path, got: dict[str, Any]) -> dict[str, Any]:
    """The Rust ``serve`` example on a model's graph (every input from the child's
    ``serve-io`` file) at batch 1 and 8, with
    ``--cuda-graphs on`` and ``off``: its call latency (wall time of ``Served::run`` and a
    synchronisation, median of 200) over ``load_native``'s measured the same way in the
    benchmark's child (goal <= 1.05). Each cell records its report or its error."""
    out: dict[str, Any] = {}
    batches = got.get("batches")
    for b in (1, 8):
        io = dest / f"serve-io-b{b}.safetensors"
        row = batches.get(str(b), {}) if isinstance(batches, dict) else {}
        for setting in ("on", "off"):
            cell: dict[str, Any] = {}
            out[f"b{b}-cuda-graphs-{setting}"] = cell
            if not io.exists():
                cell["error"] = f"no {io.name}: the benchmark's child did not write it"
                continue
            argv = [SERVE_BIN[0], "--store", str(dest / "store"), "--key", str(got["key"])]
            argv += ["--dest", str(dest / f"serve-b{b}-{setting}"), "--torch-lib", str(got["torch_lib"])]
            argv += ["--weights", str(got["weights"]), "--io", str(io), "--out", "y"]
            for i in range(len(got.get("inputs", [])) or 1):
                argv += ["--in", f"in{i}"]
            argv += ["--device", "cuda:0", "--repeat", "200", "--rtol", "2e-2", "--atol", "2e-2"]
            argv += ["--cuda-graphs", setting]
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            except subprocess.TimeoutExpired:
                cell["error"] = "timed out after 300 s"
                continue
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode not in (0, 1) or not lines:
                cell["error"] = f"exit {proc.returncode}: {proc.stdout[-1500:]}{proc.stderr[-2500:]}"
                continue
            try:
                report = json.loads(lines[-1])
            except ValueError as exc:
                cell["error"] = f"unreadable report: {exc}: {lines[-1][:500]}"
                continue
            cell["report"] = report
            if proc.returncode == 1:
                cell["error"] = "outputs differ from load() beyond 2e-2"
            native = row.get("load_native_wall" if setting == "on" else "load_native-no-cuda-graphs_wall")
            cell["load_native_wall_s"] = native
            cell["rust_over_load_native"] = _ratio(report.get("call_median_s"), native)
    return out


#: The torch.compile modes of :data:`GRAPHS_CHILD`, the baselines of issue 32's goals.
COMPILE_MODES = ("compile-default", "compile-reduce-overhead", "compile-max-autotune")


def graphs_ratios(graphs: dict[str, Any]) -> dict[str, Any]:
    """Issue 32's goals from :func:`graphs_bench`'s result: at batch 1 ours over
    ``reduce-overhead`` (goal <= 1.0), at batch 8 over the best torch.compile mode run
    (goal <= 1.0), Rust ``Served`` over ``load_native`` (goal <= 1.05), and the capture's
    cost on a graph's first calls (goal <= 50 ms); ``None`` where a cell is missing."""
    out: dict[str, Any] = {}
    goals: dict[str, bool | None] = {}
    for which in ("blocks", "unet"):
        model = graphs.get(which)
        if not isinstance(model, dict) or not isinstance(model.get("batches"), dict):
            continue
        for b, row in model["batches"].items():
            compiled = {k: row[k] for k in COMPILE_MODES if isinstance(row.get(k), (int, float))}
            if b == "1":
                base = "compile-reduce-overhead"
            else:
                base = min(compiled, key=lambda k: compiled[k]) if compiled else "compile-reduce-overhead"
            cell: dict[str, Any] = {"baseline": base}
            for ours in ("load-cuda-graphs", "load", "load_native", "load_native-no-cuda-graphs"):
                cell[f"{ours}_over_baseline"] = _ratio(row.get(ours), compiled.get(base))
            cell["capture_s"] = _dig(model, "first_call_s", b, "capture")
            out[f"{which}_b{b}"] = cell
            for ours in ("load-cuda-graphs", "load_native"):
                ratio = cell[f"{ours}_over_baseline"]
                goals[f"{which}_b{b}_{ours}_over_baseline"] = None if ratio is None else ratio <= 1.0
            capture = cell["capture_s"]
            goals[f"{which}_b{b}_capture"] = None if not isinstance(capture, (int, float)) else capture <= 0.05
        rust = model.get("rust_serve")
        if isinstance(rust, dict):
            for setting, rust_cell in rust.items():
                if isinstance(rust_cell, dict) and "rust_over_load_native" in rust_cell:
                    ratio = rust_cell["rust_over_load_native"]
                    out[f"{which}_rust_{setting}_over_load_native"] = ratio
                    goals[f"{which}_rust_{setting}"] = None if ratio is None else ratio <= 1.05
    out["goals_met"] = goals
    return out


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


#: The weights-once benchmark's denoiser (issue 33): ~506 M parameters (1.01 GB in bf16),
#: few layers so that each bucket's mint stays near a minute, four resolution buckets
#: of latents (one graph class each, batch 1), LoRAs of rank 16 on every attention projection.
DENOISER = {
    "block_out_channels": [512, 1024, 1408],
    "layers_per_block": 1,
    "cross_attention_dim": 768,
    "heads": 8,
    "tokens": 77,
    "buckets": [32, 48, 64, 80],
    "lora_rank": 16,
    "lora_targets": ["to_q", "to_k", "to_v", "to_out.0"],
}

WEIGHTS_ONCE_CHILD = (
    f"CFG = {DENOISER!r}\n"
    + """
import gc, inspect, json, os, statistics, sys, time
T0 = time.perf_counter()
mode, work = sys.argv[1], sys.argv[2]
OUT = {"mode": mode, "errors": {}}
CKPT = os.path.join(work, "denoiser.safetensors")
LORA = {n: os.path.join(work, f"lora-{n}") for n in ("a", "b")}
LORA_FILE = "pytorch_lora_weights.safetensors"
H0 = CFG["buckets"][0]
STATE = {}


def emit():
    # Every stage prints the result so far: a child that dies later still reports.
    print("TCG-JSON " + json.dumps(OUT, default=str), flush=True)


def step(name, fn):
    try:
        got = fn()
        if got is not None:
            OUT[name] = got
    except Exception as exc:
        import traceback

        OUT["errors"][name] = f"{type(exc).__name__}: {exc}"[:1500] + " | " + traceback.format_exc()[-1500:]
    emit()


def raw(name):
    with open(os.path.join(work, name), "rb") as f:
        return f.read()


def keys():
    with open(os.path.join(work, "keys.json")) as f:
        return {int(h): k for h, k in json.load(f).items()}


def resolve(h):
    from torch_compiled_graphs import Engine

    got = Engine(os.path.join(work, "store")).resolve(keys()[h], os.path.join(work, "r", f"{os.getpid()}-{h}"))
    assert got is not None, f"the store has no graph for h={h}"
    return got


def attr(obj, name):
    value = getattr(obj, name, None)
    return value() if callable(value) else value


def unet_kwargs():
    n = len(CFG["block_out_channels"])
    return dict(
        sample_size=64, in_channels=4, out_channels=4, block_out_channels=tuple(CFG["block_out_channels"]),
        layers_per_block=CFG["layers_per_block"],
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim=CFG["cross_attention_dim"], attention_head_dim=CFG["heads"], norm_num_groups=32,
    )


def denoiser_class():
    from diffusers import UNet2DConditionModel

    class Denoiser(UNet2DConditionModel):
        # One tensor out, no prefix on the weights' names (the checkpoint's and the LoRA's).
        def forward(self, sample, timestep, encoder_hidden_states):
            return super().forward(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    return Denoiser


def build():
    # Built on the meta device (instant), the checkpoint's tensors assigned on the GPU,
    # each its own allocation as a module's parameters are (not views into one buffer
    # at the file's offsets, which a graph could not bind in place).
    import torch
    from safetensors.torch import load_file

    with torch.device("meta"):
        unet = denoiser_class()(**unet_kwargs())
    state = {k: v.to("cuda", copy=True) for k, v in load_file(CKPT).items()}
    unet.load_state_dict(state, assign=True)
    return unet.eval().requires_grad_(False)


def weights_bytes(module):
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def torch_inputs(h):
    import torch

    d = torch.bfloat16
    s = torch.frombuffer(bytearray(raw(f"sample-{h}.bf16")), dtype=d).reshape(1, 4, h, h)
    t = torch.frombuffer(bytearray(raw("t.f32")), dtype=torch.float32).reshape(1)
    e = torch.frombuffer(bytearray(raw("ehs.bf16")), dtype=d).reshape(1, CFG["tokens"], CFG["cross_attention_dim"])
    return s.cuda(), t.cuda(), e.cuda()


def reference(h):
    from safetensors.torch import load_file

    return load_file(os.path.join(work, f"ref-{h}.safetensors"), device="cuda")["y"]


def max_diff(a, b):
    return float((a.float() - b.float()).abs().max())


def used():
    # Bytes in use on the device (the driver's count: the containers allocate outside
    # torch's caching allocator), torch's cached-but-free blocks released first.
    import torch

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def snapshot(base, **extra):
    import torch

    return {"used": used() - base, "allocated": int(torch.cuda.memory_allocated()), **extra}


def one_time():
    # What every process pays once before any baseline: the CUDA context, cuBLAS's
    # handle and workspace on the current stream, cuDNN's handle, SDPA's kernels.
    import torch

    d = torch.bfloat16
    x = torch.randn(256, 256, device="cuda", dtype=d)
    (x @ x).sum().item()
    w = torch.randn(8, 8, 3, 3, device="cuda", dtype=d)
    torch.nn.functional.conv2d(torch.randn(1, 8, 16, 16, device="cuda", dtype=d), w, padding=1).sum().item()
    q = torch.randn(1, 8, 64, 64, device="cuda", dtype=d)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().item()
    base = used()
    OUT["baseline_used"] = base
    return base


def timed_ms(fn):
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def no_capture(method):
    # The weights' memory without CUDA-graph pools (those hold activations, not weights).
    return {"cuda_graphs": False} if "cuda_graphs" in inspect.signature(method).parameters else {}


def native_set_class():
    import torch_compiled_graphs as tcg

    cls = getattr(tcg, "NativeWeightsSet", None)
    if cls is None:
        from torch_compiled_graphs import native

        cls = native.NativeWeightsSet  # AttributeError recorded when it does not exist yet
    return cls


def lora_timings(ws, out_of, label):
    # apply (after one untimed apply + remove: the file in the page cache, the set's
    # stream and its cuBLAS workspace made), replace back and forth, remove; ms, the
    # device synchronised around each, medians.
    ws.apply_lora(LORA["a"], name="a")
    ws.remove_lora()
    apply = []
    for i in range(5):
        apply.append(timed_ms(lambda: ws.apply_lora(LORA["a"], name="a")))
        if i < 4:
            ws.remove_lora()
    outs = {"a": out_of()}
    replace, cur = [], "a"
    for _ in range(6):
        nxt = "b" if cur == "a" else "a"
        replace.append(timed_ms(lambda nxt=nxt: ws.replace_lora(LORA[nxt], name=nxt)))
        cur = nxt
        outs.setdefault(cur, out_of())
    remove = timed_ms(ws.remove_lora)
    return {
        f"{label}apply_ms": apply,
        f"{label}apply_median_ms": statistics.median(apply),
        f"{label}replace_ms": replace,
        f"{label}replace_median_ms": statistics.median(replace),
        f"{label}remove_ms": remove,
    }, outs


if mode == "setup":
    def setup():
        import torch
        from safetensors.torch import save_file

        torch.manual_seed(0)
        with torch.device("cuda"):
            unet = denoiser_class()(**unet_kwargs())
        unet = unet.to(torch.bfloat16).eval().requires_grad_(False)
        params = sum(p.numel() for p in unet.parameters())
        state = {k: v.detach().contiguous() for k, v in unet.state_dict().items()}
        save_file(state, CKPT)
        g = torch.Generator().manual_seed(1)
        d = torch.bfloat16
        for h in CFG["buckets"]:
            sample = torch.randn(1, 4, h, h, generator=g).to(d)
            with open(os.path.join(work, f"sample-{h}.bf16"), "wb") as f:
                f.write(sample.view(torch.int16).numpy().tobytes())
        with open(os.path.join(work, "t.f32"), "wb") as f:
            f.write(torch.tensor([500.0]).numpy().tobytes())
        ehs = torch.randn(1, CFG["tokens"], CFG["cross_attention_dim"], generator=g).to(d)
        with open(os.path.join(work, "ehs.bf16"), "wb") as f:
            f.write(ehs.view(torch.int16).numpy().tobytes())
        got = {"parameters": params, "weights_bytes": weights_bytes(unet), "tensors": len(state)}
        OUT["checkpoint"] = got
        emit()
        # Two LoRAs made with PEFT (rank 16 on every attention projection, random A and B:
        # a real change of the outputs), saved as diffusers' save_lora_weights writes them.
        import diffusers
        from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

        rank = CFG["lora_rank"]
        for i, name in enumerate(("a", "b")):
            torch.manual_seed(100 + i)
            config = LoraConfig(r=rank, lora_alpha=rank, target_modules=CFG["lora_targets"], init_lora_weights=False)
            inject_adapter_in_model(config, unet, adapter_name=name)
            lora = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(unet, adapter_name=name).items()}
            diffusers.StableDiffusionPipeline.save_lora_weights(
                LORA[name], unet_lora_layers=lora, unet_lora_adapter_metadata=config.to_dict()
            )
            got[f"lora_{name}"] = {
                "targets": sum(1 for k in lora if k.endswith("lora_A.weight")),
                "nbytes": sum(v.numel() * v.element_size() for v in lora.values()),
            }
        return got

    step("checkpoint", setup)

elif mode == "mint":
    h = int(sys.argv[3])

    def mint():
        import torch
        from safetensors.torch import save_file

        from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

        unet = build()
        args = torch_inputs(h)
        t = time.perf_counter()
        # --weights-once-attention flash: exported with flash / memory-efficient
        # attention only (no cuDNN attention, whose plans are built per shape on
        # each bucket's first call): another graph, another key.
        from contextlib import nullcontext

        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = os.environ.get("TCG_BENCH_ATTENTION", "default")
        chosen = (
            sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
            if attention == "flash"
            else nullcontext()
        )
        with torch.no_grad(), chosen:
            program = torch.export.export(unet, args)
            export_s = time.perf_counter() - t
            major, minor = torch.cuda.get_device_capability()
            sm = f"sm_{major}{minor}"
            spec = GraphClassSpec(f"bench/denoiser/h={h},w={h}", "bench", program)
            toolchain = record_toolchain()
            key = RuntimeCompatibility(sm, toolchain=toolchain).key(spec.declare())
            result = Engine(os.path.join(work, "store")).ensure(
                key, os.path.join(work, f"minted-{h}"), target=sm, toolchain=toolchain, recipe=lambda: spec
            )
            mint_s = time.perf_counter() - t
            save_file({"y": unet(*args).cpu()}, os.path.join(work, f"ref-{h}.safetensors"))
        return {"key": str(key), "outcome": result.outcome.value, "export_s": export_s, "mint_s": mint_s}

    step("mint", mint)

elif mode == "module":
    # (a) the module alone, then module + graph.load(module) of one bucket.
    import torch

    base = one_time()

    def module():
        STATE["unet"] = build()
        return snapshot(base, weights_bytes=weights_bytes(STATE["unet"]))

    step("module", module)

    def eager():
        with torch.no_grad():
            y = STATE["unet"](*torch_inputs(H0))
        return snapshot(base, max_abs_diff_vs_reference=max_diff(y, reference(H0)))

    step("module_after_eager_call", eager)

    def plus_graph(h, key, capture):
        def run():
            stored = resolve(h)
            options = {} if capture else no_capture(stored.load)
            graph = stored.load(STATE["unet"], **options)
            STATE[key] = graph
            with torch.no_grad():
                for _ in range(3 if capture else 1):
                    y = graph(*torch_inputs(h))
            copied = [row["name"] for row in graph.copied_constants]
            return snapshot(base, h=h, options=options, copied_constants=copied, added_nbytes=graph.added_nbytes,
                            max_abs_diff_vs_eager=max_diff(y, reference(h)), runner=getattr(graph, "runner", None))
        return run

    step("module_plus_graph", plus_graph(H0, "g0", capture=False))
    # What a second graph of the same module (another bucket) adds: no one-time costs left.
    step("module_plus_two_graphs", plus_graph(CFG["buckets"][1], "g1", capture=False))
    # With CUDA graphs (the default): the capture's private pool holds the call's
    # activations; informative, not weights.
    step("plus_captured_graph", plus_graph(H0, "g2", capture=True))

elif mode == "set":
    # (b) WeightsSet(module) + four load(set), one per bucket.
    import torch

    from torch_compiled_graphs import WeightsSet

    base = one_time()

    def module():
        STATE["unet"] = build()
        return snapshot(base, weights_bytes=weights_bytes(STATE["unet"]))

    step("module", module)

    def weights_set():
        STATE["ws"] = WeightsSet(STATE["unet"])
        return snapshot(base, nbytes=STATE["ws"].nbytes, borrowed=STATE["ws"].borrowed)

    step("set", weights_set)
    for h in CFG["buckets"]:
        def bind(h=h):
            stored = resolve(h)
            graph = stored.load(STATE["ws"], **no_capture(stored.load))
            STATE[h] = graph
            with torch.no_grad():
                y = graph(*torch_inputs(h))
            copied = [row["name"] for row in graph.copied_constants]
            return snapshot(base, copied_constants=copied, added_nbytes=graph.added_nbytes,
                            max_abs_diff_vs_eager=max_diff(y, reference(h)))

        step(f"graph_h{h}", bind)

elif mode == "native-one":
    # (c), the baseline: one load_native(checkpoint) and its first call.
    import torch

    base = one_time()

    def one():
        stored = resolve(H0)
        options = no_capture(stored.load_native)
        graph = stored.load_native(CKPT, device="cuda:0", **options)
        STATE["g"] = graph
        y = torch.from_dlpack(graph(*torch_inputs(H0)))
        return snapshot(base, options=options, added_nbytes=attr(graph, "added_nbytes"),
                        max_abs_diff_vs_eager=max_diff(y, reference(H0)))

    step("load_native", one)

elif mode == "native-set":
    # (c) NativeWeightsSet(checkpoint) + four load_native(set); then a LoRA on the set.
    import torch

    base = one_time()

    def native_set():
        STATE["ws"] = native_set_class()(CKPT, device="cuda:0")
        ws = STATE["ws"]
        return snapshot(base, nbytes=attr(ws, "nbytes"), timings=attr(ws, "timings"))

    step("set", native_set)
    for h in CFG["buckets"]:
        def bind(h=h):
            stored = resolve(h)
            options = no_capture(stored.load_native)
            graph = stored.load_native(STATE["ws"], device="cuda:0", **options)
            STATE[h] = graph
            y = torch.from_dlpack(graph(*torch_inputs(h)))
            return snapshot(base, options=options, added_nbytes=attr(graph, "added_nbytes"),
                            max_abs_diff_vs_eager=max_diff(y, reference(h)))

        step(f"graph_h{h}", bind)

    def native_lora():
        ws, graph = STATE["ws"], STATE[H0]
        if not hasattr(ws, "apply_lora"):
            return {"skipped": "NativeWeightsSet has no apply_lora"}

        def out():
            return torch.from_dlpack(graph(*torch_inputs(H0))).clone()

        before = out()
        got, outs = lora_timings(ws, out, "")
        got["lora_changes_outputs"] = max_diff(outs["a"], before)
        got["restored_bitwise"] = bool(torch.equal(out(), before))
        torch_a = os.path.join(work, f"lora-a-out-{H0}.safetensors")
        if os.path.exists(torch_a):
            from safetensors.torch import load_file

            got["max_abs_diff_vs_torch_path_a"] = max_diff(outs["a"], load_file(torch_a, device="cuda")["y"])
        return got

    step("lora", native_lora)

elif mode == "lora":
    # (d) LoRA apply / replace on a WeightsSet bound by the four buckets' graphs (CUDA
    # graphs on, as served), against diffusers' load + fuse on the eager module.
    import torch
    from safetensors.torch import save_file

    from torch_compiled_graphs import WeightsSet

    one_time()

    def prepare():
        unet = build()
        STATE["unet"] = unet
        STATE["ws"] = WeightsSet(unet)
        STATE["graphs"] = {h: resolve(h).load(STATE["ws"]) for h in CFG["buckets"]}
        STATE["inputs"] = {h: torch_inputs(h) for h in CFG["buckets"]}
        steady = {}
        with torch.no_grad():
            for h, graph in STATE["graphs"].items():
                for _ in range(3):
                    graph(*STATE["inputs"][h])
                steady[h] = statistics.median(timed_ms(lambda: graph(*STATE["inputs"][h])) for _ in range(5))
        suffixes = tuple(f"{t}.weight" for t in CFG["lora_targets"])
        STATE["base"] = {k: v.clone() for k, v in unet.state_dict().items() if k.endswith(suffixes)}
        return {"call_ms": steady, "graphs": len(STATE["graphs"])}

    step("prepare", prepare)

    def ours():
        ws, graphs, inputs = STATE["ws"], STATE["graphs"], STATE["inputs"]

        def out():
            with torch.no_grad():
                return graphs[H0](*inputs[H0]).clone()

        with torch.no_grad():
            base_out = out()
            eager_base = STATE["unet"](*inputs[H0])
        got, outs = lora_timings(ws, out, "")
        # The first call of every graph after a swap (a refresh of folded constants or
        # a re-capture would show here), against its steady call.
        ws.replace_lora(LORA["a"], name="a")
        firsts = {}
        with torch.no_grad():
            for h, graph in graphs.items():
                firsts[h] = timed_ms(lambda graph=graph, h=h: graph(*inputs[h]))
            eager_a = STATE["unet"](*inputs[H0])  # the set borrows the module: fused there too
        got["first_call_after_swap_ms"] = firsts
        got["graph_vs_eager_max_abs_diff"] = {"base": max_diff(base_out, eager_base), "a": max_diff(outs["a"], eager_a)}
        got["lora_changes_outputs"] = max_diff(outs["a"], base_out)
        STATE["eager_a"] = eager_a
        save_file({"y": outs["a"].cpu()}, os.path.join(work, f"lora-a-out-{H0}.safetensors"))
        ws.remove_lora()
        with torch.no_grad():
            got["restored_outputs_bitwise"] = bool(torch.equal(out(), base_out))
        got["restored_weights_bitwise"] = all(
            torch.equal(STATE["unet"].get_parameter(k), v) for k, v in STATE["base"].items()
        )
        return got

    step("ours", ours)

    def eager_diffusers():
        unet, inputs = STATE["unet"], STATE["inputs"]
        STATE.pop("graphs", None)
        STATE.pop("ws", None)
        used()

        def load_fuse(which, name):
            unet.load_lora_adapter(LORA[which], weight_name=LORA_FILE, prefix="unet", adapter_name=name)
            unet.fuse_lora(lora_scale=1.0, adapter_names=[name])

        def unload(name):
            unet.unfuse_lora()
            unet.delete_adapters(name)

        load_fuse("a", "warm")  # peft's imports and first injection, untimed as ours
        unload("warm")
        apply = []
        for i in range(5):
            apply.append(timed_ms(lambda i=i: load_fuse("a", f"a{i}")))
            if i < 4:
                unload(f"a{i}")
        current, which = "a4", "a"
        with torch.no_grad():
            diffusers_a = unet(*inputs[H0])
        replace = []
        for i in range(6):
            nxt = "b" if which == "a" else "a"

            def swap(current=current, nxt=nxt, i=i):
                unload(current)
                load_fuse(nxt, f"{nxt}s{i}")

            replace.append(timed_ms(swap))
            current, which = f"{nxt}s{i}", nxt
        got = {
            "apply_ms": apply, "apply_median_ms": statistics.median(apply),
            "replace_ms": replace, "replace_median_ms": statistics.median(replace),
        }
        if "eager_a" in STATE:
            got["fused_a_vs_ours_eager_max_abs_diff"] = max_diff(diffusers_a, STATE["eager_a"])
        return got

    step("diffusers", eager_diffusers)

elif mode in ("cold-native", "cold-torch"):
    # (e) Cold start to the first outputs of n buckets' graphs from one checkpoint.
    n, how = int(sys.argv[3]), sys.argv[4]
    hs = CFG["buckets"][:n]

    def cold_native():
        from torch_compiled_graphs import Engine
        from torch_compiled_graphs.native import from_buffer

        engine = Engine(os.path.join(work, "store"))
        ks = keys()
        marks: dict[str, Any] = {"imported_s": time.perf_counter() - T0}
        stored = [engine.resolve(ks[h], os.path.join(work, "r", f"{os.getpid()}-{h}")) for h in hs]
        marks["resolved_s"] = time.perf_counter() - T0
        t = from_buffer(raw("t.f32"), "float32", [1], device="cuda:0")
        e = from_buffer(raw("ehs.bf16"), "bfloat16", [1, CFG["tokens"], CFG["cross_attention_dim"]], device="cuda:0")
        if how == "set-threads":
            # Each bucket loaded and first called on a thread of its own (the loads and
            # the calls release the GIL): extraction, dlopen, containers and the
            # kernels' loading overlap.
            from concurrent.futures import ThreadPoolExecutor

            ws = native_set_class()(CKPT, device="cuda:0")
            marks["set_s"] = time.perf_counter() - T0
            marks["set_timings"] = dict(ws.timings)
            graph_timings: list[dict[str, float]] = []

            def bucket(pair):
                h, s = pair
                x = from_buffer(raw(f"sample-{h}.bf16"), "bfloat16", [1, 4, h, h], device="cuda:0")
                graph = s.load_native(ws, device="cuda:0")
                y = graph(x, t, e).cpu()
                graph_timings.append(dict(graph.timings))
                return y

            with ThreadPoolExecutor(len(stored)) as pool:
                outs = list(pool.map(bucket, zip(hs, stored)))
        else:
            if how == "set":
                ws = native_set_class()(CKPT, device="cuda:0")
                marks["set_s"] = time.perf_counter() - T0
                marks["set_timings"] = dict(ws.timings)
                graphs = [s.load_native(ws, device="cuda:0") for s in stored]
            else:
                graphs = [s.load_native(CKPT, device="cuda:0") for s in stored]
            marks["loaded_s"] = time.perf_counter() - T0
            outs = []
            for h, graph in zip(hs, graphs):
                x = from_buffer(raw(f"sample-{h}.bf16"), "bfloat16", [1, 4, h, h], device="cuda:0")
                outs.append(graph(x, t, e).cpu())  # waits for the graph
            graph_timings = [dict(g.timings) for g in graphs]
        ttfo = time.perf_counter() - T0
        import numpy as np

        finite = all(bool(((np.asarray(y).view(np.uint16) & 0x7F80) != 0x7F80).all()) for y in outs)
        return {
            "ttfo_s": ttfo, "finite": finite, "torch_imported": "torch" in sys.modules,
            "marks": marks, "graph_timings": graph_timings,
        }

    def cold_torch():
        import torch

        from torch_compiled_graphs import Engine, WeightsSet

        engine = Engine(os.path.join(work, "store"))
        ks = keys()
        stored = [engine.resolve(ks[h], os.path.join(work, "r", f"{os.getpid()}-{h}")) for h in hs]
        if how == "set-threads":
            # As the native way of that name: each bucket loaded and first called on a
            # thread of its own, from one set.
            from concurrent.futures import ThreadPoolExecutor

            ws = WeightsSet(CKPT, device="cuda:0")

            def bucket(pair):
                h, s = pair
                graph = s.load(ws)
                with torch.no_grad():
                    y = graph(*torch_inputs(h))
                torch.cuda.current_stream().synchronize()
                return y.cpu()

            with ThreadPoolExecutor(len(stored)) as pool:
                outs = list(pool.map(bucket, zip(hs, stored)))
        else:
            if how == "set":
                ws = WeightsSet(CKPT, device="cuda:0")
                graphs = [s.load(ws) for s in stored]
            else:
                graphs = [s.load(CKPT, device="cuda:0") for s in stored]
            outs = []
            with torch.no_grad():
                for h, graph in zip(hs, graphs):
                    outs.append(graph(*torch_inputs(h)).cpu())
        ttfo = time.perf_counter() - T0
        return {"ttfo_s": ttfo, "finite": all(bool(torch.isfinite(y).all()) for y in outs)}

    step("cold", cold_native if mode == "cold-native" else cold_torch)
else:
    OUT["errors"]["mode"] = f"unknown mode {mode}"
    emit()
"""
)


def run_child(code: str, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one child; its last ``TCG-JSON`` line is its result (the stages it finished,
    each with its figures or its error), with ``error`` added when it failed or ran
    past ``timeout`` seconds. Never raises: a crash is recorded, not fatal."""
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout
        )
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:

        def text(v: object) -> str:
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v or "")

        stdout, stderr, rc = text(exc.stdout), text(exc.stderr), None
    out: dict[str, Any] = {}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("TCG-JSON ")]
    if lines:
        try:
            out = json.loads(lines[-1].removeprefix("TCG-JSON "))
        except ValueError as exc:
            out = {"error": f"unreadable result: {exc}"}
    out["wall_s"] = time.perf_counter() - t
    if rc != 0:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}"
        out["error"] = f"{why}: {stderr[-3000:]}"
    if out.get("errors") and "error" not in out:
        out["error"] = "a stage failed: " + ", ".join(sorted(out["errors"]))
    return out


def _ratio(num: object, den: object) -> float | None:
    if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den:
        return float(num) / float(den)
    return None


def _dig(d: object, *path: str) -> object:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def weights_once_ratios(r: dict[str, Any]) -> dict[str, Any]:
    """The goals of issue 33's benchmark, as its text states them, from :func:`weights_once`'s
    stages (``None`` where a stage failed)."""
    last = str(DENOISER["buckets"][-1])  # type: ignore[index]
    weights = _dig(r, "setup", "checkpoint", "weights_bytes")
    out: dict[str, Any] = {
        # (a) module + graph.load(module) of one bucket over the module alone (goal <= 1.05).
        "a_module_plus_graph_over_module": _ratio(
            _dig(r, "module", "module_plus_graph", "used"), _dig(r, "module", "module", "used")
        ),
        # The same over the module after an eager call (its one-time costs paid).
        "a_module_plus_graph_over_module_after_call": _ratio(
            _dig(r, "module", "module_plus_graph", "used"), _dig(r, "module", "module_after_eager_call", "used")
        ),
        # (b) WeightsSet(module) + four load(set) over one bucket (the module and its
        # graph: the weights as one bucket holds them in memory; goal <= 1.05), and over
        # the raw weight bytes (the module's own allocation rounding included).
        "b_set_plus_four_over_one_bucket": _ratio(
            _dig(r, "set", f"graph_h{last}", "used"), _dig(r, "module", "module_plus_graph", "used")
        ),
        "b_set_plus_four_graphs_over_weights": _ratio(_dig(r, "set", f"graph_h{last}", "used"), weights),
        # (c) NativeWeightsSet + four load_native(set) over one load_native(checkpoint).
        "c_native_set_plus_four_over_one_load_native": _ratio(
            _dig(r, "native_set", f"graph_h{last}", "used"), _dig(r, "native_one", "load_native", "used")
        ),
        "c_native_set_plus_four_over_weights": _ratio(_dig(r, "native_set", f"graph_h{last}", "used"), weights),
        # (d) LoRA rank 16, ms (goal <= 50), and diffusers' load + fuse over ours.
        "d_apply_ms": _dig(r, "lora", "ours", "apply_median_ms"),
        "d_replace_ms": _dig(r, "lora", "ours", "replace_median_ms"),
        "d_diffusers_apply_ms": _dig(r, "lora", "diffusers", "apply_median_ms"),
        "d_diffusers_replace_ms": _dig(r, "lora", "diffusers", "replace_median_ms"),
        "d_native_apply_ms": _dig(r, "native_set", "lora", "apply_median_ms"),
        "d_native_replace_ms": _dig(r, "native_set", "lora", "replace_median_ms"),
    }
    out["d_diffusers_over_ours_apply"] = _ratio(out["d_diffusers_apply_ms"], out["d_apply_ms"])
    out["d_diffusers_over_ours_replace"] = _ratio(out["d_diffusers_replace_ms"], out["d_replace_ms"])
    # (e) cold start of four buckets from one checkpoint over one bucket's (goal <= 1.2).
    cold = _dig(r, "cold", "median_ttfo_s")
    if isinstance(cold, dict):
        out["e_native_set4_over_native1"] = _ratio(cold.get("native-set-4"), cold.get("native-direct-1"))
        out["e_native_set4_over_native_set1"] = _ratio(cold.get("native-set-4"), cold.get("native-set-1"))
        out["e_native_set4_threads_over_native1"] = _ratio(
            cold.get("native-set-4-threads"), cold.get("native-direct-1")
        )
        out["e_native_direct4_over_native1"] = _ratio(cold.get("native-direct-4"), cold.get("native-direct-1"))
        out["e_torch_set4_over_torch1"] = _ratio(cold.get("torch-set-4"), cold.get("torch-direct-1"))
        out["e_torch_set4_over_torch_set1"] = _ratio(cold.get("torch-set-4"), cold.get("torch-set-1"))
        out["e_torch_set4_threads_over_torch1"] = _ratio(cold.get("torch-set-4-threads"), cold.get("torch-direct-1"))
    goals = {
        "a_module_plus_graph_over_module": 1.05,
        "b_set_plus_four_over_one_bucket": 1.05,
        "c_native_set_plus_four_over_one_load_native": 1.05,
        "d_apply_ms": 50.0,
        "d_replace_ms": 50.0,
        "d_native_apply_ms": 50.0,
        "d_native_replace_ms": 50.0,
        "e_native_set4_over_native1": 1.2,
        "e_native_set4_threads_over_native1": 1.2,
        "e_torch_set4_over_torch1": 1.2,
        "e_torch_set4_threads_over_torch1": 1.2,
    }
    out["goals_met"] = {k: (None if not isinstance(out.get(k), float) else bool(out[k] <= g)) for k, g in goals.items()}
    return out


WEIGHTS_ONCE_STAGES = ("module", "set", "lora", "native", "cold")


def weights_once(
    site: Path,
    work: Path,
    result: dict[str, Any],
    save: Callable[[], None],
    repeat: int,
    stages: tuple[str, ...] = WEIGHTS_ONCE_STAGES,
    attention: str = "default",
    cold_ways: tuple[str, ...] = (),
) -> None:
    """Issue 33's benchmark (``--weights-once``): a ~1 GB bf16 denoiser in four resolution
    buckets, minted in parallel (reused when ``work`` already holds them: ``--weights-once-work``),
    then each measurement in a fresh process; ``result`` filled stage by stage and ``save``d
    after each. Memory is the driver's count (``mem_get_info``, torch's cache emptied) above a
    baseline taken after the process's one-time costs; times in ms with the device synchronised."""
    from concurrent.futures import ThreadPoolExecutor

    work.mkdir(parents=True, exist_ok=True)
    env = child_env(site)
    env["TCG_BENCH_ATTENTION"] = attention
    result["config"] = {**DENOISER, "attention": attention}
    result["note"] = (
        "memory: bytes in use on the device (mem_get_info after empty_cache) above a baseline taken after "
        "the CUDA context, cuBLAS, cuDNN and SDPA were first used; graphs loaded without CUDA graphs for the "
        "memory figures (a capture's pool holds activations, not weights; plus_captured_graph shows it); "
        "LoRA: ms with the device synchronised around each, medians (apply of 5, replace of 6 back and forth); "
        "cold start: in-process time from before the first import to every graph's output on the host, "
        f"medians of {repeat} fresh processes per way, interleaved"
    )

    def child(mode: str, *args: str, timeout: float = 420) -> dict[str, Any]:
        return run_child(WEIGHTS_ONCE_CHILD, [mode, str(work), *args], env, timeout)

    setup_file = work / "setup.json"
    if setup_file.exists():
        result["setup"] = json.loads(setup_file.read_text())
        result["setup"]["reused"] = True
    else:
        result["setup"] = child("setup")
        if "error" not in result["setup"]:
            setup_file.write_text(json.dumps(result["setup"]))
    print(json.dumps({"weights_once_setup": result["setup"]}, default=str), flush=True)
    save()
    if "error" in result["setup"]:
        return

    buckets = [int(h) for h in DENOISER["buckets"]]  # type: ignore[attr-defined]
    keys_file = work / "keys.json"
    known = json.loads(keys_file.read_text()) if keys_file.exists() else {}
    missing = [h for h in buckets if str(h) not in known]
    if missing:
        # Each in its own process, in parallel: AOTInductor's compile is mostly one core.
        with ThreadPoolExecutor(max_workers=len(missing)) as pool:
            minted = dict(zip(missing, pool.map(lambda h: child("mint", str(h), timeout=480), missing), strict=True))
        result["mint"] = {str(h): m for h, m in minted.items()}
        for h, m in minted.items():
            key = _dig(m, "mint", "key")
            if isinstance(key, str):
                known[str(h)] = key
        keys_file.write_text(json.dumps(known))
    else:
        result["mint"] = {"reused": known}
    print(json.dumps({"weights_once_mint": result["mint"]}, default=str), flush=True)
    save()
    if any(str(h) not in known for h in buckets):
        result["error"] = "a bucket's mint failed (see mint)"
        return

    def record(name: str, got: dict[str, Any]) -> None:
        result[name] = got
        result["ratios"] = weights_once_ratios(result)
        print(json.dumps({f"weights_once_{name}": got}, default=str), flush=True)
        save()

    if "module" in stages:
        record("module", child("module"))
    if "set" in stages:
        record("set", child("set"))
    if "lora" in stages:
        record("lora", child("lora"))
    if "native" in stages:
        record("native_one", child("native-one"))
        record("native_set", child("native-set"))
    if "cold" in stages:
        ways = {
            "native-direct-1": ("cold-native", "1", "direct"),
            "native-set-1": ("cold-native", "1", "set"),
            "native-set-4": ("cold-native", "4", "set"),
            "native-set-4-threads": ("cold-native", "4", "set-threads"),
            "native-direct-4": ("cold-native", "4", "direct"),
            "torch-direct-1": ("cold-torch", "1", "direct"),
            "torch-set-1": ("cold-torch", "1", "set"),
            "torch-set-4": ("cold-torch", "4", "set"),
            "torch-set-4-threads": ("cold-torch", "4", "set-threads"),
        }
        if cold_ways:
            ways = {w: a for w, a in ways.items() if w in cold_ways}
        samples: dict[str, list[float]] = {w: [] for w in ways}
        errors: dict[str, str] = {}
        cold: dict[str, Any] = {"samples_ttfo_s": samples, "errors": errors}
        # One untimed round first (page cache, bytecode caches), then interleaved rounds,
        # every other one reversed.
        for i in range(repeat + 1):
            order = list(ways.items())
            if i % 2:
                order.reverse()
            for way, argv in order:
                if way in errors:
                    continue
                got = child(*argv, timeout=180)
                ttfo = _dig(got, "cold", "ttfo_s")
                if "error" in got or not isinstance(ttfo, (int, float)) or not _dig(got, "cold", "finite"):
                    errors[way] = json.dumps({k: got.get(k) for k in ("error", "errors", "cold")}, default=str)[-3000:]
                elif i > 0:
                    samples[way].append(float(ttfo))
                    # The phases of the latest sample of each way: where its time went.
                    cold.setdefault("phases", {})[way] = {k: _dig(got, "cold", k) for k in ("marks", "graph_timings")}
            cold["median_ttfo_s"] = {w: statistics.median(s) for w, s in samples.items() if s}
            record("cold", cold)
    result["ratios"] = weights_once_ratios(result)
    save()


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
    parser.add_argument(
        "--graphs-autotune", action="store_true", help="the UNet at batch 8 against max-autotune (graphs_autotune)"
    )
    parser.add_argument("--coldstart", action="store_true", help="run the cold-start benchmark (scripts/coldstart.py)")
    parser.add_argument(
        "--weights-once", action="store_true", help="benchmark weights once and LoRA swaps (weights_once, issue 33)"
    )
    parser.add_argument(
        "--weights-once-work",
        help="where the denoiser's checkpoint, LoRAs and four minted buckets go (default: a temporary folder); "
        "a folder from an earlier run is reused (no setup, no mint), so the stages can be split across commands",
    )
    parser.add_argument(
        "--weights-once-attention",
        choices=("default", "flash"),
        default="default",
        help="export the denoiser's buckets with the attention torch picks (default) or with flash / "
        "memory-efficient attention only (flash: no per-shape cuDNN attention plans on first calls)",
    )
    parser.add_argument(
        "--weights-once-stages",
        default=",".join(WEIGHTS_ONCE_STAGES),
        help=f"the measurements to run after setup and mint (default: all of {','.join(WEIGHTS_ONCE_STAGES)}; "
        "'none' only sets up and mints)",
    )
    parser.add_argument(
        "--weights-once-cold-ways",
        default="",
        help="the cold stage's ways, comma-separated (default: all; e.g. torch-direct-1,torch-set-4-threads)",
    )
    parser.add_argument("--sizes", default="small,large", help="the cold-start models (small: 0.8 GB, large: 13 GB)")
    parser.add_argument("--coldstart-work", help="where the cold-start models go (default: a temporary folder)")
    parser.add_argument(
        "--native-only",
        action="store_true",
        help="benchmark only our two loads (no plain compile, warm torch.compile or aoti_load_package)",
    )
    parser.add_argument(
        "--shim", action="store_true", help="issue 34's shim stage (scripts/shim_e2e.py): OUT/shim.json"
    )
    parser.add_argument(
        "--shim-only", help=f"comma-separated steps of the shim stage (default: all of {','.join(shim_e2e.STEPS)})"
    )
    parser.add_argument("--shim-test-bin", help="the tcg-shim cuda_device test binary (cargo test --no-run)")
    parser.add_argument("--shim-sizes", default="small", help="the shim stage's cold-start models (small,large)")
    parser.add_argument("--shim-models", help="comma-separated models of the shim stage (default: by device)")
    parser.add_argument(
        "--shim-work",
        help="where the shim stage's mints go (default: a temporary folder); a folder from an earlier run is "
        "reused (no re-mint), so the steps can be split across commands",
    )
    parser.add_argument("--shim-jobs", type=int, default=16, help="mints of the shim stage at once")
    parser.add_argument(
        "--shim-budget",
        type=float,
        default=540.0,
        help="seconds for the shim stage: steps not started by then are recorded as skipped",
    )
    parser.add_argument(
        "--device", default="cuda:0", help="the shim stage's device (cpu: its rehearsal on a machine without a GPU)"
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
        (args.out / "cuda-e2e.json").write_text(json.dumps(report, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="tcg-cuda-e2e-") as tmp:
        site = Path(tmp) / "site"
        install(wheels[0], site)
        if not args.no_tests and not args.realmodels:
            report["tests"] = run_tests(site, args.out)
            print(json.dumps({"tests": report["tests"]}), flush=True)
            save()
        if args.shim:
            steps = tuple(args.shim_only.split(",")) if args.shim_only else shim_e2e.STEPS
            unknown = sorted(set(steps) - set(shim_e2e.STEPS))
            if unknown:
                raise SystemExit(f"--shim-only: unknown steps {unknown}; the steps are {','.join(shim_e2e.STEPS)}")
            opts = shim_e2e.Options(
                device=args.device,
                out=args.out,
                work=Path(args.shim_work) if args.shim_work else Path(tmp) / "shim",
                wheel=os.path.abspath(wheels[0]),
                steps=steps,
                models=tuple(args.shim_models.split(",")) if args.shim_models else (),
                test_bin=os.path.abspath(args.shim_test_bin) if args.shim_test_bin else None,
                serve_bin=SERVE_BIN[0] if SERVE_BIN else None,
                cxx=args.cxx,
                repeat=args.repeat,
                sizes=args.shim_sizes,
                jobs=args.shim_jobs,
                budget_s=args.shim_budget,
            )
            shim = shim_e2e.shim_stage(site, opts, child_env, save)
            report["shim"] = shim["summary"]
            print(json.dumps({"shim": shim["summary"]}, indent=1, default=str), flush=True)
            failed_steps = [k for k in shim_e2e.STEPS if isinstance(shim.get(k), dict) and "error" in shim[k]]
            failed_steps += shim_e2e.failed_checks(shim["summary"])
            if failed_steps:
                report["bench_error"] = f"shim: {', '.join(failed_steps)} failed (see shim.json)"
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
            print(json.dumps({"graphs": graphs}, indent=1, default=str), flush=True)
            if any(isinstance(v, dict) and "error" in v for v in graphs.values()):
                report["bench_error"] = "graphs: a model failed (see graphs)"
        if args.graphs_autotune:
            tuned: dict[str, object] = {}
            report["graphs_autotune"] = tuned

            def save_tuned() -> None:
                (args.out / "cuda-graphs-autotune.json").write_text(json.dumps(tuned, indent=1, default=str))
                save()

            graphs_autotune(site, Path(tmp) / "graphs", tuned, save_tuned)
            print(json.dumps({"graphs_autotune": tuned}, indent=1, default=str), flush=True)
        if args.weights_once:
            once: dict[str, Any] = {}
            report["weights_once"] = once

            def save_once() -> None:
                (args.out / "weights-once.json").write_text(json.dumps(once, indent=1, default=str))
                save()

            stages = tuple(x for x in args.weights_once_stages.split(",") if x in WEIGHTS_ONCE_STAGES)
            cold_ways = tuple(x for x in args.weights_once_cold_ways.split(",") if x)
            once_work = Path(args.weights_once_work) if args.weights_once_work else Path(tmp) / "weights-once"
            try:
                weights_once(
                    site, once_work, once, save_once, args.repeat, stages, args.weights_once_attention, cold_ways
                )
            except Exception as exc:  # recorded, and the run fails below
                once["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
            save_once()
            print(json.dumps({"weights_once_ratios": once.get("ratios")}, indent=1, default=str), flush=True)
            failed_stages = [k for k, v in once.items() if isinstance(v, dict) and "error" in v]
            if "error" in once or failed_stages:
                report["bench_error"] = f"weights_once: {once.get('error') or ', '.join(failed_stages)} failed"
        if not args.no_bench:
            work = Path(tmp) / "bench"
            work.mkdir()
            report["bench"] = {}
            try:
                bench(site, work, args.repeat, report["bench"], save, native_only=args.native_only)  # type: ignore[arg-type]
            except Exception as exc:  # recorded, and the run fails below
                report["bench_error"] = f"{type(exc).__name__}: {exc}"
    save()
    print(json.dumps(report, indent=1, default=str))
    tests = report.get("tests")
    failed = isinstance(tests, dict) and (tests["returncode"] != 0 or tests["passed"] == 0)
    if failed or "bench_error" in report:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
