"""A graph dropped into a diffusers pipeline on CUDA (issue 31: a CPU timestep fed to
a CUDA graph aborted the process with an illegal memory access).

``DDPMPipeline`` passes its UNet the timestep as a 0-d tensor on the CPU, which the
eager ``UNet2DModel`` moves to its device itself. The drop-in takes what the module
takes: the pipeline runs end to end on the GPU with the graph in place of the UNet
and gives the eager pipeline's images; a tensor the module would not take (a CPU
batch) is refused with ``run.call_invalid`` naming both devices, on ``load()``,
``as_module`` and ``load_native`` (DLPack), and the process lives on.

Needs a CUDA device and diffusers; the device machine runs it through
``scripts/cuda_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs.errors import BindingError

from .conftest import tiny_unet

diffusers = pytest.importorskip("diffusers")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 3


def images(pipe: Any) -> Any:
    with torch.no_grad():
        return pipe(
            num_inference_steps=STEPS, generator=torch.Generator("cuda").manual_seed(7), output_type="np"
        ).images


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cuda-dropin")
    unet = tiny_unet().cuda()
    major, minor = torch.cuda.get_device_capability()
    sm = f"sm_{major}{minor}"
    x = torch.randn(1, 3, 8, 8, device="cuda")
    t = torch.tensor(5, device="cuda")
    program = torch.export.export(unet, (x, t))
    spec = GraphClassSpec("tests/ddpm-unet-cuda", "dropin", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility(sm, toolchain=toolchain).key(spec.declare())
    result = Engine(root / "store").ensure(key, root / "graph", target=sm, toolchain=toolchain, recipe=lambda: spec)
    return {"root": root, "unet": unet, "graph": result.compiled_graph}


@pytest.mark.real_aoti
def test_the_graph_dropped_into_a_ddpm_pipeline_on_cuda_gives_the_eager_images(minted: dict[str, Any]) -> None:
    unet = minted["unet"]
    pipe = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=50)).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    eager = images(pipe)
    # As docs/run.md shows it: the pipeline hands the graph a CPU 0-d timestep.
    pipe.unet = minted["graph"].load(unet).as_module(like=unet)
    dropped = images(pipe)
    assert type(pipe.unet).__name__ == "GraphModule"
    np.testing.assert_allclose(dropped, eager, atol=2e-3)
    torch.cuda.synchronize()


@pytest.mark.real_aoti
def test_inputs_on_another_device_are_refused_on_every_path(minted: dict[str, Any], tmp_path: Path) -> None:
    unet, graph = minted["unet"], minted["graph"]
    loaded = graph.load(unet)
    module = loaded.as_module(like=unet)
    x_cpu, t = torch.randn(1, 3, 8, 8), torch.tensor(5)
    with pytest.raises(BindingError) as e:
        loaded(x_cpu, t)
    assert e.value.code == "run.call_invalid"
    assert "cpu" in str(e.value) and "cuda:0" in str(e.value)
    with pytest.raises(BindingError) as e:
        module(x_cpu, t)
    assert e.value.code == "run.call_invalid"
    # The same call with the batch on the device runs, the CPU timestep moved.
    with torch.no_grad():
        expected = unet(x_cpu.cuda(), t).sample
    torch.testing.assert_close(module(x_cpu.cuda(), t).sample, expected, atol=2e-3, rtol=2e-3)
    # load_native: host memory is copied to the device (its contract for numpy);
    # the process never reads a buffer of another device.
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in unet.state_dict().items()}, str(tmp_path / "w.safetensors"))
    native = graph.load_native(tmp_path / "w.safetensors", device="cuda:0")
    out = native(x_cpu.cuda(), t.cuda())
    got = torch.from_dlpack(out.sample if hasattr(out, "sample") else out[0])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    torch.cuda.synchronize()
