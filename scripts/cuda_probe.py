"""A first CUDA run on the device machine (reconnaissance for the CUDA issue):
mint a small model for this GPU's sm, resolve it in a fresh process without
torch, load it on the GPU with weights bound and compare against eager; then
report the package's cubin ELF headers. Writes a JSON report to argv[1].

    python scripts/cuda_probe.py OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

REUSE = """
import json, sys, time
t0 = time.perf_counter()
from torch_compiled_graphs import Engine
g = Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])
t1 = time.perf_counter()
torch_free = "torch" not in sys.modules
import torch
w = torch.load(sys.argv[4])
m = g.load({k: v.cuda() for k, v in w.items()})
x = torch.load(sys.argv[5]).cuda()
y = m(x)
torch.cuda.synchronize()
t2 = time.perf_counter()
ref = torch.load(sys.argv[6]).cuda()
print(json.dumps({"resolve_s": t1 - t0, "torch_free": torch_free, "load_and_first_call_s": t2 - t1,
                  "max_abs_error": float((y - ref).abs().max())}))
"""


def cubin_headers(package: Path) -> list[dict[str, object]]:
    out = []
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            data = z.read(name)
            if data[:4] == b"\x7fELF":
                e_machine = int.from_bytes(data[0x12:0x14], "little")
                e_flags = int.from_bytes(data[0x30:0x34], "little")
                out.append(
                    {
                        "name": name,
                        "size": len(data),
                        "e_machine": e_machine,
                        "e_flags": hex(e_flags),
                        "ei_osabi": data[7],
                        "ei_abiversion": data[8],
                    }
                )
            elif name.endswith((".cubin", ".fatbin", ".ptx")):
                out.append({"name": name, "size": len(data), "head": data[:16].hex()})
    return out


def main() -> None:
    report: dict[str, object] = {}
    out_path = Path(sys.argv[1])
    try:
        import torch

        from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

        cap = torch.cuda.get_device_capability()
        sm = f"sm_{cap[0]}{cap[1]}"
        report.update(
            torch=torch.__version__,
            cuda=torch.version.cuda,
            device=torch.cuda.get_device_name(),
            sm=sm,
            python=sys.version.split()[0],
        )

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l1 = torch.nn.Linear(64, 128)
                self.scale = torch.nn.Parameter(torch.tensor(0.5))
                self.register_buffer("shift", torch.zeros(4))
                self.l2 = torch.nn.Linear(128, 64)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = self.l2(torch.relu(self.l1(x)) * self.scale)
                return (y.reshape(y.shape[0], 16, 4) + self.shift).reshape(y.shape[0], 64)

        net = Net().cuda().eval()
        x = torch.randn(8, 64, device="cuda")
        program = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=64)},))
        spec = GraphClassSpec("probe/net", "probe", program)
        toolchain = record_toolchain()
        rt = RuntimeCompatibility(sm, toolchain=toolchain)
        key = rt.key(spec.declare())
        report["key"] = str(key)
        work = Path(tempfile.mkdtemp(prefix="cuda-probe-"))
        engine = Engine(work / "store")
        t = time.perf_counter()
        r = engine.ensure(key, work / "g", target=sm, toolchain=toolchain, recipe=lambda: spec)
        report["mint_s"] = time.perf_counter() - t
        report["outcome"] = r.outcome.value
        report["constants"] = r.graph.constants
        report["placement"] = r.graph.metadata["graph_class"]["placement"]
        report["cubins"] = cubin_headers(r.graph.package_path)
        weights = {k: v.detach().cpu() for k, v in net.state_dict().items()}
        torch.save(weights, work / "w.pt")
        x2 = torch.randn(5, 64)
        torch.save(x2, work / "x.pt")
        with torch.no_grad():
            torch.save(net(x2.cuda()).cpu(), work / "y.pt")
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                REUSE,
                str(work / "store"),
                str(key),
                str(work / "g2"),
                str(work / "w.pt"),
                str(work / "x.pt"),
                str(work / "y.pt"),
            ],
            capture_output=True,
            text=True,
        )
        if child.returncode == 0:
            report["reuse"] = json.loads(child.stdout.strip().splitlines()[-1])
        else:
            report["reuse"] = child.stderr[-3000:]
        try:
            RuntimeCompatibility("sm_80", toolchain=toolchain)
        except Exception as exc:  # expected: device mismatch
            report["wrong_sm"] = {"type": type(exc).__name__, "code": getattr(exc, "code", None)}
    except Exception:
        report["error"] = traceback.format_exc()[-4000:]
    out_path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
