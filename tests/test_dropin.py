"""Drop-in use and outputs on a real diffusers model (issue 24, items 3 and 4).

One real AOTInductor compile per session: a tiny ``UNet2DModel`` (random
weights, seeded) exported with the call ``DDPMPipeline`` makes
(``unet(sample, t)``, ``t`` a 0-d tensor), minted on the CPU. The pipeline is
saved as a user has it (``save_pretrained``). Fresh processes then resolve the
graph and

- drop it into the pipeline loaded from that directory and run it end to end
  with a fixed generator: the same images as the eager pipeline;
- ``load()`` it in a worker that has not imported diffusers (the library's own
  ``UNet2DOutput`` comes back, its module imported on demand) and in one where
  diffusers cannot be imported (a ``GraphOutput``), never torch's raw error;
- ``load_native`` it without torch or diffusers: a ``GraphOutput`` by field name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import SEED, STEPS
from .conftest import refused_binding as refused

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")


def fresh(code: str, **values: Any) -> dict[str, Any]:
    """Run ``code`` (with ``values`` bound as globals) in a fresh interpreter; its last
    stdout line is JSON."""
    prelude = "".join(f"{name} = {value!r}\n" for name, value in values.items())
    out = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.real_aoti
def test_the_graph_dropped_into_a_ddpm_pipeline_in_a_fresh_process_gives_the_eager_images(
    ddpm: dict[str, Any],
) -> None:
    root = ddpm["root"]
    code = """
        import inspect, json
        import numpy as np, torch
        from diffusers import DDPMPipeline
        from torch_compiled_graphs import Engine

        pipe = DDPMPipeline.from_pretrained(ROOT + "/pipeline")
        pipe.set_progress_bar_config(disable=True)
        graph = Engine(ROOT + "/store").resolve(KEY, ROOT + "/fresh-pipeline")
        unet = pipe.unet
        module = graph.load(unet).as_module(like=unet)
        pipe.unet = module
        del unet
        images = pipe(num_inference_steps=STEPS, generator=torch.Generator().manual_seed(SEED),
                      output_type="np").images
        np.save(ROOT + "/dropped.npy", images)
        x, t = torch.zeros(1, 3, 8, 8), torch.tensor(3)
        print(json.dumps({
            "unet": type(pipe.unet).__name__,
            "pipe_device": str(pipe.device), "pipe_dtype": str(pipe.dtype),
            "sample_size": pipe.unet.config.sample_size, "in_channels": pipe.unet.config.in_channels,
            "signature": list(inspect.signature(pipe.unet.forward).parameters),
            "return_dict": type(pipe.unet(x, t)).__name__,
            "tuple": [type(v).__name__ for v in pipe.unet(x, t, return_dict=False)],
            "keywords": type(pipe.unet(sample=x, timestep=t, class_labels=None, return_dict=True)).__name__,
        }))
        """
    result = fresh(code, ROOT=str(root), KEY=ddpm["key"], STEPS=STEPS, SEED=SEED)
    assert result == {
        "unet": "GraphModule",
        "pipe_device": "cpu",
        "pipe_dtype": "torch.float32",
        "sample_size": 8,
        "in_channels": 3,
        "signature": ["sample", "timestep", "class_labels", "return_dict"],
        "return_dict": "UNet2DOutput",
        "tuple": ["Tensor"],
        "keywords": "UNet2DOutput",
    }
    eager, dropped = np.load(root / "eager.npy"), np.load(root / "dropped.npy")
    assert dropped.shape == eager.shape == (1, 8, 8, 3)
    np.testing.assert_allclose(dropped, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.real_aoti
@pytest.mark.parametrize("diffusers_importable", [True, False])
def test_load_in_a_worker_without_diffusers_imported_rebuilds_the_class_or_a_graph_output(
    ddpm: dict[str, Any], diffusers_importable: bool
) -> None:
    """A worker that never imported diffusers: ``load()`` imports the output class's
    module when it can; where it cannot, the outputs come back as a GraphOutput."""
    code = """
        import json, sys
        if not IMPORTABLE:
            sys.modules["diffusers"] = None  # what a worker without diffusers installed sees
        import numpy as np, torch
        from safetensors.torch import load_file
        from torch_compiled_graphs import Engine

        graph = Engine(ROOT + "/store").resolve(KEY, ROOT + "/fresh-load-" + str(IMPORTABLE))
        weights = load_file(ROOT + "/pipeline/unet/diffusion_pytorch_model.safetensors")
        before = "diffusers" in sys.modules and sys.modules["diffusers"] is not None
        loaded = graph.load(weights)
        call = np.load(ROOT + "/call.npz")
        out = loaded(torch.from_numpy(call["x"]), torch.from_numpy(call["t"]))
        print(json.dumps({
            "before": before, "type": type(out).__module__ + "." + type(out).__name__,
            "output_type": loaded.output_type, "fields": list(out.keys()),
            "error": float((out.sample - torch.from_numpy(call["y"])).abs().max()),
            "same_by_index": bool(out[0] is out.sample),
        }))
        """
    result = fresh(code, ROOT=str(ddpm["root"]), KEY=ddpm["key"], IMPORTABLE=diffusers_importable)
    assert result["before"] is False
    if diffusers_importable:
        assert result["type"] == "diffusers.models.unets.unet_2d.UNet2DOutput"
        assert result["output_type"] == "torch"
    else:
        assert result["type"] == "torch_compiled_graphs.outputs.GraphOutput"
        assert result["output_type"] == "GraphOutput"
    assert result["fields"] == ["sample"] and result["same_by_index"] is True
    assert result["error"] < 1e-5


@pytest.mark.real_aoti
def test_load_native_returns_the_unet_output_by_field_name_without_torch_or_diffusers(
    ddpm: dict[str, Any],
) -> None:
    code = """
        import json, sys
        import numpy as np
        from torch_compiled_graphs import Engine
        from torch_compiled_graphs.native import to_numpy

        graph = Engine(ROOT + "/store").resolve(KEY, ROOT + "/fresh-native")
        native = graph.load_native(ROOT + "/pipeline/unet/diffusion_pytorch_model.safetensors")
        call = np.load(ROOT + "/call.npz")
        out = native(call["x"], call["t"])
        print(json.dumps({
            "type": type(out).__name__, "type_name": out.type_name, "fields": list(out),
            "error": float(np.abs(np.asarray(out.sample) - call["y"]).max()),
            "to_tuple": len(out.to_tuple()), "index": out[0] is out["sample"],
            "f32": str(to_numpy(out.sample, dtype="float32").dtype),
            "imported": sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules),
        }))
        """
    result = fresh(code, ROOT=str(ddpm["root"]), KEY=ddpm["key"])
    assert result == {
        "type": "GraphOutput",
        "type_name": "diffusers.models.unets.unet_2d.UNet2DOutput",
        "fields": ["sample"],
        "error": pytest.approx(0.0, abs=1e-5),
        "to_tuple": 1,
        "index": True,
        "f32": "float32",
        "imported": [],
    }


@pytest.mark.real_aoti
def test_the_drop_in_refuses_what_the_exported_call_does_not_cover(ddpm: dict[str, Any]) -> None:
    unet, x, t = ddpm["unet"], ddpm["x"], ddpm["t"]
    module = ddpm["graph"].load(unet).as_module(like=unet)
    with torch.no_grad():
        torch.testing.assert_close(module(x, t).sample, ddpm["y"], rtol=1e-5, atol=1e-5)
    # Arguments the program was not exported with: only at their default.
    e = refused("run.call_invalid", module, x, t, class_labels=torch.tensor([1]))
    assert "class_labels" in str(e)
    assert module(x, t, None).sample.shape == (1, 3, 8, 8)
    # Not the module's convention at all, or a value where the export took a tensor.
    refused("run.call_invalid", module, x)
    refused("run.call_invalid", module, x, t, extra=1)
    refused("run.call_invalid", module, x, 5)
    refused("run.call_invalid", module, x, t, return_dict="yes")
    refused("run.input_mismatch", module, x, t.float())
    refused("run.input_mismatch", module, torch.zeros(2, 3, 8, 8), t)
    # The LoadedGraph under it checks each call against the call ingress before the runtime.
    loaded = module.graph
    refused("run.call_invalid", loaded, x, 5)
    refused("run.input_mismatch", loaded, x, t.float())
    refused("run.input_mismatch", loaded, x[:, :, :4], t)
    # It stays where it was loaded.
    assert module.to("cpu") is module and module.to(torch.float32) is module
    refused("run.device_mismatch", module.to, "meta")
    refused("run.device_mismatch", module.to, torch.float16)
    # Constants are the non-tensor arguments of the exported call; this one has none.
    refused("run.call_invalid", ddpm["graph"].load(unet).as_module, unet, constants={"class_labels": 1})
    refused("run.call_invalid", ddpm["graph"].load(unet).as_module, object())
    # A module of another forward is not what the graph was exported from.
    e = refused("run.call_invalid", ddpm["graph"].load(unet).as_module, Other())
    assert "['sample', 'timestep']" in str(e)


class Other(torch.nn.Module):
    def forward(self, a: Any, b: Any) -> Any:
        return a + b


# ------------------------------------------------ transformers (the real-model tier)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny GPT-2 (untied, random weights, seeded) saved with ``save_pretrained``, and its
    ``transformer`` (a ``GPT2Model``, which returns a ``ModelOutput``) minted as called
    with ``input_ids``."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    root = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        use_cache=False,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config).eval()
    lm.save_pretrained(root / "gpt2")
    save_file(dict(lm.transformer.state_dict()), root / "transformer.safetensors")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = lm.transformer(ids).last_hidden_state
        logits = lm(ids).logits
    np.savez(root / "call.npz", ids=ids.numpy(), hidden=hidden.numpy(), logits=logits.numpy())
    program = torch.export.export(lm.transformer, (ids,))
    spec = GraphClassSpec("tests/gpt2-transformer", "dropin", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    Engine(root / "store").ensure(key, root / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec)
    return {"root": root, "key": str(key)}


@pytest.mark.real_aoti
@pytest.mark.realmodels
def test_a_transformers_model_runs_with_the_graph_in_place_of_its_transformer(gpt2: dict[str, Any]) -> None:
    code = """
        import json
        import numpy as np, torch
        from transformers import GPT2LMHeadModel
        from torch_compiled_graphs import Engine

        lm = GPT2LMHeadModel.from_pretrained(ROOT + "/gpt2").eval()
        graph = Engine(ROOT + "/store").resolve(KEY, ROOT + "/fresh-lm")
        lm.transformer = graph.load(lm.transformer).as_module(like=lm.transformer)
        call = np.load(ROOT + "/call.npz")
        ids = torch.from_numpy(call["ids"])
        with torch.no_grad():
            out = lm(ids)
            as_tuple = lm(ids, return_dict=False)
            inner = lm.transformer(input_ids=ids, attention_mask=None, use_cache=None)
        try:
            lm.transformer(ids, attention_mask=torch.ones(1, 6, dtype=torch.long))
            refused = None
        except Exception as exc:
            refused = getattr(exc, "code", repr(exc))
        print(json.dumps({
            "out": type(out).__name__, "inner": type(inner).__name__,
            "logits": float(np.abs(out.logits.numpy() - call["logits"]).max()),
            "tuple": float(np.abs(as_tuple[0].numpy() - call["logits"]).max()),
            "hidden": float(np.abs(inner.last_hidden_state.numpy() - call["hidden"]).max()),
            "refused": refused,
        }))
        """
    result = fresh(code, ROOT=str(gpt2["root"]), KEY=gpt2["key"])
    assert result["out"] == "CausalLMOutputWithCrossAttentions"
    assert result["inner"] == "BaseModelOutputWithPastAndCrossAttentions"
    assert result["logits"] < 1e-5 and result["tuple"] < 1e-5 and result["hidden"] < 1e-5
    assert result["refused"] == "run.call_invalid"


@pytest.mark.real_aoti
@pytest.mark.realmodels
@pytest.mark.parametrize("transformers_importable", [True, False])
def test_a_worker_that_never_imported_transformers_gets_the_model_output_or_a_graph_output(
    gpt2: dict[str, Any], transformers_importable: bool
) -> None:
    code = """
        import json, sys
        if not IMPORTABLE:
            sys.modules["transformers"] = None
        import numpy as np, torch
        from safetensors.torch import load_file
        from torch_compiled_graphs import Engine

        graph = Engine(ROOT + "/store").resolve(KEY, ROOT + "/fresh-load-" + str(IMPORTABLE))
        before = sys.modules.get("transformers") is not None
        loaded = graph.load(load_file(ROOT + "/transformer.safetensors"))
        call = np.load(ROOT + "/call.npz")
        out = loaded(torch.from_numpy(call["ids"]))
        native = graph.load_native(ROOT + "/transformer.safetensors")(call["ids"])
        print(json.dumps({
            "before": before, "type": type(out).__module__ + "." + type(out).__name__,
            "native": type(native).__name__ + ":" + native.type_name, "fields": list(out.keys()),
            "error": float((out.last_hidden_state - torch.from_numpy(call["hidden"])).abs().max()),
            "native_error": float(np.abs(np.asarray(native[0]) - call["hidden"]).max()),
        }))
        """
    result = fresh(code, ROOT=str(gpt2["root"]), KEY=gpt2["key"], IMPORTABLE=transformers_importable)
    name = "transformers.modeling_outputs.BaseModelOutputWithPastAndCrossAttentions"
    assert result["before"] is False
    assert result["type"] == (name if transformers_importable else "torch_compiled_graphs.outputs.GraphOutput")
    assert result["native"] == "GraphOutput:" + name
    assert result["fields"] == ["last_hidden_state"]
    assert result["error"] < 1e-5 and result["native_error"] < 1e-5


# ------------------------------------------------ a non-tensor argument the export specialised


class Scaled(torch.nn.Module):
    """``forward(x, scale, return_dict)``: ``scale`` a float the export bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: Any, scale: float = 1.0, return_dict: bool = True) -> Any:
        y = self.linear(x) * scale
        return {"y": y} if return_dict else (y,)


@pytest.mark.real_aoti
@pytest.mark.realmodels
def test_a_specialised_constant_must_be_stated_and_then_is_held_to(tmp_path: Path) -> None:
    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), {"scale": 2.0})
    spec = GraphClassSpec("tests/scaled", "dropin", program)
    assert spec.declare().graph["pytree"]["ingress"]["excluded_inputs"] == ["scale"]
    toolchain = record_toolchain()
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    graph = (
        Engine(tmp_path / "store")
        .ensure(key, tmp_path / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec)
        .compiled_graph
    )
    loaded = graph.load(model)
    e = refused("run.call_invalid", loaded.as_module, model)
    assert "scale" in str(e) and "constants=" in str(e)
    module = loaded.as_module(like=model, constants={"scale": 2.0})
    with torch.no_grad():
        expected = model(x, scale=2.0)["y"]
        torch.testing.assert_close(module(x, scale=2.0)["y"], expected)
        torch.testing.assert_close(module(x, 2.0)["y"], expected)
    refused("run.call_invalid", module, x, scale=3.0)
    refused("run.call_invalid", module, x, scale=2)  # an int is not the float the export took
    e = refused("run.call_invalid", module, x)  # the default (1.0) is not the graph
    assert "pass scale=2.0" in str(e)
    # Not a record output: return_dict does not reshape a plain dict.
    assert isinstance(module(x, 2.0, return_dict=True), dict)
    refused("run.call_invalid", module, x, 2.0, return_dict=False)
