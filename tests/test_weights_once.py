"""Weights once (issue 33): zero-copy binding, stale-binding detection, one weights
set for several graphs, and LoRA hot-swap on a set.

The binding tests use the 0.2.0 reference artifact (an MLP whose compiled code
reads the first layer's weight through a folded constant, ``_FOLDED_CONST_permute``,
and the biases directly): no compile. The LoRA tests use the tiny diffusers UNet
the drop-in tests mint (one real compile per session, shared through conftest)
with real LoRAs made by PEFT and saved by diffusers' ``save_lora_weights`` and by
PEFT's ``save_pretrained``, against PEFT's own merge run eagerly.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any

import pytest

from .conftest import REFERENCE_WEIGHTS, refused_binding, tiny_unet

torch = pytest.importorskip("torch")


@pytest.fixture
def mlp() -> Any:
    from safetensors.torch import load_file

    from .models import MLP

    model = MLP().eval()
    model.load_state_dict(load_file(REFERENCE_WEIGHTS))
    return model


def _x() -> Any:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def _close(graph: Any, model: Any) -> None:
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(graph(x), model(x), rtol=1e-6, atol=1e-6)


# -- zero-copy binding -------------------------------------------------------------


def test_load_of_a_module_binds_its_own_storage_and_the_graph_reads_it_live(graph: Any, mlp: Any) -> None:
    loaded = graph.load(mlp)
    assert loaded.copied_constants == []
    for name in ("l1.weight", "l1.bias", "l2.weight", "l2.bias"):
        assert loaded._bound[name].data_ptr() == mlp.get_parameter(name).data_ptr(), name
    # Only the two folded constants are the graph's own memory.
    assert loaded.added_nbytes == (16 * 32 + 32 * 8) * 4
    _close(loaded, mlp)
    # A write through .data bumps no version counter, so nothing is refreshed: the
    # output can follow only if the container reads the module's own memory.
    with torch.no_grad():
        mlp.l2.bias.data.add_(1.0)
    _close(loaded, mlp)
    assert loaded.binding_generation == 1


def test_in_place_updates_are_seen_through_the_constants_the_compiler_folded(graph: Any, mlp: Any) -> None:
    loaded = graph.load(mlp)
    _close(loaded, mlp)
    with torch.no_grad():
        mlp.l1.weight.mul_(-2.0)  # read by the graph only through _FOLDED_CONST_permute
        mlp.l2.weight.add_(0.5)
    _close(loaded, mlp)
    # The folds were recomputed (into new buffers): captures of the old generation are void.
    assert loaded.binding_generation == 2
    # load_state_dict copies in place too.
    other = {k: v * 3 for k, v in mlp.state_dict().items()}
    mlp.load_state_dict(other)
    _close(loaded, mlp)


def test_tensors_the_graph_cannot_read_in_place_are_copied_reported_and_kept_in_step(graph: Any, mlp: Any) -> None:
    state = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    # A transposed view (not contiguous) and a view at a 4-byte offset (misaligned).
    state["l2.weight"] = state["l2.weight"].t().contiguous().t()
    backing = torch.empty(33)
    backing[1:].copy_(state["l1.bias"])
    state["l1.bias"] = backing[1:]
    loaded = graph.load(state)
    rows = {row["name"]: row for row in loaded.copied_constants}
    assert sorted(rows) == ["l1.bias", "l2.weight"]
    assert rows["l2.weight"]["nbytes"] == 8 * 32 * 4 and "not contiguous" in rows["l2.weight"]["reason"]
    assert rows["l1.bias"]["nbytes"] == 32 * 4 and "aligned" in rows["l1.bias"]["reason"]
    assert loaded._bound["l1.weight"].data_ptr() == state["l1.weight"].data_ptr()
    assert loaded.added_nbytes == (8 * 32 + 32 + 16 * 32 + 32 * 8) * 4
    eager = copy.deepcopy(mlp)
    eager.load_state_dict(state)
    _close(loaded, eager)
    # An in-place change of a copied tensor's source reaches the copy before the next call.
    with torch.no_grad():
        state["l1.bias"].add_(1.0)
        state["l2.weight"].mul_(2.0)
    eager.load_state_dict(state)
    _close(loaded, eager)


def test_the_debug_log_names_each_copy(graph: Any, mlp: Any, caplog: pytest.LogCaptureFixture) -> None:
    state = dict(mlp.state_dict())
    state["l2.weight"] = state["l2.weight"].t().contiguous().t()
    with caplog.at_level("DEBUG", logger="torch_compiled_graphs"):
        graph.load(state)
    assert any("1 constants copied (1024 bytes): l2.weight (not contiguous" in r.message for r in caplog.records)


# -- stale bindings ----------------------------------------------------------------


def test_a_reassigned_parameter_refuses_every_call_until_rebind(graph: Any, mlp: Any) -> None:
    loaded = graph.load(mlp)
    mlp.l2.weight = mlp.l2.weight  # the same tensor again: nothing moved
    assert loaded.stale_constants() == []
    mlp.l2.weight = torch.nn.Parameter(mlp.l2.weight.detach() * 2)
    assert loaded.stale_constants() == ["l2.weight"]
    e = refused_binding("run.weights_stale", loaded, _x())
    assert "l2.weight" in str(e) and "rebind" in str(e)
    loaded.rebind(mlp)
    assert loaded.stale_constants() == [] and loaded.binding_generation == 2
    _close(loaded, mlp)


def test_a_replaced_submodule_a_registered_buffer_and_a_data_swap_are_stale(graph: Any, mlp: Any) -> None:
    loaded = graph.load(mlp)
    mlp.l1 = torch.nn.Linear(16, 32)
    assert loaded.stale_constants() == ["l1.bias", "l1.weight"]
    refused_binding("run.weights_stale", loaded, _x())
    loaded.rebind(mlp)
    _close(loaded, mlp)
    # .data = swaps the storage under the same Parameter object: no hook runs, the
    # data pointer moves.
    mlp.l2.bias.data = mlp.l2.bias.data.clone() + 1
    assert loaded.stale_constants() == ["l2.bias"]
    refused_binding("run.weights_stale", loaded, _x())
    loaded.rebind(mlp)
    _close(loaded, mlp)


def test_a_state_dict_tensor_swapped_under_the_graph_is_stale(graph: Any, mlp: Any) -> None:
    state = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    loaded = graph.load(state)
    state["l1.weight"].data = torch.zeros(32, 16)
    assert loaded.stale_constants() == ["l1.weight"]
    refused_binding("run.weights_stale", loaded, _x())


def test_a_graph_bound_from_a_checkpoint_file_is_never_stale(graph: Any, mlp: Any) -> None:
    loaded = graph.load(REFERENCE_WEIGHTS)
    assert loaded.stale_constants() == [] and loaded.copied_constants == []
    # Its own allocation (the pipeline's read) plus the folded constants.
    assert loaded.added_nbytes >= (16 * 32 + 32 + 32 * 8 + 8) * 4 + (16 * 32 + 32 * 8) * 4
    _close(loaded, mlp)


# -- one weights set, many graphs -----------------------------------------------------


def test_two_graphs_bind_one_set_read_from_a_checkpoint_without_a_copy(tmp_path: Path, mlp: Any) -> None:
    from torch_compiled_graphs import WeightsSet

    from .conftest import resolve_reference

    stored_a = resolve_reference(tmp_path / "a")
    stored_b = resolve_reference(tmp_path / "b")
    weights = WeightsSet(REFERENCE_WEIGHTS)
    assert not weights.borrowed and weights.nbytes >= (16 * 32 + 32 + 32 * 8 + 8) * 4
    a, b = stored_a.load(weights), stored_b.load(weights)
    for name, tensor in weights.tensors.items():
        assert a._bound[name].data_ptr() == tensor.data_ptr() == b._bound[name].data_ptr(), name
    assert a.copied_constants == b.copied_constants == []
    assert a.added_nbytes == b.added_nbytes == (16 * 32 + 32 * 8) * 4  # folds only
    _close(a, mlp)
    _close(b, mlp)
    # Released in any order: the set first, then one graph; the other still runs.
    del weights
    gc.collect()
    _close(a, mlp)
    del a
    gc.collect()
    _close(b, mlp)


def test_a_set_borrowed_from_a_module_serves_graphs_with_the_modules_memory(graph: Any, mlp: Any) -> None:
    from torch_compiled_graphs import WeightsSet

    weights = WeightsSet(mlp)
    assert weights.borrowed and weights.module is mlp
    assert weights.nbytes == (16 * 32 + 32 + 32 * 8 + 8) * 4
    loaded = graph.load(weights)
    assert loaded._bound["l2.bias"].data_ptr() == mlp.l2.bias.data_ptr()
    _close(loaded, mlp)
    mlp.l2.bias = torch.nn.Parameter(torch.zeros(8))
    refused_binding("run.weights_stale", loaded, _x())


def test_one_pipeline_checkpoint_set_serves_each_components_graph_by_prefix(tmp_path: Path, mlp: Any) -> None:
    from torch_compiled_graphs import WeightsSet

    from .conftest import resolve_reference

    state = {f"first.{k}": v for k, v in mlp.state_dict().items()}
    second = copy.deepcopy(mlp)
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(-1)
    state.update({f"second.{k}": v for k, v in second.state_dict().items()})
    weights = WeightsSet(state)
    one = resolve_reference(tmp_path / "one").load(weights, strip_prefix="first.")
    two = resolve_reference(tmp_path / "two").load(weights, strip_prefix="second.")
    assert one.outside_prefix == two.outside_prefix == 4
    _close(one, mlp)
    _close(two, second)
    assert two._bound["l1.weight"].data_ptr() == second.l1.weight.data_ptr()


def test_a_set_on_another_device_or_with_foreign_names_is_refused(graph: Any, mlp: Any) -> None:
    from torch_compiled_graphs import WeightsSet

    refused_binding("run.device_mismatch", WeightsSet, mlp, device="meta")
    state = dict(mlp.state_dict())
    state["extra.weight"] = torch.zeros(2)
    refused_binding("run.constant_unexpected", graph.load, WeightsSet(state))
    refused_binding("run.weights_invalid", WeightsSet, {"a": 1})


# -- LoRA -------------------------------------------------------------------------------

LORA_TARGETS = ["conv1", "conv2", "time_emb_proj", "conv_shortcut"]


def _peft_lora(unet: Any, targets: list[str], rank: int, alpha: int, seed: int) -> tuple[Any, Any, Any]:
    """A real PEFT LoRA on a copy of ``unet`` (random A and B: a non-zero delta): the
    adapted model, its config and its state_dict (diffusers' names)."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    adapted = inject_adapter_in_model(config, copy.deepcopy(unet))
    return adapted, config, get_peft_model_state_dict(adapted)


def _merged(adapted: Any) -> Any:
    """PEFT's own fuse of the adapter into the base weights."""
    from peft.tuners.lora import LoraLayer

    for module in adapted.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    return adapted


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two LoRAs of the tiny UNet: one saved by diffusers' ``save_lora_weights`` (``unet.``
    names, alpha in its metadata), one by PEFT's ``save_pretrained`` (``base_model.model.``
    names, alpha in adapter_config.json), with the eager outputs of PEFT's merge."""
    pytest.importorskip("peft")
    diffusers = pytest.importorskip("diffusers")
    from peft import get_peft_model

    root = tmp_path_factory.mktemp("loras")
    unet = tiny_unet()
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor(5)
    adapted, config, state = _peft_lora(unet, LORA_TARGETS, rank=4, alpha=8, seed=11)
    diffusers.StableDiffusionPipeline.save_lora_weights(
        root / "diffusers", unet_lora_layers=state, unet_lora_adapter_metadata=config.to_dict()
    )
    with torch.no_grad():
        want_a = _merged(adapted)(x, t).sample
    adapted_b, config_b, _ = _peft_lora(unet, ["conv_in", "time_emb_proj", "linear_1"], rank=2, alpha=3, seed=12)
    peft_model = get_peft_model(copy.deepcopy(unet), config_b)
    peft_model.load_state_dict(
        {f"base_model.model.{k}": v for k, v in adapted_b.state_dict().items() if "lora_" in k}, strict=False
    )
    peft_model.save_pretrained(root / "peft")
    with torch.no_grad():
        want_b = _merged(adapted_b)(x, t).sample
    return {"diffusers": root / "diffusers", "peft": root / "peft", "x": x, "t": t, "a": want_a, "b": want_b}


def _unet_state(unet: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in unet.state_dict().items()}


@pytest.mark.real_aoti
def test_a_lora_is_applied_swapped_and_removed_on_every_graph_of_a_set(
    ddpm: dict[str, Any], loras: dict[str, Any]
) -> None:
    from torch_compiled_graphs import WeightsSet

    unet = tiny_unet()
    base = _unet_state(unet)
    weights = WeightsSet(unet)
    first, second = ddpm["graph"].load(weights), ddpm["graph"].load(weights)
    x, t = loras["x"], loras["t"]

    def both(want: Any) -> None:
        for graph in (first, second):
            with torch.no_grad():
                torch.testing.assert_close(graph(x, t).sample, want, rtol=1e-5, atol=1e-5)

    both(ddpm["y"])
    held = weights.nbytes
    weights.apply_lora(loras["diffusers"], name="a")
    both(loras["a"])
    lora = weights.lora
    assert lora is not None and lora["name"] == "a"
    assert len(lora["targets"]) == sum(1 for m in unet.modules() if type(m).__name__ in ("Conv2d", "Linear")) - len(
        [
            n
            for n, m in unet.named_modules()
            if type(m).__name__ in ("Conv2d", "Linear") and n.split(".")[-1] not in LORA_TARGETS
        ]
    )
    # Memory: the set grows by the targeted tensors once (their base values), no more.
    targeted = sum(base[n].numel() * base[n].element_size() for n in lora["targets"])
    assert weights.nbytes == held + targeted
    # The set is borrowed: the LoRA is fused into the module's own tensors, as fuse_lora does.
    with torch.no_grad():
        torch.testing.assert_close(unet(x, t).sample, loras["a"], rtol=1e-5, atol=1e-5)

    weights.replace_lora(loras["peft"], name="b")
    both(loras["b"])
    assert weights.lora is not None and weights.lora["name"] == "b"
    weights.remove_lora()
    both(ddpm["y"])
    assert weights.lora is None and weights.nbytes == held
    for name, value in unet.state_dict().items():
        assert torch.equal(value, base[name]), name  # bit for bit
    assert first.stale_constants() == [] and second.copied_constants == []


@pytest.mark.real_aoti
def test_a_lora_that_does_not_fit_is_refused_and_changes_nothing(
    ddpm: dict[str, Any], loras: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from torch_compiled_graphs import WeightsSet

    unet = tiny_unet()
    base = _unet_state(unet)
    weights = WeightsSet(unet)
    graph = ddpm["graph"].load(weights)
    good = {
        k.removeprefix("unet."): v
        for k, v in load_file(loras["diffusers"] / "pytorch_lora_weights.safetensors").items()
    }

    def unchanged() -> None:
        assert weights.lora is None
        for name, value in unet.state_dict().items():
            assert torch.equal(value, base[name]), name
        with torch.no_grad():
            torch.testing.assert_close(graph(loras["x"], loras["t"]).sample, ddpm["y"], rtol=1e-5, atol=1e-5)

    name = "down_blocks.0.resnets.0.conv1"
    wrong_shape = dict(good)
    wrong_shape[f"{name}.lora_B.weight"] = torch.zeros(9, 4, 1, 1)
    unknown = dict(good)
    unknown["mid_block.nothing.lora_A.weight"] = torch.zeros(4, 8)
    unknown["mid_block.nothing.lora_B.weight"] = torch.zeros(8, 4)
    rank_mismatch = dict(good)
    rank_mismatch[f"{name}.lora_A.weight"] = torch.zeros(3, 8, 3, 3)
    half = {k: v for k, v in good.items() if not k.endswith("lora_B.weight")}
    foreign = dict(good)
    foreign["something.else"] = torch.zeros(1)
    malformed = tmp_path / "broken.safetensors"
    malformed.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    two_components = {**{f"unet.{k}": v for k, v in good.items()}, "text_encoder.x.lora_A.weight": torch.zeros(1, 1)}
    save_file(two_components, tmp_path / "two.safetensors")
    for bad in (wrong_shape, unknown, rank_mismatch, half, foreign, malformed, tmp_path / "two.safetensors", {}):
        refused_binding("run.lora_invalid", weights.apply_lora, bad)
        unchanged()
    refused_binding("run.lora_invalid", weights.apply_lora, good, scale=float("nan"))
    unchanged()
    # A refused replacement keeps the LoRA that is fused.
    weights.apply_lora(good)
    fused = _unet_state(unet)
    refused_binding("run.lora_invalid", weights.replace_lora, wrong_shape)
    refused_binding("run.lora_invalid", weights.apply_lora, good)  # one at a time
    for name_, value in unet.state_dict().items():
        assert torch.equal(value, fused[name_]), name_
    # A pipeline's two-component LoRA binds with the component named. Saved without
    # diffusers' metadata, it has lost its alpha (8 for rank 4): scale 1 unless stated.
    weights.replace_lora(tmp_path / "two.safetensors", prefix="unet.", scale=8 / 4)
    with torch.no_grad():
        torch.testing.assert_close(graph(loras["x"], loras["t"]).sample, loras["a"], rtol=1e-5, atol=1e-5)
    weights.remove_lora()
    unchanged()


def test_lora_scale_follows_alpha_over_rank_times_the_users_scale(mlp: Any) -> None:
    from torch_compiled_graphs import WeightsSet

    base = mlp.l1.weight.detach().clone()
    weights = WeightsSet(mlp)
    down, up = torch.randn(2, 16), torch.randn(32, 2)
    weights.apply_lora({"l1.lora_A.weight": down, "l1.lora_B.weight": up, "l1.alpha": torch.tensor(6.0)}, scale=0.5)
    torch.testing.assert_close(mlp.l1.weight.detach(), base + 6.0 / 2 * 0.5 * (up @ down))
    # No alpha: scale 1 x the user's scale, as diffusers does.
    weights.replace_lora({"l1.lora_A.weight": down, "l1.lora_B.weight": up}, scale=2.0)
    torch.testing.assert_close(mlp.l1.weight.detach(), base + 2.0 * (up @ down))
    weights.remove_lora()
    assert torch.equal(mlp.l1.weight.detach(), base)


def test_a_lora_on_a_set_reaches_a_graph_through_its_folded_constants(graph: Any, mlp: Any) -> None:
    from torch_compiled_graphs import WeightsSet

    weights = WeightsSet(REFERENCE_WEIGHTS)
    loaded = graph.load(weights)
    down, up = torch.randn(2, 16), torch.randn(32, 2)
    weights.apply_lora({"base_model.model.l1.lora_A.weight": down, "base_model.model.l1.lora_B.weight": up})
    eager = copy.deepcopy(mlp)
    with torch.no_grad():
        eager.l1.weight.add_(up @ down)
    _close(loaded, eager)
    weights.remove_lora()
    _close(loaded, mlp)


def test_a_lora_update_waits_for_calls_in_flight_and_calls_wait_for_the_update(graph: Any, mlp: Any) -> None:
    import threading

    from torch_compiled_graphs import WeightsSet

    weights = WeightsSet(mlp)
    loaded = graph.load(weights)
    base = mlp.l1.weight.detach().clone()
    lora = {"l1.lora_A.weight": torch.randn(2, 16), "l1.lora_B.weight": torch.randn(32, 2)}
    # A call in flight holds the set's lock shared: the update does not write meanwhile.
    weights.lock.acquire_shared()
    update = threading.Thread(target=weights.apply_lora, args=(lora,))
    update.start()
    update.join(timeout=0.3)
    assert update.is_alive() and torch.equal(mlp.l1.weight.detach(), base)
    # And a call that starts while the update waits queues behind it (writer first).
    outputs: list[Any] = []
    call = threading.Thread(target=lambda: outputs.append(loaded(_x())))
    call.start()
    call.join(timeout=0.3)
    assert call.is_alive() and not outputs
    weights.lock.release_shared()
    update.join()
    call.join()
    assert not torch.equal(mlp.l1.weight.detach(), base)
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], mlp(_x()), rtol=1e-6, atol=1e-6)


def test_a_set_opens_a_pipelines_sharded_checkpoint_with_its_prefix(graph: Any, mlp: Any, tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    from torch_compiled_graphs import WeightsSet

    # save_pretrained's form past its shard size: one shard per tensor, by an index.
    weight_map = {}
    for i, (name, value) in enumerate(sorted(mlp.state_dict().items())):
        shard = f"model-{i + 1:05d}-of-00004.safetensors"
        save_file({f"unet.{name}": value.contiguous()}, str(tmp_path / shard))
        weight_map[f"unet.{name}"] = shard
    save_file({"vae.other": torch.zeros(2)}, str(tmp_path / "model-00005-of-00005.safetensors"))
    weight_map["vae.other"] = "model-00005-of-00005.safetensors"
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    weights = WeightsSet(tmp_path, strip_prefix="unet.")
    assert sorted(weights.tensors) == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    assert weights.outside_prefix == 1 and not weights.borrowed
    loaded = graph.load(weights)
    _close(loaded, mlp)
    assert loaded._bound["l2.weight"].data_ptr() == weights.tensors["l2.weight"].data_ptr()
