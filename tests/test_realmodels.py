"""The real-model tier: diffusers, transformers and timm models from small configs,
each through export, mint, fresh-process ``load`` and ``load_native`` from the
checkpoints a user has (``state_dict()`` in one file; ``save_pretrained``,
sharded), and reuse. Every stage runs in its own process (``tests/realmodels.py``).

Two models run in ``make test`` (marked ``real_aoti``); the whole tier runs with
``make realmodels`` (marker ``realmodels``), and on a GPU in ``scripts/cuda_e2e.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.realmodels import MODELS

HERE = Path(__file__).resolve().parent

# In `make test`: a causal LM with tied embeddings and non-persistent buffers
# (ModelOutput), and a VAE decoder whose encoder weights the compiler drops.
IN_MAKE_TEST = {"llama-tied", "vae-decoder"}


def stage(name: str, step: str, work: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(HERE / "realmodels.py"), step, name, str(work)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert proc.returncode == 0, f"{step} of {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    report: dict[str, Any] = json.loads(line)
    return report


def _marks(name: str) -> list[Any]:
    marks = [pytest.mark.real_aoti]
    if name not in IN_MAKE_TEST:
        marks.append(pytest.mark.realmodels)
    return marks


@pytest.mark.parametrize("name", [pytest.param(m, marks=_marks(m)) for m in MODELS])
def test_a_real_model_mints_loads_and_runs_on_every_path(name: str, tmp_path: Path) -> None:
    minted = stage(name, "mint", tmp_path)
    assert minted["outcome"] == "minted" and minted["recipe_calls"] == 1
    contract = minted["contract"]
    assert contract["recorded"] is True
    kinds = contract["kinds"]
    assert set(kinds.values()) <= {"parameter", "buffer", "non_persistent_buffer", "constant"}

    loaded = stage(name, "load", tmp_path)
    assert loaded["ok"], loaded
    # The module, its state_dict() file and (where the library has it) its
    # save_pretrained checkpoint, sharded.
    assert "module" in loaded["max_abs_diff"] and "state_dict" in loaded["max_abs_diff"]
    # What the module provides beyond the table is ignored and reported, never refused.
    assert set(loaded["ignored"]["module"]) <= set(contract["dropped"])

    native = stage(name, "native", tmp_path)
    assert native["ok"], native
    assert native["torch_imported"] is False
    ways = {w for w in loaded["max_abs_diff"] if not w.startswith("set-")}
    files = ways - {"module"}
    # Each checkpoint form natively from its files and from one NativeWeightsSet.
    assert set(native["max_abs_diff"]) == files | {f"set-{w}" for w in files}
    for w in files:
        assert set(native["ignored"][f"set-{w}"]) == set(native["ignored"][w])
    # A weights set per checkpoint form serves two graphs, with the same names ignored.
    assert {w for w in loaded["max_abs_diff"] if w.startswith("set-")} == {f"set-{w}" for w in ways}
    assert set(loaded["ignored"]["set-module"]) == set(loaded["ignored"]["module"])

    reused = stage(name, "reuse", tmp_path)
    assert reused["outcome"] == "reused" and reused["recipe_calls"] == 0
    assert reused["key"] == minted["key"]

    if name == "llama-tied":
        # The table keeps one name of the tied pair; save_pretrained keeps the other.
        assert ["lm_head.weight", "model.embed_tokens.weight"] in contract["alias_groups"]
        assert "model.rotary_emb.original_inv_freq" in contract["dropped"]
        assert kinds["model.rotary_emb.inv_freq"] == "non_persistent_buffer"
        assert loaded["output_type"] == "CausalLMOutputWithPast"
    if name == "vae-decoder":
        assert any(d.startswith("vae.encoder.") for d in contract["dropped"])
        assert set(loaded["ignored"]["module"]) == set(contract["dropped"])
    if name == "timm-resnet":
        assert any(d.endswith("num_batches_tracked") for d in contract["dropped"])
