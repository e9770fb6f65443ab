"""Package-level behaviour: no torch on import, the error hierarchy, the CLI."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import torch_compiled_graphs as tcg
from torch_compiled_graphs import _native, errors


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import sys, torch_compiled_graphs, torch_compiled_graphs.identity, torch_compiled_graphs.contracts;"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_error_hierarchy() -> None:
    assert issubclass(tcg.IdentityError, ValueError)
    assert issubclass(tcg.DeclarationError, ValueError)
    assert issubclass(tcg.ArtifactError, ValueError)
    assert issubclass(tcg.CompileError, RuntimeError)
    assert issubclass(tcg.StorageError, RuntimeError)
    assert issubclass(tcg.QuarantinedArtifact, tcg.StorageError)
    assert issubclass(tcg.AdmissionError, tcg.StorageError)


def test_every_native_code_maps_to_a_declared_class() -> None:
    codes = _native.error_codes()
    assert len(codes) == len({c for c, _ in codes})
    for code, class_name in codes:
        area, _, slug = code.partition(".")
        assert area and slug and slug == slug.lower()
        assert class_name == "OSError" or hasattr(errors, class_name), code


def test_errors_carry_codes_and_pickle() -> None:
    with pytest.raises(tcg.IdentityError) as e:
        tcg.CompiledGraphKey.derive({"graph": "g", "sm": "sm_89"})
    assert e.value.code == "identity.axis_missing"
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is tcg.IdentityError and again.code == e.value.code and str(again) == str(e.value)


@pytest.mark.parametrize(
    ("axes", "code"),
    [
        ({"graph": "g", "sm": "s", "toolchain": "t", "host": "x"}, "identity.axis_unknown"),
        ({"graph": "g", "sm": "s"}, "identity.axis_missing"),
        ({"graph": "g", "sm": " s", "toolchain": "t"}, "identity.axis_not_canonical"),
        ({"graph": "g", "sm": 89, "toolchain": "t"}, "identity.axis_not_canonical"),
        (
            {"graph": "cg-key-v1-" + "a" * 56, "sm": "s", "toolchain": "t"},
            "identity.axis_is_key",
        ),
    ],
)
def test_key_axis_refusals(axes: dict[str, object], code: str) -> None:
    with pytest.raises(tcg.IdentityError) as e:
        tcg.CompiledGraphKey.derive(axes)
    assert e.value.code == code


def test_key_from_incomplete_metadata_is_refused() -> None:
    with pytest.raises(tcg.IdentityError) as e:
        tcg.CompiledGraphKey.from_metadata({"kind": "aot-inductor", "sm": "sm_90"})
    assert e.value.code == "identity.metadata_incomplete"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch_compiled_graphs.cli", *args], capture_output=True, text=True)


def test_cli_derives_the_contract_key() -> None:
    out = cli("key", "--graph", "c59210f4ddf6b420", "--sm", "sm_89", "--toolchain-axis", "88abf09ce9c69ecb")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "cg-key-v1-d4c716660ec9c12c079170810bb18d830594a34b875a83beb0ab6150\n"


def test_cli_folds_a_toolchain_file(tmp_path: Path) -> None:
    from torch_compiled_graphs.contracts import load_contract

    block = tmp_path / "toolchain.json"
    block.write_text(json.dumps(load_contract("toolchain_identity_v1.json")["block"]))
    out = cli("key", "--graph", "c59210f4ddf6b420", "--sm", "sm_89", "--toolchain", str(block), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["axes"]["toolchain"] == "88abf09ce9c69ecb"


def test_cli_exit_codes() -> None:
    assert cli("check-key", "cg-key-v1-" + "0" * 56).returncode == 0
    assert cli("check-key", "nope").returncode == 1
    bad = cli("key", "--graph", "cg-key-v1-" + "0" * 56, "--sm", "sm_89", "--toolchain-axis", "x")
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: ")
    assert "code: identity.axis_is_key" in bad.stderr
    assert "hint: " in bad.stderr
    assert cli("no-such-command").returncode == 2


ORIGINAL_ROOT = {
    "AdmissionError",
    "ArtifactError",
    "CompileError",
    "COMPILED_GRAPH_FORMAT",
    "CompiledGraphKey",
    "DeclarationError",
    "Engine",
    "EnsureOutcome",
    "EnsureResult",
    "GraphClassDeclaration",
    "GraphClassSpec",
    "IdentityError",
    "QuarantinedArtifact",
    "RuntimeCompatibility",
    "StorageError",
    "StoreOutcome",
    "StoreResult",
    "StoredCompiledGraph",
    "is_compiled_graph_key",
}


def test_root_exports_are_the_original_list_plus_local_cas_record_toolchain_trust_error_and_weights_sets() -> None:
    assert set(tcg.__all__) == ORIGINAL_ROOT | {
        "LocalCAS",
        "record_toolchain",
        "TrustError",
        "WeightsSet",
        "NativeWeightsSet",
    }
    for name in tcg.__all__:
        assert getattr(tcg, name) is not None
    assert tcg.COMPILED_GRAPH_FORMAT == 1


def test_the_torch_facing_names_load_lazily_without_importing_torch() -> None:
    code = (
        "import sys, torch_compiled_graphs as t;"
        "t.GraphClassSpec, t.RuntimeCompatibility, t.record_toolchain, t.WeightsSet, t.NativeWeightsSet;"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_console_script_runs_the_native_cli() -> None:
    script = Path(sys.executable).parent / "torch-compiled-graphs"
    assert script.is_file(), "the package installs the torch-compiled-graphs console script"
    out = subprocess.run([str(script), "check-key", "cg-key-v1-" + "0" * 56], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "valid\n"
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True).stdout
    for command in ("inspect", "verify", "resolve", "import", "export", "sign", "ls", "gc", "fsck", "stats"):
        assert command in help_text
