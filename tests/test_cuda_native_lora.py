"""LoRA hot-swap on the native weights set on CUDA (issue 33 item 3 on ``load_native``):
``NativeWeightsSet`` on the GPU bound to a ``load_native`` graph of the UNet that
test_cuda_weights_once.py mints, a real PEFT LoRA fused through libtorch's shim
against the torch-path ``WeightsSet`` with the same LoRA and against PEFT's merge, a
swap while calls run on another thread, and a removal bit for bit. Needs a CUDA
device, diffusers and peft; the device machine runs it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_compiled_graphs import WeightsSet

from .test_cuda_weights_once import _peft_lora, minted, wide_unet  # noqa: F401  (minted: a fixture)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.real_aoti,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_lora_swaps_on_a_native_cuda_set_as_on_the_torch_set(
    minted: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    from torch_compiled_graphs import NativeWeightsSet

    device = f"cuda:{torch.cuda.current_device()}"
    unet = wide_unet().cuda()
    weights = tmp_path / "unet.safetensors"
    save_file({k: v.detach().contiguous() for k, v in unet.state_dict().items()}, weights)
    stored = minted["graph"]
    native_set = NativeWeightsSet(weights, device=device)
    native = stored.load_native(native_set)
    x, t = minted["x"], minted["t"]

    def out() -> Any:
        y = torch.from_dlpack(native(x, t).sample).clone()
        torch.cuda.synchronize()
        return y

    before = out()
    torch.testing.assert_close(before, minted["y"], rtol=1e-2, atol=1e-2)
    lora_a, eager_a = _peft_lora(unet, 11, rank=8, alpha=16)
    lora_b, eager_b = _peft_lora(unet, 12, rank=4, alpha=4)
    paths = {}
    for label, lora in (("a", lora_a), ("b", lora_b)):
        paths[label] = os.fspath(tmp_path / f"{label}.safetensors")
        save_file({k: v.detach().contiguous().cpu() for k, v in lora.items()}, paths[label])
    with torch.no_grad():
        want = {"base": minted["y"], "a": eager_a(x, t).sample, "b": eager_b(x, t).sample}
    torch_set = WeightsSet(unet)
    torch_graph = stored.load(torch_set)
    held = native_set.nbytes

    native_set.apply_lora(paths["a"], name="a")
    torch_set.apply_lora(lora_a, name="a")
    with torch.no_grad():
        torch.testing.assert_close(out(), torch_graph(x, t).sample, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out(), want["a"], rtol=1e-2, atol=1e-2)
    assert native_set.lora is not None and torch_set.lora is not None
    assert native_set.lora["targets"] == torch_set.lora["targets"]
    assert native_set.nbytes == held + (torch_set.nbytes - sum(v.numel() * 4 for v in unet.state_dict().values()))

    # Swaps while another thread calls on its own stream: every call sees one LoRA whole.
    seen: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def caller() -> None:
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    got = torch.from_dlpack(native(x, t).sample)
                    torch.cuda.synchronize()
                    label = [k for k, v in want.items() if torch.allclose(got, v, rtol=1e-2, atol=1e-2)]
                    seen.append(label[0] if label else "mixed")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        for _ in range(5):
            native_set.replace_lora(paths["b"], name="b")
            native_set.replace_lora(paths["a"], name="a")
        native_set.replace_lora(paths["b"], name="b")
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert "mixed" not in seen, seen
    torch.testing.assert_close(out(), want["b"], rtol=1e-2, atol=1e-2)

    native_set.remove_lora()
    assert native_set.lora is None and native_set.nbytes == held
    assert torch.equal(out(), before)  # bit for bit
