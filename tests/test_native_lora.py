"""LoRA hot-swap on the native weights set (issue 33 item 3 without torch at run time):
``NativeWeightsSet.apply_lora`` / ``replace_lora`` / ``remove_lora`` / ``lora`` on a
set bound to a ``load_native`` graph of the tiny diffusers UNet, against the torch-path
``WeightsSet`` with the same real PEFT LoRAs (the fixtures of test_weights_once.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import refused_binding, tiny_unet
from .test_weights_once import loras  # noqa: F401  (a fixture)

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


def _native_on_a_set(ddpm: dict[str, Any]) -> tuple[Any, Any]:
    """A load_native graph of the UNet bound to a NativeWeightsSet of its checkpoint."""
    from torch_compiled_graphs import NativeWeightsSet

    weights = ddpm["root"] / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors"
    weights_set = NativeWeightsSet(weights)
    return ddpm["graph"].load_native(weights_set), weights_set


@pytest.mark.real_aoti
def test_a_lora_on_a_native_set_matches_the_torch_set_and_is_removed_bit_for_bit(
    ddpm: dict[str, Any],
    loras: dict[str, Any],  # noqa: F811
) -> None:
    from torch_compiled_graphs import WeightsSet

    native, weights_set = _native_on_a_set(ddpm)
    x, t = loras["x"].numpy(), loras["t"].numpy()

    def out() -> Any:
        return np.array(native(x, t).sample, copy=True)

    before = out()
    np.testing.assert_allclose(before, ddpm["y"].numpy(), rtol=1e-5, atol=1e-5)
    held = weights_set.nbytes
    assert weights_set.lora is None

    unet = tiny_unet()
    torch_set = WeightsSet(unet)
    torch_graph = ddpm["graph"].load(torch_set)

    def torch_out() -> Any:
        with torch.no_grad():
            return torch_graph(loras["x"], loras["t"]).sample.numpy()

    # diffusers' file (alpha in its header metadata), by its directory.
    weights_set.apply_lora(loras["diffusers"], name="a")
    torch_set.apply_lora(loras["diffusers"], name="a")
    np.testing.assert_allclose(out(), torch_out(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out(), loras["a"].numpy(), rtol=1e-5, atol=1e-5)
    info, want = weights_set.lora, torch_set.lora
    assert info is not None and want is not None
    assert info == {**want, "scale": 1.0}
    # Memory: the targeted tensors once more (their base values), no more.
    base = {k: v for k, v in unet.state_dict().items()}
    assert weights_set.nbytes == held + sum(base[n].numel() * 4 for n in info["targets"])

    # PEFT's directory (alpha in adapter_config.json): swapped in one step, from the base.
    weights_set.replace_lora(loras["peft"], name="b")
    torch_set.replace_lora(loras["peft"], name="b")
    np.testing.assert_allclose(out(), torch_out(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out(), loras["b"].numpy(), rtol=1e-5, atol=1e-5)
    assert weights_set.lora is not None and torch_set.lora is not None
    assert weights_set.lora["targets"] == torch_set.lora["targets"]

    weights_set.remove_lora()
    assert weights_set.lora is None and weights_set.nbytes == held
    assert np.array_equal(out(), before)  # bit for bit
    weights_set.remove_lora()  # nothing fused: nothing to do


@pytest.mark.real_aoti
def test_a_lora_that_does_not_fit_a_native_set_is_refused_and_changes_nothing(
    ddpm: dict[str, Any],
    loras: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    native, weights_set = _native_on_a_set(ddpm)
    x, t = loras["x"].numpy(), loras["t"].numpy()

    def out() -> Any:
        return np.array(native(x, t).sample, copy=True)

    before = out()
    good = load_file(loras["diffusers"] / "pytorch_lora_weights.safetensors")
    name = "unet.down_blocks.0.resnets.0.conv1"
    wrong_shape = dict(good)
    wrong_shape[f"{name}.lora_B.weight"] = torch.zeros(9, 4, 1, 1)
    unknown = dict(good)
    unknown["unet.mid_block.nothing.lora_A.weight"] = torch.zeros(4, 8)
    unknown["unet.mid_block.nothing.lora_B.weight"] = torch.zeros(8, 4)
    paths = []
    for i, bad in enumerate((wrong_shape, unknown)):
        save_file(bad, tmp_path / f"bad{i}.safetensors")
        paths.append(tmp_path / f"bad{i}.safetensors")
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    paths.append(tmp_path / "broken.safetensors")
    for bad_path in paths:
        refused_binding("run.lora_invalid", weights_set.apply_lora, bad_path)
        assert weights_set.lora is None
        assert np.array_equal(out(), before)
    refused_binding("run.lora_invalid", weights_set.apply_lora, paths[0], scale=float("nan"))
    refused_binding("run.lora_invalid", weights_set.apply_lora, {"a state_dict": 1})  # a path only, natively

    # A refused replacement keeps the fused LoRA; a second apply is refused.
    weights_set.apply_lora(loras["diffusers"], scale=0.5, name="a")
    fused = out()
    assert not np.array_equal(fused, before)
    for bad_path in paths:
        refused_binding("run.lora_invalid", weights_set.replace_lora, bad_path)
    refused_binding("run.lora_invalid", weights_set.apply_lora, loras["diffusers"])
    assert weights_set.lora is not None and weights_set.lora["name"] == "a"
    assert np.array_equal(out(), fused)
    weights_set.remove_lora()
    assert np.array_equal(out(), before)
