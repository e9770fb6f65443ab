"""What a worker installs for each serving path (issue 34's install-bytes goal).

Sums the installed bytes of distributions from their RECORD files in this
environment, and the unpacked size of our wheel:

- the libtorch path: what ``pip install torch`` brings: torch and every
  distribution it requires, transitively (the CUDA libraries: cuDNN, cuBLAS,
  NCCL, ...; Triton; sympy and the other pure-Python ones);
- the libtorch-free path: our wheel (the shim is inside its extension) and the CUDA
  runtime library (``libcudart``) that AOTInductor's CUDA wrapper code links; the
  driver (``libcuda``) comes with the machine on both paths.

    python scripts/install_bytes.py [--wheel dist-dev/*.whl] [--json]
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import zipfile
from importlib import metadata
from pathlib import Path


def installed_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        path = Path(str(dist.locate_file(f)))
        if path.is_file():
            total += path.stat().st_size
    return total


def closure(root: str) -> dict[str, metadata.Distribution]:
    """``root`` and every distribution it requires, transitively, extras included
    (torch requires ``cuda-toolkit[cublas,cudart,...]``, whose extras bring the
    ``nvidia-*`` libraries), as installed here."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        key = name.lower().replace("_", "-")
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        first = key not in seen
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in (extras or frozenset({""}))
            ):
                continue
            if first or req.extras:
                todo.append((req.name, frozenset(req.extras)))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", default="dist-dev/*.whl", help="our wheel (a glob is expanded)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    wheels = sorted(glob.glob(args.wheel))
    if not wheels:
        raise SystemExit(f"no wheel matches {args.wheel}: build one (maturin build --release -o dist-dev)")
    with zipfile.ZipFile(wheels[-1]) as zf:
        ours = sum(i.file_size for i in zf.infolist())
    torch = metadata.distribution("torch")
    libtorch = {name: installed_bytes(d) for name, d in sorted(closure("torch").items())}
    cudart = 0
    runtime = next(
        (d for d in metadata.distributions() if (d.metadata["Name"] or "").lower().startswith("nvidia-cuda-runtime")),
        None,
    )
    if runtime is not None:
        for f in runtime.files or []:
            if re.search(r"libcudart\.so\.\d+$", str(f)):
                cudart += Path(str(runtime.locate_file(f))).stat().st_size
    free = {"torch_compiled_graphs (wheel, unpacked)": ours, "libcudart": cudart}
    out = {
        "torch": torch.version,
        "wheel": Path(wheels[-1]).name,
        "libtorch_path_bytes": sum(libtorch.values()),
        "libtorch_path": libtorch,
        "libtorch_free_path_bytes": sum(free.values()),
        "libtorch_free_path": free,
    }
    out["ratio"] = out["libtorch_free_path_bytes"] / out["libtorch_path_bytes"]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"torch {out['torch']}: libtorch path {out['libtorch_path_bytes'] / 1e6:,.1f} MB")
    for k, v in sorted(libtorch.items(), key=lambda kv: -kv[1]):
        print(f"  {k}: {v / 1e6:,.1f} MB")
    print(f"libtorch-free path {out['libtorch_free_path_bytes'] / 1e6:,.1f} MB")
    for k, v in free.items():
        print(f"  {k}: {v / 1e6:,.1f} MB")
    print(f"ratio: {out['ratio']:.4f}")


if __name__ == "__main__":
    main()
