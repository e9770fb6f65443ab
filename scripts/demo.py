"""`make demo`: mint a real model once, then reuse it from a fresh process.

Step 1 (this process) defines a small transformer block with random weights
and a dynamic batch, exports it, derives its key and calls `Engine.ensure`:
the first run compiles with AOTInductor; later runs reuse. Step 2 runs in a
fresh process: it resolves the key (no torch imported), then loads the graph
with the weights bound, runs it on a batch size other than the export's and
checks the result against eager. Step 3, in another fresh process, does the
same without torch at all (`load_native`: weights from the safetensors file,
numpy in and out), then checks against eager. A table of the times and the
key closes it.

    python scripts/demo.py [--dir DIR] [--small]

DIR (default ./demo-store) holds the store (DIR/store), the weights and the
resolved graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "default": {"dim": 128, "heads": 4, "hidden": 512, "seq": 32},
    "small": {"dim": 32, "heads": 2, "hidden": 64, "seq": 8},
}


def build_model(dim: int, heads: int, hidden: int) -> object:
    import torch
    from torch import nn

    class DemoBlock(nn.Module):
        """A pre-norm transformer block: attention and an MLP, each with a residual."""

        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))

    torch.manual_seed(0)
    return DemoBlock().eval()


def mint(store: Path, size: str) -> dict[str, object]:
    t0 = time.perf_counter()
    import torch
    from safetensors.torch import save_file

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    cfg = SIZES[size]
    model = build_model(cfg["dim"], cfg["heads"], cfg["hidden"])
    example = torch.randn(4, cfg["seq"], cfg["dim"])
    batch = torch.export.Dim("batch", min=1, max=16)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))  # type: ignore[arg-type]
    spec = GraphClassSpec(f"demo/block-{size}", "demo", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    store.mkdir(parents=True, exist_ok=True)
    save_file(dict(model.state_dict()), store / f"demo-{size}.weights.safetensors")
    t1 = time.perf_counter()
    result = Engine(store / "store").ensure(
        key, store / "graphs" / f"{key}-{os.getpid()}", target="cpu", toolchain=toolchain, recipe=lambda: spec
    )
    t2 = time.perf_counter()
    return {
        "key": str(key),
        "outcome": result.outcome.value,
        "publication": None if result.publication is None else result.publication.outcome.value,
        "ensure_s": t2 - t1,
        "prepare_s": t1 - t0,
    }


def reuse(store: Path, size: str, key: str) -> dict[str, object]:
    t0 = time.perf_counter()
    from torch_compiled_graphs import Engine

    dest = store / "reuse" / f"{key}-{os.getpid()}"
    graph = Engine(store / "store").resolve(key, dest)
    t1 = time.perf_counter()
    assert graph is not None, "the minted key must resolve"
    torch_free = "torch" not in sys.modules
    import torch
    from safetensors.torch import load_file

    t2 = time.perf_counter()
    cfg = SIZES[size]
    weights = load_file(store / f"demo-{size}.weights.safetensors")
    loaded = graph.load(weights)
    t3 = time.perf_counter()
    x = torch.randn(7, cfg["seq"], cfg["dim"])
    y = loaded(x)
    t4 = time.perf_counter()
    model = build_model(cfg["dim"], cfg["heads"], cfg["hidden"])
    model.load_state_dict(weights)  # type: ignore[attr-defined]
    with torch.no_grad():
        expected = model(x)  # type: ignore[operator]
    error = float((y - expected).abs().max())
    return {
        "resolve_s": t1 - t0,
        "import_torch_s": t2 - t1,
        "load_s": t3 - t2,
        "first_inference_s": t4 - t3,
        "max_abs_error": error,
        "resolve_without_torch": torch_free,
        "path": str(graph.path),
    }


def reuse_native(store: Path, size: str, key: str) -> dict[str, object]:
    """The torch-free way: resolve, ``load_native`` (weights from safetensors), numpy in and out."""
    t0 = time.perf_counter()
    from torch_compiled_graphs import Engine

    dest = store / "reuse" / f"{key}-native-{os.getpid()}"
    graph = Engine(store / "store").resolve(key, dest)
    assert graph is not None, "the minted key must resolve"
    t1 = time.perf_counter()
    import numpy as np

    cfg = SIZES[size]
    native = graph.load_native(store / f"demo-{size}.weights.safetensors")
    t2 = time.perf_counter()
    x = np.random.default_rng(0).standard_normal((7, cfg["seq"], cfg["dim"]), dtype=np.float32)
    y = np.asarray(native(x))
    t3 = time.perf_counter()
    torch_free = "torch" not in sys.modules
    import torch
    from safetensors.torch import load_file

    model = build_model(cfg["dim"], cfg["heads"], cfg["hidden"])
    model.load_state_dict(load_file(store / f"demo-{size}.weights.safetensors"))  # type: ignore[attr-defined]
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()  # type: ignore[operator]
    return {
        "resolve_s": t1 - t0,
        "load_native_s": t2 - t1,
        "first_inference_s": t3 - t2,
        "until_first_output_s": t3 - t0,
        "max_abs_error": float(np.abs(y - expected).max()),
        "without_torch": torch_free,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", dest="store", type=Path, default=ROOT / "demo-store")
    parser.add_argument("--small", action="store_true", help="a smaller model (the test suite's size)")
    parser.add_argument("--reuse-key", help=argparse.SUPPRESS)
    parser.add_argument("--reuse-native-key", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    size = "small" if args.small else "default"
    if args.reuse_key:
        print(json.dumps(reuse(args.store, size, args.reuse_key)))
        return
    if args.reuse_native_key:
        print(json.dumps(reuse_native(args.store, size, args.reuse_native_key)))
        return
    minted = mint(args.store, size)

    def fresh_process(flag: str) -> dict[str, object]:
        child = subprocess.run(
            [sys.executable, __file__, "--dir", str(args.store), flag, str(minted["key"])]
            + (["--small"] if args.small else []),
            check=True,
            capture_output=True,
            text=True,
        )
        result: dict[str, object] = json.loads(child.stdout.strip().splitlines()[-1])
        return result

    reused = fresh_process("--reuse-key")
    native = fresh_process("--reuse-native-key")
    ok = (
        reused["resolve_without_torch"] is True
        and float(reused["max_abs_error"]) < 1e-4  # type: ignore[arg-type]
        and native["without_torch"] is True
        and float(native["max_abs_error"]) < 1e-4  # type: ignore[arg-type]
    )
    if args.json:
        print(json.dumps({"mint": minted, "reuse": reused, "native": native, "ok": ok}))
    else:
        compiled = minted["outcome"] == "minted"
        print(f"key                   {minted['key']}")
        print(f"ensure                {minted['outcome']}" + (" (compiled now)" if compiled else " (no compile)"))
        print(f"ensure time           {minted['ensure_s']:.2f} s")
        print("fresh process:")
        print(f"  resolve (no torch)  {reused['resolve_s'] * 1000:.1f} ms")
        print(f"  import torch        {reused['import_torch_s']:.2f} s")
        print(f"  load + bind         {reused['load_s'] * 1000:.1f} ms")
        print(f"  first inference     {reused['first_inference_s'] * 1000:.1f} ms")
        print(f"  max |graph - eager| {reused['max_abs_error']:.2e}")
        print(f"  resolved at         {reused['path']}")
        print("fresh process, without torch (load_native, numpy in and out):")
        print(f"  resolve             {float(native['resolve_s']) * 1000:.1f} ms")  # type: ignore[arg-type]
        print(f"  load_native + bind  {float(native['load_native_s']) * 1000:.1f} ms")  # type: ignore[arg-type]
        print(f"  first inference     {float(native['first_inference_s']) * 1000:.1f} ms")  # type: ignore[arg-type]
        print(f"  start to output     {float(native['until_first_output_s']) * 1000:.1f} ms")  # type: ignore[arg-type]
        print(f"  max |graph - eager| {float(native['max_abs_error']):.2e}")  # type: ignore[arg-type]
    if not ok:
        raise SystemExit("a reused graph does not match eager, or a torch-free step imported torch")


if __name__ == "__main__":
    main()
