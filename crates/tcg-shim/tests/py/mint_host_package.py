"""Mints a small CPU AOTInductor package with ``link_libtorch=False`` for
tests/package_host.rs, and writes what the C++ driver needs into OUT_DIR:
the model's ``.so`` path, the input and the eager outputs as raw float32.

The model avoids ops whose CPU kernels call Sleef (``sin``, ``exp``...): a
libtorch-free CPU package imports those from libtorch_cpu, outside the shim.
"""

import os
import sys
import zipfile

import torch


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = (x * self.w).sum(dim=1, keepdim=True) + torch.relu(x) * x
        b = x.t().contiguous() * 3
        c = (x * 2).t()  # a strided (transposed) output
        return a, b, c


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        outs = model(x)
    ep = torch.export.export(model, (x,))
    # Inductor's vector-ISA check first, under the default options: run inside the
    # link_libtorch=False compile it leaves an unloadable probe in the machine's
    # inductor cache, and every later CPU compile there emits scalar code (docs/keys.md,
    # "Variants"; compile_package does the same).
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()
    pkg = os.path.join(out_dir, "model.pt2")
    torch._inductor.aoti_compile_and_package(
        ep, package_path=pkg, inductor_configs={"aot_inductor.link_libtorch": False}
    )
    with zipfile.ZipFile(pkg) as z:
        z.extractall(os.path.join(out_dir, "pkg"))
    sos = [
        os.path.join(root, f)
        for root, _, files in os.walk(os.path.join(out_dir, "pkg"))
        for f in files
        if f.endswith(".so")
    ]
    assert len(sos) == 1, sos
    x.numpy().tofile(os.path.join(out_dir, "x.bin"))
    for i, o in enumerate(outs):
        o.contiguous().numpy().tofile(os.path.join(out_dir, f"out{i}.bin"))
    print(sos[0])
    print(os.path.join(os.path.dirname(torch.__file__), "include"))


if __name__ == "__main__":
    main(sys.argv[1])
