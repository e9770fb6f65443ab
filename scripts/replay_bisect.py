"""Where a CUDA graph's replays depart from its uncaptured runs (issue 32).

Written for the real-model tier's diffusers VAE decoder (``tests/realmodels.py``,
``vae-decoder``), whose replays on the native path were not equal to its uncaptured
runs (docs/cuda.md, "The VAE decoder's replays, found and fixed": the native path's
output copy dropped the channels-last strides). This script cuts that decoder into its
stages, mints each stage as a graph of its own (a child process per stage, several at
once), and compares, over ``--calls`` calls of one input, ``load(stage)`` with CUDA
graphs on against the same graph with them off: how many elements differ, by how
much, from which call on. Each stage is minted with a dynamic batch (as the tier
exports the decoder) and with a static one, since dynamic shapes change the generated
launch code. The later stages receive channels-last activations, so they also mint
graphs from non-row-major example inputs (docs/run.md, "Input layouts").

    PYTHONPATH=<site with the wheel> python3 scripts/replay_bisect.py --out OUT [--jobs 8] \\
        [--stages full,mid_block.attention,...] [--calls 12]

Writes ``OUT/replay-bisect.json`` (every stage's result, saved as each child ends) and
prints a line per stage. On a machine without a GPU (``--device cpu``) it rehearses
the plumbing: nothing is captured there, so every stage compares equal.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Stage name -> the decoder's submodule it runs (the input is what that submodule
# received while the whole decoder ran on the tier's example latents).
STAGES = (
    "full",
    "post_quant_conv",
    "decoder.conv_in",
    "decoder.mid_block",
    "decoder.mid_block.resnets.0",
    "decoder.mid_block.attentions.0",
    "decoder.up_blocks.0",
    "decoder.up_blocks.1",
    "decoder.conv_out_head",
)


def _stage_module(vae: Any, stage: str) -> Any:
    """The submodule of ``vae`` (an ``AutoencoderKL``) that ``stage`` names."""
    import torch

    if stage == "decoder.conv_out_head":

        class Head(torch.nn.Module):
            def __init__(self, decoder: Any) -> None:
                super().__init__()
                self.conv_norm_out = decoder.conv_norm_out
                self.conv_act = decoder.conv_act
                self.conv_out = decoder.conv_out

            def forward(self, x: torch.Tensor) -> Any:
                return self.conv_out(self.conv_act(self.conv_norm_out(x)))

        return Head(vae.decoder)
    return vae.get_submodule(stage)


def _stage_input(built: dict[str, Any], stage: str) -> tuple[Any, Any]:
    """``(module, args)``: the stage's module and the positional arguments it received."""
    import torch

    model, vae = built["model"], built["inner"]
    if stage == "full":
        return model, built["args"]
    hooked = "decoder.conv_norm_out" if stage == "decoder.conv_out_head" else stage
    seen: list[tuple[Any, ...]] = []

    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        if not seen:
            seen.append(tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args))

    handle = vae.get_submodule(hooked).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(*built["args"])
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"{hooked} did not run in the decoder's forward")
    # Positional arguments as the decoder passed them (a `temb` of None included).
    return _stage_module(vae, stage).eval(), seen[0]


def _compare(a: Any, b: Any) -> dict[str, Any]:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal": False, "why": f"{tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"}
    diff = a != b
    if a.is_floating_point():
        diff &= ~(torch.isnan(a) & torch.isnan(b))
    n = int(diff.sum())
    out: dict[str, Any] = {"equal": n == 0, "differing": n, "numel": a.numel()}
    if n and a.is_floating_point():
        out["max_abs"] = float((a.float() - b.float()).abs().max())
    return out


def run_stage(stage: str, dynamic: bool, device: str, calls: int, work: Path) -> dict[str, Any]:
    """Mint ``stage`` and compare its captured replays with its uncaptured runs."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.utils import _pytree

    import realmodels
    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    built = realmodels._prepare(realmodels.build("vae-decoder", device), device)
    module, args = _stage_input(built, stage)
    result: dict[str, Any] = {"stage": stage, "dynamic": dynamic, "device": device}
    result["inputs"] = [[list(a.shape), str(a.dtype), list(a.stride())] for a in args if isinstance(a, torch.Tensor)]
    batch = torch.export.Dim("batch", min=1, max=4)
    shapes = tuple({0: batch} if isinstance(a, torch.Tensor) else None for a in args) if dynamic else None
    t = time.perf_counter()
    program = torch.export.export(module, args, dynamic_shapes=shapes)
    name = f"bisect/{stage}/{'dynamic' if dynamic else 'static'}"
    spec = GraphClassSpec(name, "replay-bisect", program)
    toolchain = record_toolchain()
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        target = f"sm_{major}{minor}"
    else:
        target = "cpu"
    key = RuntimeCompatibility(target, toolchain=toolchain).key(spec.declare())
    minted = Engine(work / "store").ensure(key, work / "graph", target=target, toolchain=toolchain, recipe=lambda: spec)
    result["mint_s"] = time.perf_counter() - t
    result["key"] = key
    stored = minted.compiled_graph
    on = stored.load(module, cuda_graphs=True)
    off = stored.load(module, cuda_graphs=False)
    result["cuda_graphs_reason"] = getattr(on, "cuda_graphs_reason", None)

    def leaves(graph: Any) -> list[Any]:
        with torch.no_grad():
            got = graph(*args)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return [x.detach().clone() for x in _pytree.tree_leaves(got) if isinstance(x, torch.Tensor)]

    off_calls = [leaves(off) for _ in range(calls)]
    on_calls = [leaves(on) for _ in range(calls)]
    reference = off_calls[0]
    result["off_stable"] = all(
        _compare(c, r)["equal"] for call in off_calls for c, r in zip(call, reference, strict=True)
    )
    per_call = [[_compare(c, r) for c, r in zip(call, reference, strict=True)] for call in on_calls]
    result["on_vs_off"] = per_call
    unequal = [i for i, call in enumerate(per_call) if not all(c["equal"] for c in call)]
    result["first_unequal_call"] = unequal[0] if unequal else None
    result["equal"] = not unequal and result["off_stable"]
    result["stats"] = getattr(on, "stats", None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages (default: all)")
    parser.add_argument("--calls", type=int, default=12, help="calls per graph (the first two are never captured)")
    parser.add_argument("--jobs", type=int, default=8, help="stages minted at once")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per stage")
    parser.add_argument("--child", nargs=3, metavar=("STAGE", "DYNAMIC", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        stage, dynamic, work = args.child
        print(json.dumps(run_stage(stage, dynamic == "1", args.device, args.calls, Path(work)), default=str))
        return
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "replay-bisect.json"
    results: dict[str, Any] = {"device": args.device, "calls": args.calls, "stages": {}}
    work = Path(tempfile.mkdtemp(prefix="replay-bisect-"))

    def child(stage: str, dynamic: bool) -> tuple[str, dict[str, Any]]:
        label = f"{stage}/{'dynamic' if dynamic else 'static'}"
        argv = [sys.executable, __file__, "--out", str(args.out), "--device", args.device]
        argv += ["--calls", str(args.calls), "--child", stage, "1" if dynamic else "0", str(work / label)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            return label, {"error": f"timed out after {args.timeout:.0f} s"}
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            return label, {"error": f"exit {done.returncode}: {done.stderr[-3000:]}"}
        return label, json.loads(lines[-1])

    jobs = [(s, d) for s in stages for d in (True, False)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for label, got in pool.map(lambda job: child(*job), jobs):
            results["stages"][label] = got
            out_file.write_text(json.dumps(results, indent=1, default=str))
            if "error" in got:
                print(f"{label}: error: {got['error'][-300:]}", flush=True)
            else:
                worst = [c for call in got["on_vs_off"] for c in call if not c["equal"]]
                print(
                    f"{label}: {'equal' if got['equal'] else 'DIFFERS'} "
                    f"(off stable {got['off_stable']}, first unequal call {got['first_unequal_call']}, "
                    f"worst {max(worst, key=lambda c: c.get('differing', 0)) if worst else None})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
