from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTDATA = ROOT / "testdata"
#: The 0.2.0 reference artifact (CPU MLP with folded constants), its weights and io.
REFERENCE = TESTDATA / "reference-0.2.0"
REFERENCE_KEY = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a"


def resolve_reference(root: Path) -> Any:
    """Import the reference artifact into a new store under ``root`` and resolve it there."""
    from torch_compiled_graphs import Engine

    engine = Engine(root / "store")
    engine.import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    found = engine.resolve(REFERENCE_KEY, root / "graph")
    assert found is not None
    return found


REFERENCE_WEIGHTS = REFERENCE / "mlp-cpu.weights.safetensors"


# The reference artifact resolved into a store of its own, bound natively, and its
# recorded inputs/outputs: the fixtures of the native-path tests (test_native*.py).
# Module-scoped: each test module gets its own store; a module may define its own
# `graph` fixture, which then takes precedence.
@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return resolve_reference(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def native(graph: Any) -> Any:
    return graph.load_native(REFERENCE_WEIGHTS)


@pytest.fixture(scope="module")
def io() -> dict[str, Any]:
    from safetensors.numpy import load_file

    return load_file(REFERENCE / "mlp-cpu.io.safetensors")


def refused_binding(code: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls ``call`` and checks that it raises a BindingError with ``code``; returns the error."""
    from torch_compiled_graphs.errors import BindingError

    with pytest.raises(BindingError) as e:
        call(*args, **kwargs)
    assert e.value.code == code, str(e.value)
    return e.value


@pytest.fixture(scope="session")
def spec_vectors() -> dict[str, Any]:
    return json.loads((TESTDATA / "spec_vectors.json").read_text())


def run_demo(workdir: Path) -> dict[str, Any]:
    """Run scripts/demo.py at its small size in `workdir`; return its JSON report."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--dir", str(workdir), "--small", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="session")
def demo_minted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One real AOTInductor mint per test session (the demo's first run), shared by the
    end-to-end, engine and artifact tests that need a package this project compiled."""
    workdir = tmp_path_factory.mktemp("demo")
    return workdir, run_demo(workdir)


# The tiny diffusers UNet of the drop-in tests, minted once per session and shared by
# every module that needs a real diffusers graph (test_dropin.py, test_weights_once.py):
# one real AOTInductor compile, not one per module.
STEPS = 3
SEED = 7


def tiny_unet() -> Any:
    import diffusers
    import torch

    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    ).eval()


def eager_images(pipe: Any) -> Any:
    import torch

    with torch.no_grad():
        return pipe(num_inference_steps=STEPS, generator=torch.Generator().manual_seed(SEED), output_type="np").images


@pytest.fixture(scope="session")
def ddpm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The minted UNet of a saved DDPM pipeline, with the eager pipeline's images and one
    eager UNet call (x, t, y) to compare against."""
    diffusers = pytest.importorskip("diffusers")
    import numpy as np
    import torch

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    root = tmp_path_factory.mktemp("ddpm")
    unet = tiny_unet()
    pipe = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=50))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(root / "pipeline")
    images = eager_images(pipe)
    np.save(root / "eager.npy", images)
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor(5)
    with torch.no_grad():
        y = unet(x, t).sample
    np.savez(root / "call.npz", x=x.numpy(), t=t.numpy(), y=y.numpy())

    program = torch.export.export(unet, (x, t))
    spec = GraphClassSpec("tests/ddpm-unet", "dropin", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    result = Engine(root / "store").ensure(key, root / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec)
    return {"root": root, "key": str(key), "graph": result.compiled_graph, "unet": unet, "x": x, "t": t, "y": y}
