"""Input layouts: a graph reads each input with the strides it was compiled for.

Compiled code reads an input's memory with the strides of the example it was compiled
for, and neither the key nor the call ingress names strides. A mint therefore compiles
every input row-major, whatever layout the exported example had (a channels-last image,
as a vision pipeline hands it over); ``load()`` lays each call's tensor out as the graph
reads it, and the native path, which takes C-contiguous arrays, refuses a graph that
reads another layout (one minted before this rule) with ``run.input_layout`` instead of
computing from misplaced elements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs._loadpath import laid_out
from torch_compiled_graphs.errors import BindingError


class Head(torch.nn.Module):
    """GroupNorm, SiLU and a convolution: the last stage of an image decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 8)
        self.conv = torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(torch.nn.functional.silu(self.norm(x)))
        return out


def mint_head(name: str, root: Path) -> tuple[Any, Head]:
    """A real CPU mint of :class:`Head` exported from a channels-last example, and the
    module; its weights written to ``root / "weights.safetensors"``."""
    torch.manual_seed(0)
    head = Head().eval()
    example = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    program = torch.export.export(head, (example,))
    spec = GraphClassSpec(name, "layout-tests", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    result = Engine(root / "store").ensure(key, root / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec)
    stored = result.compiled_graph
    stored.write_weights(head, root / "weights.safetensors")
    return stored, head


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Head, Path]:
    root = tmp_path_factory.mktemp("layout")
    stored, head = mint_head("layout/head", root)
    return stored, head, root


@pytest.mark.real_aoti
def test_a_channels_last_example_mints_a_graph_that_reads_row_major_inputs(minted: tuple[Any, Head, Path]) -> None:
    from torch_compiled_graphs._loadpath import input_strides

    stored, _, _ = minted
    # [2, 8, 6, 6] row-major: what the native path's arrays are.
    assert input_strides(stored.package_path) == [[288, 36, 6, 1]]


@pytest.mark.real_aoti
def test_load_gives_eagers_result_for_every_layout_of_the_input(minted: tuple[Any, Head, Path]) -> None:
    stored, head, _ = minted
    graph = stored.load(head)
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = head(x)
    for given in (x, x.contiguous(memory_format=torch.channels_last), x.transpose(2, 3).contiguous().transpose(2, 3)):
        torch.testing.assert_close(graph(given), want, atol=1e-4, rtol=1e-4)


@pytest.mark.real_aoti
def test_load_native_gives_eagers_result_for_a_channels_last_export(minted: tuple[Any, Head, Path]) -> None:
    stored, head, root = minted
    native = stored.load_native(root / "weights.safetensors", device="cpu")
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = head(x).numpy()
    got = native(x.numpy())
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_laid_out_copies_into_the_graphs_layout_or_passes_what_already_is() -> None:
    x = torch.randn(2, 8, 6, 6)
    last = x.contiguous(memory_format=torch.channels_last)
    row = [288, 36, 6, 1]
    channels_last: list[int | None] = [288, 1, 48, 8]
    # Already laid out: the same tensor, no copy.
    assert laid_out(x, row, "input 'x'") is x
    assert laid_out(last, channels_last, "input 'x'") is last
    # Another layout: a copy in the graph's, with the same values.
    for given, strides in ((last, row), (x, channels_last)):
        out = laid_out(given, strides, "input 'x'")
        assert list(out.stride()) == strides and torch.equal(out, given)
    # Size-1 dimensions are never stepped; unknown (symbolic) strides are not checked.
    first = x[:1]
    assert laid_out(first, [999, 36, 6, 1], "input 'x'") is first
    assert laid_out(x, [None, 36, 6, 1], "input 'x'") is x
    # Row-major where stated: a row-major copy even when other strides are symbolic.
    out = laid_out(last, [None, None, None, 1], "input 'x'")
    assert out.is_contiguous() and torch.equal(out, x)
    # Neither row-major nor fully stated, and laid out otherwise: refused, typed.
    with pytest.raises(BindingError) as caught:
        laid_out(x, [None, 1, None, 8], "input 'x'")
    assert caught.value.code == "run.input_layout" and "channels_last" in str(caught.value)
    # No checks stated, or another rank (the call checks refuse it): passed as it is.
    assert laid_out(last, None, "input 'x'") is last
    assert laid_out(last, [1, 2], "input 'x'") is last


@pytest.mark.real_aoti
def test_a_program_that_fails_to_compile_row_major_is_compiled_for_its_examples_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the row-major compile fails (inductor raising on an op that holds only for the
    example's layout; provoked here, since inductor lowers even a ``view`` of a permuted
    input), the graph is compiled for the example's channels-last layout: load() lays
    inputs out that way, load_native refuses them (typed), never computing from
    misplaced elements."""
    import torch._inductor

    from torch_compiled_graphs._loadpath import input_strides

    real = torch._inductor.aot_compile
    calls: list[list[int]] = []

    def compile_once_row_major_fails(module: Any, *args: Any, **kwargs: Any) -> Any:
        strides = [list(n.meta["val"].stride()) for n in module.graph.nodes if n.op == "placeholder"]
        calls.append(strides[0])
        if strides[0] == [288, 36, 6, 1]:
            raise RuntimeError("view size is not compatible with input tensor's size and stride")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch._inductor, "aot_compile", compile_once_row_major_fails)
    stored, head = mint_head("layout/head-fallback", tmp_path)
    assert calls == [[288, 36, 6, 1], [288, 1, 48, 8]]
    assert input_strides(stored.package_path) == [[288, 1, 48, 8]]
    graph = stored.load(head)
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = head(x)
    for given in (x, x.contiguous(memory_format=torch.channels_last)):
        torch.testing.assert_close(graph(given), want, atol=1e-4, rtol=1e-4)
    native = stored.load_native(tmp_path / "weights.safetensors", device="cpu")
    with pytest.raises(BindingError) as caught:
        native(x.numpy())
    assert caught.value.code == "run.input_layout"
    assert "[288, 1, 48, 8]" in str(caught.value) and "load()" in str(caught.value)
