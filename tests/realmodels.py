"""The real-model tier: small configs of models people serve, with random weights.

Each model is built from a tiny configuration of its own library (diffusers,
transformers, timm; no hub download), seeded, in eval mode, and exported the
way a user exports it. :func:`run_stage` is the body of one fresh process of
the README's lifecycle; ``tests/test_realmodels.py`` drives the stages and
``scripts/cuda_e2e.py`` runs the same stages on a GPU.

    python tests/realmodels.py STAGE MODEL WORKDIR [DEVICE]

Stages: ``mint`` (export, declare, key, ensure, write the checkpoints a user
has), ``load`` (resolve + ``load(model)`` + ``load(checkpoint)``),
``native`` (resolve + ``load_native`` from each checkpoint), ``reuse``
(``ensure`` again: reused, the recipe never runs). Each prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# name -> (library, builder); the builder returns (module, args, kwargs,
# dynamic_shapes, checkpoint writer kind, add_prefix for its own checkpoint)
MODELS = (
    "llama-tied",
    "llama-untied",
    "unet2d-condition",
    "vae-decoder",
    "timm-resnet",
    "timm-vit",
)


def _seed() -> None:
    import torch

    torch.manual_seed(0)


def build(name: str, device: str = "cpu") -> dict[str, Any]:
    """The model ``name`` on ``device``, its example call and how a user saves it."""
    import torch

    _seed()
    dim = torch.export.Dim
    if name.startswith("llama"):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=name == "llama-tied",
            use_cache=False,
        )
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 12), device=device)
        return {
            "model": model,
            "args": (),
            "kwargs": {"input_ids": ids},
            # Static: torch 2.11 with transformers 5.17 refuses a dynamic sequence
            # here (a guard on seq % 8 in the attention mask).
            "dynamic": None,
            "save": "save_pretrained",
            "output": "logits",
        }
    if name == "unet2d-condition":
        from diffusers import UNet2DConditionModel

        model = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            block_out_channels=(16, 32),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=4,
            norm_num_groups=8,
        )
        return {
            "model": model,
            "args": (torch.randn(1, 4, 8, 8, device=device), torch.tensor(10, device=device)),
            "kwargs": {"encoder_hidden_states": torch.randn(1, 6, 16, device=device)},
            "dynamic": None,
            "save": "save_pretrained",
            "output": "sample",
        }
    if name == "vae-decoder":
        from diffusers import AutoencoderKL

        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            latent_channels=4,
            norm_num_groups=4,
            sample_size=16,
        )

        class Decoder(torch.nn.Module):
            """The VAE's decode, as a pipeline calls it; the encoder's weights stay unused."""

            def __init__(self, vae: torch.nn.Module) -> None:
                super().__init__()
                self.vae = vae

            def forward(self, z: torch.Tensor) -> Any:
                return self.vae.decode(z)

        return {
            "model": Decoder(vae),
            "inner": vae,
            "args": (torch.randn(2, 4, 8, 8, device=device),),
            "kwargs": {},
            "dynamic": ({0: dim("batch", min=1, max=4)},),
            "save": "save_pretrained",
            "add_prefix": "vae.",
            "output": "sample",
        }
    if name.startswith("timm"):
        import timm

        if name == "timm-resnet":
            model = timm.create_model("resnet10t", pretrained=False, num_classes=10)
            x = torch.randn(2, 3, 32, 32, device=device)
        else:
            model = timm.create_model(
                "vit_tiny_patch16_224",
                pretrained=False,
                img_size=32,
                patch_size=8,
                embed_dim=32,
                depth=2,
                num_heads=2,
                num_classes=10,
            )
            x = torch.randn(2, 3, 32, 32, device=device)
        return {
            "model": model,
            "args": (x,),
            "kwargs": {},
            "dynamic": ({0: dim("batch", min=1, max=8)},),
            "save": "state_dict",
            "output": None,
        }
    raise ValueError(f"unknown model {name!r}")


def _prepare(entry: dict[str, Any], device: str) -> dict[str, Any]:
    import torch

    model = entry["model"].to(device).eval()
    if device.startswith("cuda") and entry.get("bf16"):
        model = model.to(torch.bfloat16)
    entry["model"] = model
    return entry


def first_output(out: Any, field: str | None) -> Any:
    """The output a user reads: a field of a ModelOutput/BaseOutput (or of the
    mapping the native path returns), the first element of a tuple, or the tensor."""
    if field is not None:
        try:
            return out[field]
        except (KeyError, TypeError, IndexError):
            return getattr(out, field)
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _as_numpy(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        return value.detach().float().cpu().numpy()
    return np.asarray(value)


def _tolerance(name: str, device: str = "cpu") -> float:
    # On a GPU, cuDNN convolutions run in TF32 by default (torch's own setting).
    if device != "cpu":
        return 2e-2
    return 1e-3 if name != "unet2d-condition" else 2e-3


def _spec(name: str, entry: dict[str, Any]) -> Any:
    import torch

    from torch_compiled_graphs import GraphClassSpec

    program = torch.export.export(
        entry["model"], entry["args"], entry["kwargs"] or None, dynamic_shapes=entry["dynamic"]
    )
    return GraphClassSpec(f"realmodels/{name}", "serve", program)


def _key(spec: Any, target: str) -> tuple[str, Any]:
    from torch_compiled_graphs import RuntimeCompatibility, record_toolchain

    toolchain = record_toolchain()
    return str(RuntimeCompatibility(target, toolchain=toolchain).key(spec.declare())), toolchain


def _target(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def _checkpoints(entry: dict[str, Any], work: Path) -> dict[str, Any]:
    """Write the checkpoints a user has: ``state_dict()`` in one file, and
    ``save_pretrained`` sharded (a small shard size, so the index path runs)."""
    from safetensors.torch import save_file

    model = entry.get("inner", entry["model"])
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # save_file refuses tensors that share memory, as a user meets it: the tied
    # pair is saved once, the way save_pretrained drops it.
    seen: dict[int, str] = {}
    single: dict[str, Any] = {}
    for k, v in sd.items():
        if v.data_ptr() in seen:
            continue
        seen[v.data_ptr()] = k
        single[k] = v
    save_file(single, os.fspath(work / "state_dict.safetensors"))
    out = {"state_dict": os.fspath(work / "state_dict.safetensors")}
    if entry["save"] == "save_pretrained":
        model.save_pretrained(os.fspath(work / "pretrained"), max_shard_size="20KB", safe_serialization=True)
        out["pretrained"] = os.fspath(work / "pretrained")
    return out


def _save_io(entry: dict[str, Any], eager: Any, work: Path) -> None:
    """The example call and the eager output, as numpy, for the torch-free stage."""
    import numpy as np

    arrays = {f"arg{i}": _as_numpy_exact(a) for i, a in enumerate(entry["args"])}
    arrays.update({f"kw_{k}": _as_numpy_exact(v) for k, v in entry["kwargs"].items()})
    arrays["expected"] = eager
    np.savez(work / "io.npz", **arrays)
    # The same call for the Rust serve example: inputs in the graph's flat order.
    from safetensors.torch import save_file
    from torch.utils._pytree import tree_leaves

    flat = tree_leaves((tuple(entry["args"]), dict(entry["kwargs"])))
    tensors = {f"in{i}": t.detach().cpu().contiguous() for i, t in enumerate(flat)}
    import torch

    tensors["out0"] = torch.from_numpy(eager).contiguous()
    save_file(tensors, os.fspath(work / "io.safetensors"))


def _as_numpy_exact(value: Any) -> Any:
    return value.detach().cpu().numpy()


def _native_numpy(value: Any) -> Any:
    import numpy as np

    from torch_compiled_graphs import native

    convert = getattr(native, "to_numpy", None)
    if convert is not None:
        return convert(value, dtype="float32")
    return np.asarray(value).astype("float32")


def run_native(name: str, work: Path, device: str) -> dict[str, Any]:
    """``load_native`` from each checkpoint a user has, in a process without torch."""
    import numpy as np

    from torch_compiled_graphs import Engine

    t0 = time.perf_counter()
    io = np.load(work / "io.npz")
    args = [io[k] for k in sorted(k for k in io.files if k.startswith("arg"))]
    kwargs = {k[3:]: io[k] for k in io.files if k.startswith("kw_")}
    eager = io["expected"]
    meta = json.loads((work / "mint.json").read_text())
    stored = Engine(os.fspath(work / "store")).resolve(meta["key"], os.fspath(work / f"dest-native-{os.getpid()}"))
    if stored is None:
        raise SystemExit(f"{meta['key']} is not in the store")
    diffs: dict[str, float] = {}
    ignored: dict[str, list[str]] = {}
    out: Any = None
    for label, path in meta["checkpoints"].items():
        native = stored.load_native([path, *meta["extra"]], device=device, add_prefix=meta["add_prefix"])
        out = native(*args, **kwargs)
        got = _native_numpy(first_output(out, meta["output"]))
        diffs[label] = float(np.abs(got - eager).max())
        ignored[label] = list(native.ignored_constants)
    # One native weights set per checkpoint form, bound by two graphs (issue 33):
    # aliases and dropped names served from the set through the graph's contract.
    from torch_compiled_graphs import NativeWeightsSet

    for label, path in meta["checkpoints"].items():
        weights = NativeWeightsSet([path, *meta["extra"]], device=device, add_prefix=meta["add_prefix"])
        first, native = stored.load_native(weights), stored.load_native(weights)
        del first, weights  # the second graph holds the set
        out = native(*args, **kwargs)
        got = _native_numpy(first_output(out, meta["output"]))
        diffs[f"set-{label}"] = float(np.abs(got - eager).max())
        ignored[f"set-{label}"] = list(native.ignored_constants)
    return {
        "stage": "native",
        "model": name,
        "device": device,
        "torch_imported": "torch" in sys.modules,
        "output_type": type(out).__name__,
        "max_abs_diff": diffs,
        "ignored": ignored,
        "tolerance": _tolerance(name, device),
        "ok": all(d <= _tolerance(name, device) for d in diffs.values()),
        "seconds": time.perf_counter() - t0,
    }


def _two_graphs_on_one_set(stored: Any, weights: Any, device: str) -> Any:
    """Two graphs bound to one set: the first is run and dropped, the second returned
    (so a call through it also proves the set outlives a released graph)."""
    first, second = stored.load(weights, device=device), stored.load(weights, device=device)
    copied = {row["name"] for row in first.copied_constants}
    # By the graph's names: a tied name binds the set's tensor of its alias.
    held = {t.data_ptr() for t in weights.tensors.values()}
    for name, tensor in first._bound.items():
        if name not in copied and name in first.constant_fqns:
            assert tensor.data_ptr() == second._bound[name].data_ptr() and tensor.data_ptr() in held, name
    del first
    return second


def run_stage(stage: str, name: str, work: Path, device: str = "cpu") -> dict[str, Any]:
    """One stage in this (fresh) process; returns what it found."""
    if stage == "native":
        return run_native(name, work, device)
    import numpy as np
    import torch

    from torch_compiled_graphs import Engine

    t0 = time.perf_counter()
    entry = _prepare(build(name, device), device)
    model = entry["model"]
    with torch.no_grad():
        eager = _as_numpy(first_output(model(*entry["args"], **entry["kwargs"]), entry["output"]))
    engine = Engine(os.fspath(work / "store"))
    report: dict[str, Any] = {"stage": stage, "model": name, "device": device}
    prefix = entry.get("add_prefix", "")
    if stage in ("mint", "reuse"):
        spec = _spec(name, entry)
        key, toolchain = _key(spec, _target(device))
        calls = []

        def recipe() -> Any:
            calls.append(1)
            return spec

        result = engine.ensure(
            key, os.fspath(work / f"dest-{stage}"), target=_target(device), toolchain=toolchain, recipe=recipe
        )
        report.update(key=key, outcome=str(result.outcome.value), recipe_calls=len(calls))
        if stage == "mint":
            stored = result.compiled_graph
            checkpoints = _checkpoints(entry, work)
            extra: list[str] = []
            if any(k == "non_persistent_buffer" for k in stored.weights_contract["kinds"].values()):
                # What a torch-free worker is handed beside the user's checkpoint.
                stored.write_weights(model, work / "non-persistent.safetensors", non_persistent_only=True)
                extra = [os.fspath(work / "non-persistent.safetensors")]
            _save_io(entry, eager, work)
            meta = {
                "key": key,
                "checkpoints": checkpoints,
                "extra": extra,
                "add_prefix": prefix,
                "output": entry["output"],
                "flat_inputs": len(entry["args"]) + len(entry["kwargs"]),
            }
            (work / "mint.json").write_text(json.dumps(meta))
            report["contract"] = stored.weights_contract
        report["seconds"] = time.perf_counter() - t0
        return report
    meta = json.loads((work / "mint.json").read_text())
    stored = engine.resolve(meta["key"], os.fspath(work / f"dest-{stage}-{os.getpid()}"))
    if stored is None:
        raise SystemExit(f"{meta['key']} is not in the store")
    diffs: dict[str, float] = {}
    ignored: dict[str, list[str]] = {}
    ways: list[tuple[str, Callable[[], Any]]] = [("module", lambda: stored.load(model, device=device))]
    for label, path in meta["checkpoints"].items():
        ways.append(
            (label, lambda p=path: stored.load([p, *meta["extra"]], device=device, add_prefix=meta["add_prefix"]))
        )
    # One weights set per checkpoint form, bound by two graphs (issue 33): aliases and
    # dropped names served from the set through each graph's own contract.
    from torch_compiled_graphs import WeightsSet

    sets: list[tuple[str, Callable[[], Any]]] = [("set-module", lambda: WeightsSet(model))]
    for label, path in meta["checkpoints"].items():
        sets.append(
            (
                f"set-{label}",
                lambda p=path: WeightsSet([p, *meta["extra"]], device=device, add_prefix=meta["add_prefix"]),
            )
        )
    for label, open_set in sets:
        ways.append((label, lambda o=open_set: _two_graphs_on_one_set(stored, o(), device)))
    out: Any = None
    for label, make in ways:
        graph = make()
        with torch.no_grad():
            out = graph(*entry["args"], **entry["kwargs"])
        diffs[label] = float(np.abs(_as_numpy(first_output(out, entry["output"])) - eager).max())
        ignored[label] = list(graph.ignored_constants)
    report["output_type"] = type(out).__name__
    report.update(max_abs_diff=diffs, ignored=ignored, tolerance=_tolerance(name, device))
    report["ok"] = all(d <= _tolerance(name, device) for d in diffs.values())
    report["seconds"] = time.perf_counter() - t0
    return report


if __name__ == "__main__":
    stage, name, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    print(json.dumps(run_stage(stage, name, work, device)), flush=True)
