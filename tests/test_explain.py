"""Explaining a miss with real programs: one real mint is the stored neighbour; the
variants (one toolchain member, one op, one dynamic range, another CPU level) are
explained against it from Python, one variant is minted by ``ensure`` (its log and
``EnsureResult.explanation``), and the CLI diffs the two stored keys.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.export import Dim, export

from torch_compiled_graphs import Engine, EnsureOutcome, GraphClassSpec, RuntimeCompatibility, _native
from torch_compiled_graphs.declaration import canonical_lines
from torch_compiled_graphs.explain import Explanation

NAME = "tests/explain"
TOOLCHAIN = {"torch": "torch-record-aaaa", "cxx": "cxx-1111", "settings_declaration": "policy-1"}


class Tiny(nn.Module):
    """Linear then one activation: changing the activation changes one op."""

    def __init__(self, act: str = "relu") -> None:
        super().__init__()
        self.l = nn.Linear(8, 4)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        return torch.relu(y) if self.act == "relu" else torch.sigmoid(y)


def spec(act: str = "relu", max_batch: int = 64) -> GraphClassSpec:
    torch.manual_seed(0)
    program = export(
        Tiny(act).eval(), (torch.randn(4, 8),), dynamic_shapes={"x": {0: Dim("batch", min=2, max=max_batch)}}
    )
    return GraphClassSpec(NAME, "tiny", program)


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base model minted once for real (the stored neighbour of every variant)."""
    root = tmp_path_factory.mktemp("explain")
    engine = Engine(root / "store")
    base = spec()
    key = RuntimeCompatibility("cpu", toolchain=TOOLCHAIN).key(base.declare())
    result = engine.ensure(key, root / "out", target="cpu", toolchain=TOOLCHAIN, recipe=lambda: base)
    assert result.outcome is EnsureOutcome.MINTED
    # Nothing of this class was stored before: nothing to log, but the miss is explained.
    assert result.explanation is not None and result.explanation.neighbours == ()
    return {"root": root, "engine": engine, "key": str(key), "spec": base}


def only_neighbour(explanation: Explanation, stored_key: str) -> Any:
    assert not explanation.present
    assert explanation.remote is None
    nearest = explanation.nearest
    assert nearest is not None and nearest.key == stored_key
    assert nearest.lines_kept
    return nearest


@pytest.mark.real_aoti
def test_the_stored_key_itself_is_present(stored: dict[str, Any]) -> None:
    e = stored["engine"].explain(stored["spec"], target="cpu", toolchain=TOOLCHAIN)
    assert e.present and e.key == stored["key"] and e.neighbours == ()
    assert "stored here" in str(e)


@pytest.mark.real_aoti
def test_one_toolchain_member_is_the_one_fact(stored: dict[str, Any]) -> None:
    changed = {**TOOLCHAIN, "torch": "torch-record-bbbb"}
    for what in (stored["spec"], stored["spec"].declare()):
        n = only_neighbour(stored["engine"].explain(what, target="cpu", toolchain=changed), stored["key"])
        assert n.differing_axes == ("toolchain",)
        assert n.facts == ("toolchain.torch",)
        (d,) = n.differences
        assert (d.requested, d.stored) == ("torch-record-bbbb", "torch-record-aaaa")


@pytest.mark.real_aoti
def test_one_changed_op_is_the_witness_with_its_canonical_line(stored: dict[str, Any]) -> None:
    variant = spec(act="sigmoid")
    e = stored["engine"].explain(variant, target="cpu", toolchain=TOOLCHAIN)
    n = only_neighbour(e, stored["key"])
    assert n.differing_axes == ("graph",)
    assert n.facts == ("graph_witness",)
    detail = n.differences[0].detail
    assert detail["complete"] is True
    (requested,) = detail["requested"]
    (kept,) = detail["stored"]
    assert requested[0] == kept[0] == detail["first_line"]
    assert "aten::sigmoid" in requested[1] and "aten::relu" in kept[1]
    # The request's line is the program's own canonical line at that index.
    assert canonical_lines(variant.program)[requested[0]] == requested[1]
    assert "aten::sigmoid" in str(e)
    # From the declaration alone the witness differs and the lines are not known.
    n = only_neighbour(stored["engine"].explain(variant.declare(), target="cpu", toolchain=TOOLCHAIN), stored["key"])
    assert n.facts == ("graph_witness",)
    assert "unavailable" in n.differences[0].detail


@pytest.mark.real_aoti
def test_a_changed_dynamic_range_is_the_range_line_and_the_ingress_bound(stored: dict[str, Any]) -> None:
    n = only_neighbour(stored["engine"].explain(spec(max_batch=128), target="cpu", toolchain=TOOLCHAIN), stored["key"])
    assert n.differing_axes == ("graph",)
    # A range enters the key twice: the canonical range line and the call ingress.
    assert n.facts == ("graph_witness", "range_digest")
    witness, ranges = n.differences
    assert [line for _, line in witness.detail["requested"]] == ["sym S0 range=[2,128]"]
    assert [line for _, line in witness.detail["stored"]] == ["sym S0 range=[2,64]"]
    assert ranges.detail == [{"path": "symbols.S0[1]", "requested": 128, "stored": 64}]


@pytest.mark.real_aoti
def test_another_cpu_level_is_the_sm_axis_alone(stored: dict[str, Any]) -> None:
    here = _native.cpu_sm()
    other = "cpu-x86-64-v2" if here != "cpu-x86-64-v2" else "cpu-x86-64-v3"
    n = only_neighbour(stored["engine"].explain(stored["spec"], target=other, toolchain=TOOLCHAIN), stored["key"])
    assert n.differing_axes == ("sm",)
    assert n.facts == ("sm",)
    assert (n.differences[0].requested, n.differences[0].stored) == (other, here)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch_compiled_graphs.cli", "explain", *args], capture_output=True, text=True
    )


@pytest.mark.real_aoti
def test_ensure_logs_the_miss_once_and_the_cli_diffs_the_two_keys(
    stored: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    engine: Engine = stored["engine"]
    root: Path = stored["root"]
    changed = {**TOOLCHAIN, "cxx": "cxx-2222"}
    base = stored["spec"]
    key = str(RuntimeCompatibility("cpu", toolchain=changed).key(base.declare()))
    with caplog.at_level(logging.INFO, logger="torch_compiled_graphs"):
        result = engine.ensure(key, root / "variant", target="cpu", toolchain=changed, recipe=lambda: base)
    assert result.outcome is EnsureOutcome.MINTED
    e = result.explanation
    assert e is not None and e.key == key and not e.present
    assert e.nearest is not None and e.nearest.key == stored["key"]
    assert e.nearest.facts == ("toolchain.cxx",)
    records = [r for r in caplog.records if r.name == "torch_compiled_graphs"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "toolchain.cxx: requested cxx-2222, stored cxx-1111" in records[0].getMessage()
    # A hit carries no explanation and logs nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torch_compiled_graphs"):
        again = engine.ensure(key, root / "again", target="cpu", toolchain=changed, recipe=lambda: base)
    assert again.outcome is EnsureOutcome.REUSED and again.explanation is None
    assert not [r for r in caplog.records if r.name == "torch_compiled_graphs"]

    store = str(root / "store")
    out = cli("--cas-root", store, key, stored["key"], "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["differing_axes"] == ["toolchain"]
    assert report["differences"] == [
        {"axis": "toolchain", "fact": "toolchain.cxx", "requested": "cxx-2222", "stored": "cxx-1111"}
    ]
    assert report == engine.explain_keys(key, stored["key"])
    text = cli("--cas-root", store, key, stored["key"])
    assert text.returncode == 0 and "toolchain.cxx: A cxx-2222, B cxx-1111" in text.stdout

    listing = cli("--cas-root", store, "--graph-class", NAME, "--json")
    assert listing.returncode == 0, listing.stderr
    entries = json.loads(listing.stdout)["entries"]
    assert sorted(x["key"] for x in entries) == sorted([key, stored["key"]])
    assert [d["fact"] for d in entries[1]["differences"]] == ["toolchain.cxx"]

    absent = "cg-key-v1-" + "0" * 56
    missing = cli("--cas-root", store, key, absent)
    assert missing.returncode == 1 and "code: store.absent" in missing.stderr
    assert cli("--cas-root", store, "--graph-class", "no/such").returncode == 1
    assert cli("--cas-root", store, key).returncode == 2
