"""The fresh processes of the shim stage (``scripts/shim_e2e.py``; issue 34).

    python scripts/shim_child.py mint MODEL VARIANT WORK DEVICE
    python scripts/shim_child.py run WORK DEVICE OUT_FILE
    python scripts/shim_child.py steady WORK DEVICE CALLS WARM

``mint`` (imports torch): builds MODEL, exports it, writes its fixed inputs and
eager's outputs (``WORK/io.safetensors``: ``in0``.. in the graph's flat input order,
``out0``.. its flat outputs, computed by the exported program in full float32 as the
mint's parity check computes them; ``b1_in0``, ``b8_in0`` for the steady state of a
model with a dynamic batch), mints it as VARIANT (``default`` or ``shim-v1``) into
``WORK/store``, writes its weights (``WORK/weights.safetensors``) and
``WORK/mint.json``. A refusal is a result: its code, message and the ops it names.

``run`` and ``steady`` never import torch (checked, and the process's memory map is
read for libtorch and the shim before they exit): resolve, ``load_native`` (the
runtime from ``$TORCH_COMPILED_GRAPHS_RUNTIME``), call on the fixed inputs, outputs
written to OUT_FILE for the parent to compare (``run``), or the wall time of a call
and a wait for the device at batch 1 and 8 with CUDA graphs on and off (``steady``).
Each prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

#: The block stack of the graphs bench (scripts/cuda_e2e.py, GRAPHS_CHILD): bf16, dynamic batch 1..8.
BLOCKS = {"dim": 512, "heads": 8, "hidden": 2048, "seq": 128, "blocks": 8}
#: An elementwise + reduction model (bf16, dynamic batch): what a CPU shim-v1 mint admits.
ELEMENTWISE = {"seq": 16, "dim": 64}
#: The batch of the fixed inputs of a model with a dynamic batch (not the export's 2).
RUN_BATCH = 3
#: The batches of the steady state.
BENCH_BATCHES = (1, 8)


def _emit(out: dict[str, Any]) -> None:
    print(json.dumps(out, default=str), flush=True)


# ---------------------------------------------------------------------- mint (torch)


def _build(name: str, device: str) -> dict[str, Any]:
    """The model, its export call, its dynamic shapes and the calls of the run and the
    steady state (``run``: args and kwargs; ``bench``: batch -> args)."""
    import torch

    dt = torch.bfloat16
    batch = torch.export.Dim("batch", min=1, max=8)
    if name == "blocks":
        import demo

        cfg = BLOCKS

        class Model(torch.nn.Module):
            # Under a name: AOTInductor records a top-level Sequential's "0.weight" as a literal.
            def __init__(self) -> None:
                super().__init__()
                self.blocks = torch.nn.Sequential(
                    *[demo.build_model(cfg["dim"], cfg["heads"], cfg["hidden"]) for _ in range(cfg["blocks"])]  # type: ignore[misc]
                )

            def forward(self, x: Any) -> Any:
                return self.blocks(x)

        torch.manual_seed(0)
        model = Model().to(device, dt).eval()
        gen = torch.Generator(device=device).manual_seed(1)

        def x(b: int) -> Any:
            return torch.randn(b, cfg["seq"], cfg["dim"], device=device, dtype=dt, generator=gen)

        return {
            "model": model,
            "args": (x(2),),
            "kwargs": {},
            "dynamic": ({0: batch},),
            "run": ((x(RUN_BATCH),), {}),
            "bench": {b: (x(b),) for b in BENCH_BATCHES},
            "config": {"kind": "transformer block stack, bf16", **cfg},
        }
    if name == "elementwise":
        cfg = ELEMENTWISE

        class Elementwise(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.scale = torch.nn.Parameter(torch.linspace(-1, 1, cfg["dim"]))
                self.register_buffer("shift", torch.linspace(0.5, -0.5, cfg["dim"]))

            def forward(self, x: Any) -> Any:
                y = torch.relu(x * self.scale + self.shift)
                return y - y.mean(dim=-1, keepdim=True), y.amax(dim=1)

        model = Elementwise().to(device, dt).eval()
        gen = torch.Generator(device=device).manual_seed(1)

        def e(b: int) -> Any:
            return torch.randn(b, cfg["seq"], cfg["dim"], device=device, dtype=dt, generator=gen)

        return {
            "model": model,
            "args": (e(2),),
            "kwargs": {},
            "dynamic": ({0: batch},),
            "run": ((e(RUN_BATCH),), {}),
            "bench": {b: (e(b),) for b in BENCH_BATCHES},
            "config": {"kind": "elementwise + reductions, bf16", **cfg},
        }
    # A model of the real-model tier (tests/realmodels.py), as its GPU run builds it.
    sys.path.insert(0, str(ROOT / "tests"))
    import realmodels

    entry = realmodels._prepare(realmodels.build(name, device), device)
    return {
        "model": entry["model"],
        "args": tuple(entry["args"]),
        "kwargs": dict(entry["kwargs"]),
        "dynamic": entry["dynamic"],
        "run": (tuple(entry["args"]), dict(entry["kwargs"])),
        "bench": {},
        "config": {"kind": f"real-model tier: {name}"},
    }


def _target(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def _refused_ops(message: str) -> list[str]:
    """The ops a ``compile.variant_refused`` message names ("... needs A; B, which shim set v1 ...")."""
    head, sep, _ = message.partition(", which ")
    _, found, ops = head.partition(" needs ")
    return [op.strip() for op in ops.split("; ") if op.strip()] if sep and found else []


def mint(name: str, variant: str, work: Path, device: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file
    from torch.utils._pytree import tree_leaves

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, _native, record_toolchain
    from torch_compiled_graphs.errors import CompileError

    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    built = _build(name, device)
    model = built["model"]
    out: dict[str, Any] = {"model": name, "variant": variant, "device": device, "config": built["config"]}
    with torch.no_grad():
        program = torch.export.export(model, built["args"], built["kwargs"] or None, dynamic_shapes=built["dynamic"])
        # Eager as the mint's parity check computes it: the exported program, full float32 on a GPU.
        tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            run_args, run_kwargs = built["run"]
            eager = [t for t in tree_leaves(program.module()(*run_args, **run_kwargs)) if isinstance(t, torch.Tensor)]
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    # The fixed inputs by name, in the graph's flat input order (args, then kwargs).
    io: dict[str, Any] = {}
    arg_names = []
    for i, a in enumerate(run_args):
        arg_names.append(f"in{i}")
        io[f"in{i}"] = a
    kwarg_names = {}
    for j, (k, v) in enumerate(run_kwargs.items()):
        kwarg_names[k] = f"in{len(run_args) + j}"
        io[kwarg_names[k]] = v
    for i, t in enumerate(eager):
        io[f"out{i}"] = t
    bench = {}
    for b, args in built["bench"].items():
        bench[str(b)] = [f"b{b}_in{i}" for i in range(len(args))]
        io.update({f"b{b}_in{i}": a for i, a in enumerate(args)})
    save_file({k: v.detach().cpu().contiguous() for k, v in io.items()}, os.fspath(work / "io.safetensors"))
    out["export_s"] = time.perf_counter() - t0

    target = _target(device)
    toolchain = record_toolchain(variant=variant)
    spec = GraphClassSpec(f"shim-e2e/{name}", "bench", program)
    key = RuntimeCompatibility(target, toolchain=toolchain).key(spec.declare())
    out.update(key=str(key), target=target)
    # The compile's tuning lines (the probe and the narrowing, docs/keys.md "Variants").
    tuning: list[str] = []

    class Tuning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if any(word in text for word in ("probe", "narrowed", "tuned at", "shape environment")):
                tuning.append(text[:400])

    logger = logging.getLogger("torch_compiled_graphs")
    logger.addHandler(Tuning(logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    out["tuning_log"] = tuning
    t = time.perf_counter()
    try:
        result = Engine(work / "store").ensure(
            key, work / "minted", target=target, toolchain=toolchain, recipe=lambda: spec, variant=variant
        )
    except CompileError as exc:
        out["mint_s"] = time.perf_counter() - t
        out["code"] = exc.code
        out["message"] = str(exc)[:4000]
        if exc.code == "compile.variant_refused":
            out["refused"] = True
            out["ops"] = _refused_ops(str(exc))
        else:
            out["error"] = f"CompileError [{exc.code}]"
        return out
    out["mint_s"] = time.perf_counter() - t
    out["outcome"] = result.outcome.value
    stored = result.compiled_graph
    imports = stored.shim_imports
    out["imports"] = {"aoti_torch": len(imports["aoti_torch"]), "other": imports["other"]}
    # What shim set v1 lacks for this mint (empty for an admitted shim-v1 mint; for the
    # default variant, why it needs libtorch).
    out["outside_shim_set_v1"] = _native.shim_set_v1_missing(imports["aoti_torch"], imports["other"])
    record = stored.mint_record or {}
    out["parity"] = record.get("parity")
    stored.write_weights(model, work / "weights.safetensors")
    meta = {
        "key": str(key),
        "variant": variant,
        "store": os.fspath(work / "store"),
        "weights": os.fspath(work / "weights.safetensors"),
        "io": os.fspath(work / "io.safetensors"),
        "args": arg_names,
        "kwargs": kwarg_names,
        "outputs": len(eager),
        "bench": bench,
    }
    (work / "mint.json").write_text(json.dumps(meta))
    out["seconds"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------- torch-free


def _load(work: Path, device: str, **options: Any) -> tuple[dict[str, Any], Any, Any]:
    from torch_compiled_graphs import Engine

    meta = json.loads((work / "mint.json").read_text())
    stored = Engine(meta["store"]).resolve(meta["key"], os.fspath(work / f"resolved-{os.getpid()}"))
    if stored is None:
        raise SystemExit(f"{meta['key']} is not in {meta['store']}")
    native = stored.load_native(meta["weights"], device=device, **options)
    return meta, stored, native


def _facts(native: Any) -> dict[str, Any]:
    return {
        "runtime": native.runtime,
        "runtime_reason": native.runtime_reason,
        "torch_check": native.torch_check,
        "timings": dict(native.timings),
        "cuda_graphs": native.cuda_graphs,
        "cuda_graphs_reason": native.cuda_graphs_reason,
    }


def _end(out: dict[str, Any]) -> dict[str, Any]:
    import torchfree_io

    maps = torchfree_io.mapped_libraries()
    out["torch_imported"] = "torch" in sys.modules
    out["libtorch_mapped"] = maps["libtorch"]
    out["shim_mapped"] = maps["shim"]
    return out


def _placed(named: dict[str, Any], device: str) -> tuple[dict[str, Any], str]:
    """The inputs on ``device`` (through the CUDA driver on a GPU), or, where that fails,
    on the host (the graph then copies them on each call), and which it was."""
    import torchfree_io

    try:
        return torchfree_io.tensors_from(named, device), device
    except Exception as exc:
        if device == "cpu":
            raise
        why = f"{type(exc).__name__}: {exc}"[:500]
        return torchfree_io.tensors_from(named, "cpu"), f"host, copied on each call ({device} upload failed: {why})"


def run(work: Path, device: str, out_file: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torchfree_io

    meta, _, native = _load(work, device)
    out: dict[str, Any] = {"env_runtime": os.environ.get("TORCH_COMPILED_GRAPHS_RUNTIME")}
    io = torchfree_io.read_safetensors(meta["io"])
    names = [*meta["args"], *meta["kwargs"].values()]
    inputs, out["inputs"] = _placed({n: io[n] for n in names}, device)
    args = [inputs[n] for n in meta["args"]]
    kwargs = {k: inputs[n] for k, n in meta["kwargs"].items()}
    result = native(*args, **kwargs)
    first = [torchfree_io.host_tensor(t) for t in torchfree_io.leaves(result)]
    out["s"] = time.perf_counter() - t0
    torchfree_io.write_safetensors(out_file, {f"out{i}": t for i, t in enumerate(first)})
    out.update(_facts(native))
    # Two more calls (on a GPU the native path warms, then captures): the same bytes.
    again = first
    for _ in range(2):
        again = [torchfree_io.host_tensor(t) for t in torchfree_io.leaves(native(*args, **kwargs))]
    out["calls_2_3_equal_first"] = again == first
    out["stats"] = native.stats
    return _end(out)


def steady(work: Path, device: str, calls: int, warm: int) -> dict[str, Any]:
    import statistics

    import torchfree_io

    out: dict[str, Any] = {"env_runtime": os.environ.get("TORCH_COMPILED_GRAPHS_RUNTIME"), "cells": {}}
    meta = json.loads((work / "mint.json").read_text())
    io = torchfree_io.read_safetensors(meta["io"])
    for graphs in (True, False):
        label = "cuda_graphs_on" if graphs else "cuda_graphs_off"
        _, _, native = _load(work, device, cuda_graphs=graphs)
        facts = _facts(native)
        facts.pop("timings")
        out[label] = facts
        wait, how = torchfree_io.synchronizer(native)
        out[label]["synchronize"] = how
        for b, names in sorted(meta["bench"].items(), key=lambda kv: int(kv[0])):
            # Inputs placed on the device once, as a server keeps them.
            placed, out[label][f"b{b}_inputs"] = _placed({n: io[n] for n in names}, device)
            args = [placed[n] for n in names]
            for _ in range(warm):
                native(*args)
            wait()
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                native(*args)
                wait()
                times.append(time.perf_counter() - t)
            out["cells"][f"b{b}_{label}"] = statistics.median(times)
        out[label]["stats"] = native.stats
        del native
    return _end(out)


def main() -> None:
    mode = sys.argv[1]
    try:
        if mode == "mint":
            out = mint(sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5])
        elif mode == "run":
            out = run(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
        elif mode == "steady":
            out = steady(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except Exception as exc:  # a result for the parent, with the library's code where it has one
        out = {"error": f"{type(exc).__name__}: {exc}"[-4000:], "code": getattr(exc, "code", None)}
        if mode != "mint":
            out = _end(out)
    _emit(out)


if __name__ == "__main__":
    main()
