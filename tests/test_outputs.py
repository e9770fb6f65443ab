"""Outputs as users read them (issue 24, item 3), without a compile: the
GraphOutput record, the output specs torch writes for transformers and diffusers
output classes read by field name, every other node type refused with its name,
the import-on-demand of ``load()``'s spec reading in a fresh process, and the
torch-free bfloat16 -> float32 widening of ``native.to_numpy`` checked bit for
bit against torch's own conversion."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from torch_compiled_graphs.native import GraphOutput, _parse_spec, _unflatten, from_buffer, to_numpy
from torch_compiled_graphs.outputs import is_output_record

from .conftest import refused_binding as refused


def dumps(value: Any) -> str:
    """The treespec JSON torch writes for ``value``'s structure (what a package's call spec holds)."""
    from torch.utils import _pytree as pytree

    return str(pytree.treespec_dumps(pytree.tree_flatten(value)[1]))


# ---------------------------------------------------------------- GraphOutput


def test_a_graph_output_reads_by_name_attribute_index_and_slice_in_field_order() -> None:
    out = GraphOutput("transformers.modeling_outputs.CausalLMOutputWithPast", ["logits", "hidden_states"], [1, (2, 3)])
    assert out.type_name == "transformers.modeling_outputs.CausalLMOutputWithPast"
    assert list(out) == ["logits", "hidden_states"] and len(out) == 2
    assert out["logits"] == 1 and out.logits == 1 and out[0] == 1
    assert out[1] == (2, 3) and out[-1] == (2, 3) and out[0:2] == (1, (2, 3))
    assert out.to_tuple() == (1, (2, 3))
    assert dict(out) == {"logits": 1, "hidden_states": (2, 3)}
    assert list(out.items()) == [("logits", 1), ("hidden_states", (2, 3))]
    assert "logits" in out and "loss" not in out and 0 not in out
    assert out == {"logits": 1, "hidden_states": (2, 3)}
    assert "CausalLMOutputWithPast" in repr(out) and "logits=1" in repr(out)
    again = pickle.loads(pickle.dumps(out))
    assert again == out and again.type_name == out.type_name and list(again) == list(out)


def test_a_graph_output_is_read_only_and_names_its_fields_when_one_is_absent() -> None:
    out = GraphOutput("diffusers.models.unets.unet_2d.UNet2DOutput", ["sample"], [5])
    with pytest.raises(AttributeError, match="read-only"):
        out.sample = 6  # type: ignore[misc]
    with pytest.raises(AttributeError, match="read-only"):
        del out.sample
    with pytest.raises(AttributeError, match=r"no field 'loss' \(fields: \['sample'\]\)"):
        _ = out.loss
    with pytest.raises(KeyError):
        out["loss"]
    with pytest.raises(IndexError):
        out[1]
    with pytest.raises(TypeError):
        out[None]  # type: ignore[call-overload]
    with pytest.raises(ValueError):
        GraphOutput("x.Output", ["a", "a"], [1, 2])
    with pytest.raises(ValueError):
        GraphOutput("x.Output", ["a"], [1, 2])


def test_only_the_output_classes_of_transformers_and_diffusers_are_records() -> None:
    assert is_output_record("transformers.modeling_outputs.CausalLMOutputWithPast")
    assert is_output_record("transformers.models.llama.modeling_llama.LlamaModelOutput")
    assert is_output_record("diffusers.models.autoencoders.vae.DecoderOutput")
    assert is_output_record("diffusers.models.autoencoders.autoencoder_kl.AutoencoderKLOutput")
    assert not is_output_record("transformers.cache_utils.DynamicCache")
    assert not is_output_record("mypackage.outputs.ModelOutput")
    assert not is_output_record("collections.namedtuple")
    assert not is_output_record("transformers")
    assert not is_output_record("diffusersx.Output")


# ------------------------------------------------------- specs as torch writes them


def test_transformers_and_diffusers_outputs_are_read_by_field_name_none_fields_absent() -> None:
    import torch
    from diffusers.models.autoencoders.vae import DecoderOutput
    from diffusers.models.unets.unet_2d import UNet2DOutput
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits, h0, h1 = torch.zeros(2, 3), torch.ones(1), torch.full((2,), 2.0)
    value = CausalLMOutputWithPast(logits=logits, hidden_states=(h0, h1))  # loss, past_key_values: None
    spec = _parse_spec(dumps(value), "output", records=True)
    assert spec == (
        "record",
        "transformers.modeling_outputs.CausalLMOutputWithPast",
        ["logits", "hidden_states"],
        [("leaf",), ("tuple", [("leaf",), ("leaf",)])],
    )
    out = _unflatten(spec, iter(["L", "H0", "H1"]))
    assert isinstance(out, GraphOutput)
    assert out.logits == "L" and out.hidden_states == ("H0", "H1") and out[0] == "L" and "loss" not in out
    # The record's fields are what the library's own class would hold, in its order.
    assert list(out) == list(value.keys())

    # Diffusers' BaseOutput family, alone and nested in the tuple/dict structures that stay as they are.
    pair = (UNet2DOutput(sample=logits), {"decoded": DecoderOutput(sample=h0)})
    spec = _parse_spec(dumps(pair), "output", records=True)
    a, b = _unflatten(spec, iter([1, 2]))
    assert a.type_name == "diffusers.models.unets.unet_2d.UNet2DOutput" and a.sample == 1
    assert list(b) == ["decoded"] and b["decoded"].type_name.endswith(".DecoderOutput") and b["decoded"][0] == 2


def test_records_are_output_specs_only_and_every_other_node_type_is_refused_by_name() -> None:
    import torch
    from transformers.modeling_outputs import BaseModelOutput

    text = dumps(BaseModelOutput(last_hidden_state=torch.zeros(1)))
    # An input spec is never read as records (the call convention is tuples, lists and dicts).
    e = refused("run.native_unsupported", _parse_spec, text, "input")
    assert "transformers.modeling_outputs.BaseModelOutput" in str(e)
    for kind in ("collections.namedtuple", "transformers.cache_utils.DynamicCache", "mypackage.Output"):
        node = {
            "type": kind,
            "context": '["a"]',
            "children_spec": [{"type": None, "context": None, "children_spec": []}],
        }
        e = refused("run.native_unsupported", _parse_spec, json.dumps([1, node]), "output", records=True)
        assert kind in str(e) and "use load()" in str(e)
        e = refused(
            "run.spec_unsupported",
            _parse_spec,
            json.dumps([1, node]),
            "output",
            records=True,
            unsupported="run.spec_unsupported",
        )
        assert kind in str(e) and "import the module" in str(e)


@pytest.mark.parametrize(
    "context",
    ["null", '"sample"', '["sample", "sample"]', '["sample", 1]', '["a", "b"]', "not json", '{"sample": 1}'],
)
def test_a_record_whose_context_is_not_its_field_names_is_refused(context: str) -> None:
    kind = "diffusers.models.unets.unet_2d.UNet2DOutput"
    leaf = {"type": None, "context": None, "children_spec": []}
    text = json.dumps([1, {"type": kind, "context": context, "children_spec": [leaf, leaf]}])
    if context == '["a", "b"]':
        # Two distinct names for two children: a valid record.
        assert _parse_spec(text, "output", records=True)[2] == ["a", "b"]
        return
    e = refused("run.native_unsupported", _parse_spec, text, "output", records=True)
    assert kind in str(e) and "field names" in str(e)


def test_a_dict_node_whose_context_is_not_json_is_a_typed_refusal() -> None:
    text = json.dumps([1, {"type": "builtins.dict", "context": "{not json", "children_spec": []}])
    refused("run.native_unsupported", _parse_spec, text, "output", records=True)


# ------------------------------------------- load()'s reading of specs, fresh process

REGISTERING_MODULE = """
from dataclasses import dataclass
import torch.utils._pytree as pytree

@dataclass
class Pair:
    first: object
    second: object

pytree.register_pytree_node(
    Pair,
    lambda p: ([p.first, p.second], ["first", "second"]),
    lambda values, context: Pair(*values),
    serialized_type_name="tcg_h24_pairs.Pair",
)
"""


def run_fresh(code: str, cwd: Path) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; its last stdout line is JSON."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_load_reads_a_spec_after_importing_the_module_that_registers_its_type(tmp_path: Path) -> None:
    (tmp_path / "tcg_h24_pairs.py").write_text(REGISTERING_MODULE)
    leaf = {"type": None, "context": None, "children_spec": []}
    pair = {"type": "tcg_h24_pairs.Pair", "context": '["first", "second"]', "children_spec": [leaf, leaf]}
    unknown = {"type": "tcg_h24_absent_pkg.Output", "context": '["x"]', "children_spec": [leaf]}
    code = f"""
        import json, sys
        from torch_compiled_graphs.runner import _torch_spec, _unknown_types
        sys.path.insert(0, {str(tmp_path)!r})
        text = {json.dumps(json.dumps([1, pair]))}
        assert "tcg_h24_pairs" not in sys.modules
        before = _unknown_types(text)
        spec = _torch_spec(text, "output")
        import torch.utils._pytree as pytree
        value = pytree.tree_unflatten([1, 2], spec)
        missing = _torch_spec({json.dumps(json.dumps([1, unknown]))}, "output")
        print(json.dumps({{"before": before, "type": type(value).__module__ + "." + type(value).__name__,
                          "value": [value.first, value.second], "imported": "tcg_h24_pairs" in sys.modules,
                          "missing": missing is None}}))
        """
    result = run_fresh(code, tmp_path)
    assert result == {
        "before": ["tcg_h24_pairs.Pair"],
        "type": "tcg_h24_pairs.Pair",
        "value": [1, 2],
        "imported": True,
        "missing": True,
    }


def test_a_module_that_fails_to_import_is_not_importable_and_torch_never_raises_raw(tmp_path: Path) -> None:
    (tmp_path / "tcg_h24_broken.py").write_text("raise RuntimeError('broken at import')\n")
    leaf = {"type": None, "context": None, "children_spec": []}
    node = {"type": "tcg_h24_broken.SomeOutput", "context": '["x"]', "children_spec": [leaf]}
    code = f"""
        import json, sys
        from torch_compiled_graphs.runner import _torch_spec
        sys.path.insert(0, {str(tmp_path)!r})
        print(json.dumps({{"spec": _torch_spec({json.dumps(json.dumps([1, node]))}, "output")}}))
        """
    assert run_fresh(code, tmp_path) == {"spec": None}


# ------------------------------------------------------------------ bf16 -> f32


def test_every_bfloat16_value_widens_to_float32_exactly_as_torch_converts_it() -> None:
    import torch

    bits = np.arange(1 << 16, dtype=np.uint16)  # every bfloat16 bit pattern: NaNs, infinities, subnormals
    tensor = from_buffer(bits, "bfloat16", [256, 256])
    assert tensor.dtype == "bfloat16" and np.asarray(tensor).dtype == np.dtype("V2")
    widened = to_numpy(tensor, dtype="float32")
    assert widened.dtype == np.float32 and widened.shape == (256, 256)
    oracle = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).reshape(256, 256).numpy()
    np.testing.assert_array_equal(widened.view(np.uint32), oracle.view(np.uint32))
    as_f64 = to_numpy(tensor, dtype="float64")
    oracle64 = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float64).reshape(256, 256).numpy()
    finite = np.isfinite(oracle64)
    np.testing.assert_array_equal(as_f64[finite], oracle64[finite])
    assert np.array_equal(np.isnan(as_f64), np.isnan(oracle64))


def test_to_numpy_keeps_numpy_types_and_converts_floats() -> None:
    values = np.linspace(-3, 3, 12, dtype=np.float16).reshape(3, 4)
    tensor = from_buffer(values, "float16", [3, 4])
    same = to_numpy(tensor)
    assert same.dtype == np.float16
    np.testing.assert_array_equal(same, values)
    np.testing.assert_array_equal(to_numpy(tensor, dtype="float32"), values.astype(np.float32))
    ints = from_buffer(np.arange(6, dtype=np.int64), "int64", [2, 3])
    np.testing.assert_array_equal(to_numpy(ints), np.arange(6).reshape(2, 3))


def test_to_numpy_refusals_are_typed() -> None:
    bf16 = from_buffer(np.zeros(4, np.uint16), "bfloat16", [4])
    e = refused("run.call_invalid", to_numpy, bf16)
    assert "dtype='float32'" in str(e)
    refused("run.call_invalid", to_numpy, bf16, dtype="int8")
    refused("run.call_invalid", to_numpy, np.zeros(3, np.float32))


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_a_bfloat16_tensor_on_the_gpu_widens_exactly_after_its_copy_to_the_host() -> None:
    import torch

    bits = np.arange(1 << 16, dtype=np.uint16)
    tensor = from_buffer(bits, "bfloat16", [1 << 16], device="cuda:0")
    assert tensor.device == "cuda:0"
    oracle = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda().float().cpu().numpy()
    np.testing.assert_array_equal(to_numpy(tensor, dtype="float32").view(np.uint32), oracle.view(np.uint32))


# ------------------------------------ load() of a graph whose output type is not a record

CUSTOM_OUTPUT_MODULE = """
from dataclasses import dataclass
import torch
import torch.utils._pytree as pytree


@dataclass
class Scores:
    top: object
    rest: object


pytree.register_pytree_node(
    Scores,
    lambda s: ([s.top, s.rest], ["top", "rest"]),
    lambda values, context: Scores(*values),
    serialized_type_name="tcg_h24_scores.Scores",
)


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.linear(x)
        return Scores(top=y.max(dim=-1).values, rest=y)
"""


@pytest.mark.real_aoti
@pytest.mark.realmodels
def test_a_registered_output_type_is_rebuilt_where_importable_and_a_typed_refusal_elsewhere(tmp_path: Path) -> None:
    """A user's own registered output class (not a transformers/diffusers record): load()
    imports its module in a fresh worker and returns the class; a worker that cannot
    import it gets ``run.spec_unsupported`` naming the type, and load_native
    ``run.native_unsupported`` (never torch's NotImplementedError, never a crash)."""
    import torch
    from safetensors.torch import save_file

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    (tmp_path / "tcg_h24_scores.py").write_text(CUSTOM_OUTPUT_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        import tcg_h24_scores  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(0)
    model = tcg_h24_scores.Scorer().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,))
    spec = GraphClassSpec("tests/scores", "outputs", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    Engine(tmp_path / "store").ensure(key, tmp_path / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec)
    save_file(dict(model.state_dict()), tmp_path / "w.safetensors")
    np.save(tmp_path / "x.npy", x.numpy())
    with torch.no_grad():
        expected = model(x).rest.numpy()

    code = f"""
        import json, sys
        import numpy as np
        if IMPORTABLE:
            sys.path.insert(0, {str(tmp_path)!r})
        from torch_compiled_graphs import Engine
        store = Engine({str(tmp_path / "store")!r})
        graph = store.resolve({str(key)!r}, {str(tmp_path)!r} + "/fresh-" + str(IMPORTABLE))
        result = {{}}
        try:
            graph.load_native({str(tmp_path / "w.safetensors")!r})
        except Exception as exc:
            result["native"] = [type(exc).__name__, getattr(exc, "code", None), "tcg_h24_scores.Scores" in str(exc)]
        import torch
        from safetensors.torch import load_file
        try:
            loaded = graph.load(load_file({str(tmp_path / "w.safetensors")!r}))
            out = loaded(torch.from_numpy(np.load({str(tmp_path / "x.npy")!r})))
            result["type"] = type(out).__module__ + "." + type(out).__name__
            np.save({str(tmp_path)!r} + "/rest.npy", out.rest.numpy())
        except Exception as exc:
            result["load"] = [type(exc).__name__, getattr(exc, "code", None), "tcg_h24_scores.Scores" in str(exc)]
        print(json.dumps(result))
        """
    assert run_fresh("IMPORTABLE = False\n" + textwrap.dedent(code), Path("/")) == {
        "native": ["BindingError", "run.native_unsupported", True],
        "load": ["BindingError", "run.spec_unsupported", True],
    }
    assert run_fresh("IMPORTABLE = True\n" + textwrap.dedent(code), Path("/")) == {
        "native": ["BindingError", "run.native_unsupported", True],
        "type": "tcg_h24_scores.Scores",
    }
    np.testing.assert_allclose(np.load(tmp_path / "rest.npy"), expected, rtol=1e-5, atol=1e-6)
