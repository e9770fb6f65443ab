"""Where the libtorch-free variant's steady time goes: kernel profiles of the block stack (GPU).

Two modes, each writing ``$OUT`` (docs/benchmarks.md, "Serve without libtorch", and
docs/shim-steady-flex-h200.json hold what they measured on the H200):

``jit``
    ``torch.compile`` of the graphs bench's bf16 block stack (``shim_child.BLOCKS``) with
    the default options and with the variant's kernel options (``max_autotune``, Triton
    GEMM and convolution templates, SDPA as flex attention), the batch marked dynamic
    with hint 2 as the mint's export has it. For each: CUDA-graph replay medians at batch
    2 and 8 and the device time per kernel (torch's profiler, 10 calls) -> ``jit.json``.
``minted``
    The block stack minted as ``shim-v1`` by ``shim_child.mint`` (alone on the GPU), loaded
    with ``load()`` under torch, its kernels profiled at batch 8 (10 calls, CUDA graphs
    off) -> ``aot_b8.json`` and the package as ``model.pt2``.

    OUT=/tmp/out python3 scripts/variant_profile.py jit
    OUT=/tmp/out PYTHONPATH=<the wheel's site> python3 scripts/variant_profile.py minted
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("OUT", "/tmp/out"))
VARIANT_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "TRITON", "max_autotune_conv_backends": "TRITON"}


def _kernels(calls: Any, n: int = 10) -> dict[str, Any]:
    """Device microseconds per call of each kernel over ``n`` calls of ``calls()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            calls()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0)
        if total:
            rows.append((round(total / n, 2), event.count // n, event.key[:110]))
    rows.sort(reverse=True)
    return {"rows": rows, "sum": sum(r[0] for r in rows)}


def _replay_ms(call: Any) -> float:
    """Median wall time of one CUDA-graph replay of ``call`` and a wait for the device."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(300):
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def jit() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    import demo
    import shim_child

    cfg = shim_child.BLOCKS
    blocks = [demo.build_model(cfg["dim"], cfg["heads"], cfg["hidden"]) for _ in range(cfg["blocks"])]
    model = torch.nn.Sequential(*blocks)
    model = model.to("cuda", torch.bfloat16).eval().requires_grad_(False)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def x(b: int) -> torch.Tensor:
        return torch.randn(b, cfg["seq"], cfg["dim"], device="cuda", dtype=torch.bfloat16, generator=gen)

    sdpa = F.scaled_dot_product_attention
    inputs = {b: x(b) for b in (2, 8)}
    results: dict[str, Any] = {}
    for label, options, flex in (("default", {}, False), ("flex_variant_options", VARIANT_OPTIONS, True)):
        started = time.time()
        try:
            torch._dynamo.reset()
            F.scaled_dot_product_attention = (lambda q, k, v, **kw: flex_attention(q, k, v)) if flex else sdpa
            compiled = torch.compile(model, options=options)
            hint = x(2)
            torch._dynamo.mark_dynamic(hint, 0, min=2, max=8)
            with torch.no_grad():
                compiled(hint)
                got: dict[str, Any] = {"compile_s": time.time() - started}
                for b, xb in inputs.items():
                    got[f"b{b}_graph_ms"] = _replay_ms(lambda xb=xb, fn=compiled: fn(xb))
                    profiled = _kernels(lambda xb=xb, fn=compiled: fn(xb))
                    got[f"b{b}_kernels_us"], got[f"b{b}_kernel_sum_us"] = profiled["rows"][:30], profiled["sum"]
            results[label] = got
        except Exception:
            results[label] = {"error": traceback.format_exc()[-3000:]}
        finally:
            F.scaled_dot_product_attention = sdpa
        print(label, json.dumps({k: v for k, v in results[label].items() if "kernels" not in k}), flush=True)
        (OUT / "jit.json").write_text(json.dumps(results, indent=1))


def minted() -> None:
    from safetensors.torch import load_file

    import shim_child
    from torch_compiled_graphs import Engine

    work = Path("/tmp/variant-profile/blocks")
    if not (work / "mint.json").exists():
        made = shim_child.mint("blocks", "shim-v1", work, "cuda")
        print(json.dumps({k: made.get(k) for k in ("mint_s", "outcome", "error", "message")})[:2000], flush=True)
    meta = json.loads((work / "mint.json").read_text())
    stored = Engine(meta["store"]).resolve(meta["key"], os.fspath(work / "resolved"))
    if stored is None:
        raise SystemExit(f"{meta['key']} is not in {meta['store']}")
    shutil.copy(stored.package, OUT / "model.pt2")
    graph = stored.load(meta["weights"], device="cuda", cuda_graphs=False)
    x = load_file(meta["io"])["b8_in0"].cuda()
    for _ in range(5):
        graph(x)
    torch.cuda.synchronize()
    profiled = _kernels(lambda: graph(x))
    (OUT / "aot_b8.json").write_text(json.dumps(profiled, indent=0))
    print("sum", profiled["sum"])
    for row in profiled["rows"][:20]:
        print(row)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    {"jit": jit, "minted": minted}[sys.argv[1]]()
