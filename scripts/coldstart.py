"""Cold start against the hardware floor, in one run: how long a fresh worker
waits for its first output once the compile is cached, for a ~0.8 GB and a
~13 GB model (stacks of 8 bf16 transformer blocks, dim 2048 and 8192).

    python3 scripts/coldstart.py --out OUT [--device cuda:0|cpu] [--sizes small,large]
        [--repeat 3] [--serve-bin target/release/examples/serve] [--cxx /usr/bin/g++]
        [--variant shim-v1 --runtime shim] [--ways native,native_variant,...] [--work DIR [--mint-only]]

Measured in the same run, each in fresh processes, medians of ``--repeat``,
the ways interleaved round by round (every other round reversed):

- the floor: creating the CUDA context (driver API, nothing else), reading the
  weights file from the page cache with as many threads as the pipeline uses,
  and copying that many bytes host-to-device from pinned memory at the
  bandwidth measured here. On the CPU the floor is the read alone.
- ``native``: ``import torch_compiled_graphs`` + ``resolve`` + ``load_native``
  + first call, output on the host (torch never imported);
- ``torch_load_file``: ``import torch`` + ``safetensors.torch.load_file`` onto
  the device + synchronize (the weights there, nothing run);
- ``torch_load``: ``import torch`` + ``resolve`` + ``load(path)`` + first call;
- ``rust``: the ``serve`` example (``--serve-bin``), resolve to output on the host;
- ``libraries``: libtorch's libraries opened alone in a fresh process, as the
  native path opens them: not part of the floor, but what running any
  AOTInductor graph must load first (reported as a second ratio);
- with ``--variant shim-v1`` (issue 34), each model is also minted as the
  libtorch-free variant, and ``native_variant`` (and, with ``--serve-bin``,
  ``rust_variant``) run its graph on ``--runtime`` (default ``shim``): the
  libtorch-free path, against ``native`` (the default variant, on libtorch)
  and the floor. A variant the model cannot be minted as is recorded
  (``variant_refused``: its code and the ops it names) and its ways skipped.
  The native ways record their ``runtime`` and the libtorch libraries mapped
  in their process (``libtorch_mapped``).

``--ways`` measures a subset; ``--mint-only`` mints and writes the models'
files into ``--work`` and stops, and a later run with the same ``--work``
reuses them (the shim stage of ``scripts/cuda_e2e.py`` mints them beside its
own mints).

Each figure is measured inside its process, from before its first import to
the output (interpreter start-up, the same for every way, is left out). The
native way also records its ``timings`` (the phases of the load) and the
steady-state call latency, against the torch-based load's. Writes
``OUT/coldstart.json`` after every measurement (a partial run still reports).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"tiny": {"dim": 256, "blocks": 2}, "small": {"dim": 2048, "blocks": 8}, "large": {"dim": 8192, "blocks": 8}}
SEQ = 64

MODEL = r"""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.heads = dim // 128
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Stack(nn.Module):
    def __init__(self, dim, blocks):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(blocks)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
"""

MINT = (
    MODEL
    + r"""
import json, os, sys, time
work, dim, blocks, seq, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
# The variant minted (docs/keys.md, "Variants"); only the default's child writes the files.
variant = sys.argv[6] if len(sys.argv) > 6 else "default"
from safetensors.torch import save_file
from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs.errors import CompileError
dtype = torch.bfloat16 if device != "cpu" else torch.float32
with torch.device("meta"):
    model = Stack(dim, blocks)
model = model.to_empty(device=device).to(dtype).eval()
gen = torch.Generator(device=device).manual_seed(0)
with torch.no_grad():
    # A trained transformer's residual scale (GPT-2's init: the projections into the
    # residual stream scaled by 1/sqrt(2 * blocks)), so that the bf16 stack stays within
    # the mint's parity tolerance: with N(0, 0.02) everywhere the stream grows block by
    # block and bf16 rounding alone (eager against any compiled graph) exceeded it.
    for name, p in model.named_parameters():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            std = 0.5 / p.shape[-1] ** 0.5
            if name.endswith("proj.weight") or name.endswith("fc2.weight"):
                std /= (2 * blocks) ** 0.5
            p.normal_(0.0, std, generator=gen)
    x = torch.randn(1, seq, dim, device=device, dtype=dtype, generator=gen)
    y = model(x)
t = time.perf_counter()
if variant == "default":
    save_file(model.state_dict(), os.path.join(work, "weights.safetensors"))
    save_file({"x": x.cpu(), "y": y.cpu()}, os.path.join(work, "io.safetensors"))
write_s = time.perf_counter() - t
program = torch.export.export(model, (x,))
if device == "cpu":
    sm = "cpu"
else:
    major, minor = torch.cuda.get_device_capability()
    sm = f"sm_{major}{minor}"
toolchain = record_toolchain(variant=variant)
spec = GraphClassSpec(f"coldstart/stack-{dim}", "bench", program)
t = time.perf_counter()
key = RuntimeCompatibility(sm, toolchain=toolchain).key(spec.declare())
dest = os.path.join(work, "minted" if variant == "default" else f"minted-{variant}")
try:
    result = Engine(os.path.join(work, "store")).ensure(
        key, dest, target=sm, toolchain=toolchain, recipe=lambda: spec, variant=variant
    )
except CompileError as e:
    if variant == "default":
        raise
    # A variant the graph cannot be minted as: a result (its code and the ops it names).
    print(json.dumps({"key": str(key), "variant": variant, "refused": e.code, "message": str(e)[:3000],
                      "mint_s": time.perf_counter() - t}))
    sys.exit(0)
weights = os.path.join(work, "weights.safetensors")
print(json.dumps({"key": str(key), "variant": variant, "outcome": result.outcome.value,
                  "mint_s": time.perf_counter() - t, "write_s": write_s,
                  "bytes": os.path.getsize(weights) if variant == "default" else None}))
"""
)

CTX = r"""
import ctypes, json, os, time
os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")  # as load_native does
t0 = time.perf_counter()
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
init = time.perf_counter() - t0
dev = ctypes.c_int()
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
print(json.dumps({"s": time.perf_counter() - t0, "init_s": init}))
"""

READ = r"""
import json, os, sys, threading, time
path, threads = sys.argv[1], int(sys.argv[2])
size = os.path.getsize(path)
chunk = 4 << 20
# Each thread reads into one buffer of its own, reused (as the pipeline reuses
# its ring): what is timed is the page cache's read, not allocating and
# faulting in a buffer the size of the file.
buffers = [bytearray(chunk) for _ in range(threads)]
fd = os.open(path, os.O_RDONLY)
next_chunk = iter(range(0, size, chunk))
lock = threading.Lock()
def reader(buf):
    view = memoryview(buf)
    while True:
        with lock:
            start = next(next_chunk, None)
        if start is None:
            return
        n = min(chunk, size - start)
        if os.preadv(fd, [view[:n]], start) != n:
            raise OSError("short read")
t0 = time.perf_counter()
workers = [threading.Thread(target=reader, args=(b,)) for b in buffers]
for w in workers:
    w.start()
for w in workers:
    w.join()
s = time.perf_counter() - t0
print(json.dumps({"s": s, "bytes": size, "bandwidth": size / s}))
"""

H2D = r"""
import json, sys, time
import torch
size = int(sys.argv[1])
n = min(size, 1 << 30)
src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
src.fill_(1)
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
best = None
for _ in range(3):
    t = time.perf_counter(); dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    s = time.perf_counter() - t
    best = s if best is None else min(best, s)
print(json.dumps({"bandwidth": n / best, "s": size / (n / best)}))
"""

#: libtorch's libraries opened as the native path opens them (``RTLD_NOW |
#: RTLD_GLOBAL``) in a fresh process and nothing else: what running any
#: AOTInductor graph has to load, reported beside the floor (not in it).
LIBRARIES = r"""
import ctypes, json, os, sys, time
t0 = time.perf_counter()
lib = sys.argv[1]
mode = {"now": os.RTLD_NOW, "lazy": os.RTLD_LAZY}[sys.argv[2] if len(sys.argv) > 2 else "now"]
for name in ["libtorch_cpu.so", "libtorch.so", "libtorch_cuda.so"]:
    if os.path.exists(os.path.join(lib, name)):
        ctypes.CDLL(os.path.join(lib, name), mode=mode | os.RTLD_GLOBAL)
print(json.dumps({"s": time.perf_counter() - t0}))
"""

#: The torch-free way: no torch imported and no libtorch opened by the harness either
#: (the input is made from raw bytes and handed over through DLPack, on the host: the
#: graph copies it to the device; ``from_buffer`` would open libtorch to allocate).
#: The runtime is ``$TORCH_COMPILED_GRAPHS_RUNTIME``'s (``--runtime`` for the variant's way).
NATIVE = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
    + r"""
import json, os, time
t0 = time.perf_counter()
work, key, device, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from torch_compiled_graphs import Engine
import torchfree_io
graph = Engine(os.path.join(work, "store")).resolve(key, os.path.join(work, "r", str(os.getpid())))
native = graph.load_native(os.path.join(work, "weights.safetensors"), device=device)
io = torchfree_io.read_safetensors(os.path.join(work, "io.safetensors"))
dtype, shape, raw = io["x"]
xin = torchfree_io.RawTensor(raw, dtype, shape, "cpu")
y = native(xin)
y = y if y.device == "cpu" else y.cpu()  # the first output, on the host
t1 = time.perf_counter()
assert "torch" not in sys.modules
# The check's own imports (numpy), after the clock: a worker need not import them to serve.
_, _, host = torchfree_io.host_tensor(y)
import numpy as np
maps = torchfree_io.mapped_libraries()
out = {"s": t1 - t0, "timings": native.timings, "runtime": native.runtime, "runtime_reason": native.runtime_reason,
       "libtorch_mapped": maps["libtorch"]}
def f32(b, dtype):
    if dtype == "bfloat16":
        return (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(b, np.float32)
out["max_abs_err"] = float(np.abs(f32(host, dtype) - f32(io["y"][2], io["y"][0])).max())
if calls:
    wait, out["synchronize"] = torchfree_io.synchronizer(native)
    xdev = torchfree_io.RawTensor(raw, dtype, shape, device)  # on the device once, as a server keeps it
    for _ in range(10):
        native(xdev)
    wait()
    lat = []
    for _ in range(calls):
        t = time.perf_counter(); native(xdev); wait(); lat.append(time.perf_counter() - t)
    out["call_median_s"] = sorted(lat)[len(lat) // 2]
print(json.dumps(out))
"""
)

TORCH_LOAD_FILE = r"""
import json, os, sys, time
t0 = time.perf_counter()
work, device = sys.argv[1], sys.argv[2]
import torch
from safetensors.torch import load_file
w = load_file(os.path.join(work, "weights.safetensors"), device=device)
if device != "cpu":
    torch.cuda.synchronize()
print(json.dumps({"s": time.perf_counter() - t0, "tensors": len(w)}))
"""

TORCH_LOAD = r"""
import json, os, sys, time
t0 = time.perf_counter()
work, key, device, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import torch
from torch_compiled_graphs import Engine
from safetensors.torch import load_file
graph = Engine(os.path.join(work, "store")).resolve(key, os.path.join(work, "r", str(os.getpid())))
run = graph.load(os.path.join(work, "weights.safetensors"), device=device)
io = load_file(os.path.join(work, "io.safetensors"))
x = io["x"].to(device)
with torch.no_grad():
    y = run(x).cpu()
t1 = time.perf_counter()
out = {"s": t1 - t0, "timings": run.timings,
       "max_abs_err": float((y.float() - io["y"].float()).abs().max())}
if calls:
    with torch.no_grad():
        for _ in range(10):
            run(x)
        if device != "cpu":
            torch.cuda.synchronize()
        lat = []
        for _ in range(calls):
            t = time.perf_counter(); run(x)
            if device != "cpu":
                torch.cuda.synchronize()
            lat.append(time.perf_counter() - t)
    out["call_median_s"] = sorted(lat)[len(lat) // 2]
print(json.dumps(out))
"""


REFUSALS = r"""
import json, os, sys
work, key, device = sys.argv[1], sys.argv[2], sys.argv[3]
from torch_compiled_graphs import Engine
from torch_compiled_graphs.errors import BindingError
graph = Engine(os.path.join(work, "store")).resolve(key, os.path.join(work, "r", "refusals"))
good = os.path.join(work, "weights.safetensors")
cut = os.path.join(work, "cut.safetensors")
with open(good, "rb") as src, open(cut, "wb") as dst:
    dst.write(src.read(os.path.getsize(good) - 4096))
out = {}
for name, call in [("load_native", graph.load_native), ("load", graph.load)]:
    try:
        call(cut, device=device)
        out[name] = "loaded"
    except BindingError as e:
        out[name] = e.code
os.unlink(cut)
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    # A fresh worker's environment: not what this harness's parent set (the
    # device script imports torch, which sets CUDA_MODULE_LOADING).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "CUDA_MODULE_LOADING")}
    extra = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*SITE, str(ROOT / "python"), extra] if p)
    return env


#: Where the wheel was installed (``--site``), ahead of the source tree.
SITE: list[str] = []


def child(code: str, *args: object, env: dict[str, str] | None = None, timeout: float = 900) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def torch_lib_dir() -> str:
    """The libtorch directory the native path finds (in a child: the installed wheel's view)."""
    return str(
        child(
            "import json; from torch_compiled_graphs.native import find_torch_lib; "
            "print(json.dumps({'lib': find_torch_lib()}))"
        )["lib"]
    )


def reader_threads() -> int:
    """The pipeline's default (min(8, cpus)), for a floor read with as many threads."""
    return min(8, os.cpu_count() or 1)


def rust(
    serve: str, work: Path, key: str, device: str, torch_lib: str, runtime: str | None = None
) -> dict[str, object]:
    argv = [serve, "--store", str(work / "store"), "--key", key, "--dest", str(work / "r" / f"rust-{time.time_ns()}")]
    argv += ["--torch-lib", torch_lib, "--weights", str(work / "weights.safetensors"), "--verbose"]
    argv += ["--io", str(work / "io.safetensors"), "--in", "x", "--out", "y", "--device", device]
    argv += ["--rtol", "5e-2", "--atol", "5e-2"]
    env = dict(os.environ)
    if runtime is not None:
        argv += ["--runtime", runtime]
        if runtime == "shim" and device.startswith("cuda") and "TORCH_COMPILED_GRAPHS_CUDART" not in env:
            # A process without Python is told where the CUDA runtime is (docs/run.md, "Runtime").
            try:
                from torch_compiled_graphs.native import find_cuda_runtime
            except ImportError:  # not importable here: serve searches on its own
                pass
            else:
                env["TORCH_COMPILED_GRAPHS_CUDART"] = find_cuda_runtime() or ""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    # 1: an output beyond the tolerance (reported as ok: false, timed all the same).
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise RuntimeError(f"serve failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "s": report["ttfi_s"],
        "timings": report.get("timings"),
        "ok": report["ok"],
        "max_abs_err": report.get("max_abs_err"),
        "runtime": report.get("runtime"),
        "runtime_reason": report.get("runtime_reason"),
    }


def measure(
    args: argparse.Namespace,
    size: str,
    sizes: list[str],
    works: dict[str, Path],
    minted: dict[str, dict[str, object]],
    torch_lib: str,
    report: dict[str, object],
    save: Any,
) -> None:
    """One model's floor and ways, interleaved, medians, ratios (saved after each)."""
    cuda = args.device != "cpu"
    work = works[size]
    key = str(minted[size]["key"])
    weights = work / "weights.safetensors"
    nbytes = int(minted[size]["bytes"])  # type: ignore[call-overload]
    child(READ, weights, reader_threads())  # the page cache holds the file from here on
    ways = {
        "floor_read": lambda: child(READ, weights, reader_threads()),
        "native": lambda: child(NATIVE, work, key, args.device, 0),
        "torch_load_file": lambda: child(TORCH_LOAD_FILE, work, args.device),
    }
    if cuda:
        ways["floor_context"] = lambda: child(CTX)
    ways["libraries"] = lambda: child(LIBRARIES, torch_lib)
    if args.serve_bin:
        ways["rust"] = lambda: rust(args.serve_bin, work, key, args.device, torch_lib)
    ways["torch_load"] = lambda: child(TORCH_LOAD, work, key, args.device, 0)
    variant = minted.get(f"{size}:{args.variant}") if args.variant != "default" else None
    entry: dict[str, object] = {"bytes": nbytes}
    if variant is not None and "refused" not in variant:
        # The libtorch-free path: the variant's graph on --runtime, in the same rounds.
        vkey = str(variant["key"])
        venv = {**_env(), "TORCH_COMPILED_GRAPHS_RUNTIME": args.runtime}
        ways["native_variant"] = lambda: child(NATIVE, work, vkey, args.device, 0, env=venv)
        if args.serve_bin:
            ways["rust_variant"] = lambda: rust(args.serve_bin, work, vkey, args.device, torch_lib, args.runtime)
    elif variant is not None:
        entry["variant_refused"] = variant
    if args.ways:
        wanted = set(args.ways.split(","))
        ways = {name: way for name, way in ways.items() if name in wanted}
    samples: dict[str, list[dict[str, object]]] = {name: [] for name in ways}
    entry["samples"] = samples
    report[size] = entry
    if cuda:
        entry["floor_h2d"] = child(H2D, nbytes)
    names = list(ways)
    for r in range(args.repeat):
        for name in names if r % 2 == 0 else reversed(names):
            try:
                samples[name].append(ways[name]())
            except Exception as exc:  # recorded; the other ways go on
                samples[name].append({"error": f"{type(exc).__name__}: {exc}"[-3000:]})
            save()
    medians = {
        name: statistics.median(float(s["s"]) for s in runs if "s" in s)  # type: ignore[arg-type]
        for name, runs in samples.items()
        if any("s" in s for s in runs)
    }
    floor = medians.get("floor_read", 0.0)
    if cuda:
        floor += medians.get("floor_context", 0.0) + float(entry["floor_h2d"]["s"])  # type: ignore[index]
    entry["medians"] = medians
    entry["floor_s"] = floor
    ratios: dict[str, float] = {}
    if "native" in medians and floor:
        ratios["native_over_floor"] = medians["native"] / floor
        if "libraries" in medians:
            # The floor plus what every AOTInductor graph must load first.
            entry["floor_and_libraries_s"] = floor + medians["libraries"]
            ratios["native_over_floor_and_libraries"] = medians["native"] / (floor + medians["libraries"])
    if "native" in medians and "torch_load_file" in medians:
        ratios["torch_load_file_over_native"] = medians["torch_load_file"] / medians["native"]
    if "rust" in medians and "native" in medians:
        ratios["rust_over_native"] = medians["rust"] / medians["native"]
    if "torch_load" in medians and "native" in medians:
        ratios["torch_load_over_native"] = medians["torch_load"] / medians["native"]
    for way in ("native_variant", "rust_variant"):
        if way in medians and floor:
            ratios[f"{way}_over_floor"] = medians[way] / floor
        if way in medians and "native" in medians:
            ratios[f"{way}_over_native"] = medians[way] / medians["native"]
    entry["ratios"] = ratios
    save()
    if args.calls and size == sizes[0]:
        # Steady state (on the first size): one call of the native path against the torch-based load's.
        try:
            n = child(NATIVE, work, key, args.device, args.calls)
            t = child(TORCH_LOAD, work, key, args.device, args.calls)
            entry["call_median_s"] = {"native": n["call_median_s"], "torch_load": t["call_median_s"]}
            entry["ratios"]["call_native_over_torch_load"] = float(n["call_median_s"]) / float(  # type: ignore[index, arg-type]
                t["call_median_s"]  # type: ignore[arg-type]
            )
            if "native_variant" in ways:
                v = child(NATIVE, work, str(variant["key"]), args.device, args.calls, env=venv)  # type: ignore[index]
                entry["call_median_s"]["native_variant"] = v["call_median_s"]  # type: ignore[index]
                entry["ratios"]["call_native_variant_over_native"] = float(v["call_median_s"]) / float(  # type: ignore[index, arg-type]
                    n["call_median_s"]  # type: ignore[arg-type]
                )
        except Exception as exc:
            entry["call_error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        save()
    print(json.dumps({size: {"medians": medians, "floor_s": floor, "ratios": entry["ratios"]}}), flush=True)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve-bin")
    parser.add_argument("--site", help="a directory the wheel was installed into (put first on PYTHONPATH)")
    parser.add_argument("--work", type=Path, help="where models and stores go (default: a folder in --out)")
    parser.add_argument("--cxx", help="the C++ compiler inductor runs (CXX)")
    parser.add_argument("--calls", type=int, default=50, help="steady-state calls timed per size")
    parser.add_argument(
        "--variant",
        choices=("default", "shim-v1"),
        default="default",
        help="also mint each model as this variant and measure its load_native (native_variant) and, with "
        "--serve-bin, its serve (rust_variant) beside the default's (docs/keys.md, 'Variants')",
    )
    parser.add_argument(
        "--runtime",
        choices=("auto", "libtorch", "shim"),
        default="shim",
        help="the runtime of the variant's ways (TORCH_COMPILED_GRAPHS_RUNTIME, serve --runtime)",
    )
    parser.add_argument("--ways", help="comma-separated ways to measure (default: all; the floor's copy always)")
    parser.add_argument(
        "--mint-only",
        action="store_true",
        help="mint (and write the models' files) only; a later run with the same --work reuses them",
    )
    args = parser.parse_args(argv)
    if args.site:
        SITE.append(os.path.abspath(args.site))
    if args.cxx:
        os.environ["CXX"] = args.cxx
    args.out.mkdir(parents=True, exist_ok=True)
    work_root = args.work or args.out / "coldstart-work"
    sizes = [s for s in args.sizes.split(",") if s]
    report: dict[str, object] = {"device": args.device, "repeat": args.repeat, "threads": reader_threads()}
    if args.variant != "default":
        report.update(variant=args.variant, runtime=args.runtime)

    def save() -> None:
        (args.out / "coldstart.json").write_text(json.dumps(report, indent=1))

    # Every model and variant is minted at once (the compiles dominate; they overlap).
    # A mint this --work already holds (its record, weights and io files) is reused.
    works = {size: work_root / size for size in sizes}
    variants = ["default"] if args.variant == "default" else ["default", args.variant]
    procs = {}
    minted: dict[str, dict[str, object]] = {}
    for size, work in works.items():
        work.mkdir(parents=True, exist_ok=True)
        cfg = SIZES[size]
        for variant in variants:
            name = size if variant == "default" else f"{size}:{variant}"
            record = work / f"minted-{variant}.json"
            if record.exists() and (work / "weights.safetensors").exists() and (work / "io.safetensors").exists():
                minted[name] = {**json.loads(record.read_text()), "reused_from_work": True}
                continue
            argv = [str(work), str(cfg["dim"]), str(cfg["blocks"]), str(SEQ), args.device, variant]
            procs[name] = (
                record,
                subprocess.Popen(
                    [sys.executable, "-c", MINT, *argv],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=_env(),
                ),
            )
    for name, (record, proc) in procs.items():
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"mint of {name} failed:\n{err[-4000:]}")
        minted[name] = json.loads(out.strip().splitlines()[-1])
        record.write_text(json.dumps(minted[name]))  # a refusal too: it is the same on every run
    report["minted"] = minted
    save()
    if args.mint_only:
        return report
    torch_lib = torch_lib_dir()
    for size in sizes:
        measure(args, size, sizes, works, minted, torch_lib, report, save)
    # A truncated checkpoint through both loads, in a fresh process: a typed refusal.
    try:
        report["refusals"] = child(REFUSALS, works[sizes[0]], minted[sizes[0]]["key"], args.device)
    except Exception as exc:
        report["refusals"] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    save()
    return report


if __name__ == "__main__":
    main()
