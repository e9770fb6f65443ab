"""The libtorch-free variant's attention on CUDA: SDPA rewritten to flex attention.

On a GPU the rewritten graph compiles to flex attention's fused Triton kernel (the shim
stage of ``scripts/cuda_e2e.py`` mints and runs the tier's models that way). Here, on the
CPU, the rewrite itself is checked: which calls it takes, that each rewritten call computes
what SDPA computes (eager flex attention is its reference implementation), the shared
block masks, and the compile's fallback to decomposed attention when the flex compile fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torch_compiled_graphs import RuntimeCompatibility, _attention, record_toolchain
from torch_compiled_graphs import compile as tcg_compile
from torch_compiled_graphs.compile import POLICY, SHIM_V1_POLICY

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attentions(torch.nn.Module):
    """Every form of SDPA call a served model makes, and two flex attention cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("additive", torch.randn(1, 1, 16, 16))

    def forward(self, q: Any, k: Any, v: Any, kv_heads: Any, keep: Any, memory: Any) -> tuple[Any, ...]:
        return (
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, attn_mask=self.additive),
            F.scaled_dot_product_attention(q, kv_heads, kv_heads, enable_gqa=True),
            F.scaled_dot_product_attention(q, memory, memory),  # cross-attention: other key length
            F.scaled_dot_product_attention(q[0], k[0], v[0]),  # 3-D: SDPA itself
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5),  # dropout: never rewritten
        )


def _inputs(batch: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch)
    q, k, v = (torch.randn(batch, 4, 16, 32, generator=gen) for _ in range(3))
    kv_heads = torch.randn(batch, 2, 16, 32, generator=gen)
    keep = torch.rand(batch, 1, 16, 16, generator=gen) > 0.3
    keep[0, 0, 3] = False  # a fully masked row: zeros, as SDPA's math backend gives
    memory = torch.randn(batch, 4, 7, 32, generator=gen)
    return q, k, v, kv_heads, keep, memory


def _exported() -> Any:
    batch = torch.export.Dim("batch", min=1, max=8)
    return torch.export.export(Attentions().eval(), _inputs(2), dynamic_shapes=tuple({0: batch} for _ in range(6)))


def _targets(module: Any) -> list[Any]:
    return [n.target for n in module.graph.nodes if n.op == "call_function"]


def test_every_dropout_free_sdpa_call_becomes_flex_attention_and_computes_what_sdpa_does() -> None:
    program = _exported()
    module = program.module()
    assert _targets(module).count(SDPA) == 8
    assert _attention.rewrite_to_flex(module) == 7
    targets = _targets(module)
    assert targets.count(_attention.sdpa_as_flex) == 7
    assert targets.count(SDPA) == 1  # the dropout call
    # One block mask per (query length, key length): self-attention's and cross-attention's
    # (the 3-D call has none; it stays SDPA at trace time).
    assert targets.count(_attention._empty_block_mask) == 2

    torch.manual_seed(0)
    with torch.no_grad():
        for batch in (1, 3):
            inputs = _inputs(batch)
            want = program.module()(*inputs)
            got = module(*inputs)
            for i, (w, g) in enumerate(zip(want[:7], got[:7], strict=True)):
                assert not g.isnan().any(), i
                torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6, msg=f"call {i}")
            assert got[7].shape == want[7].shape


def test_flex_attention_takes_only_what_it_computes() -> None:
    q = torch.randn(1, 2, 4, 8)
    assert _attention._flex_takes(q, q, q, None, 0.0)
    assert not _attention._flex_takes(q, q, q, None, 0.1)  # dropout
    assert not _attention._flex_takes(q[0], q[0], q[0], None, 0.0)  # 3-D
    assert not _attention._flex_takes(q, q.double(), q, None, 0.0)  # mixed dtypes
    assert not _attention._flex_takes(q.to(torch.int32), q.to(torch.int32), q.to(torch.int32), None, 0.0)
    assert not _attention._flex_takes(q, q, q, torch.ones(1, 1, 1, 4, 4), 0.0)  # 5-D mask
    assert not _attention._flex_takes(q, q, q, torch.ones(4, 4, dtype=torch.int64), 0.0)  # integer mask
    assert _attention._flex_takes(q, q, q, torch.ones(4, 4, dtype=torch.bool), 0.0)


def test_the_variant_uses_flex_attention_on_cuda_and_decomposes_it_on_the_cpu() -> None:
    assert SHIM_V1_POLICY.settings_declaration()["attention"] == "flex"
    assert SHIM_V1_POLICY.attention_on("cuda") == "flex"
    assert SHIM_V1_POLICY.attention_on("cpu") == "math"
    assert POLICY.attention_on("cuda") is None and "attention" not in POLICY.settings_declaration()


def _flex_attention_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU stands in for CUDA: the default variant's policy with flex attention here too."""
    flex_here = dataclasses.replace(POLICY, attention="flex")
    monkeypatch.setattr(type(flex_here), "attention_on", lambda self, device: self.attention)
    monkeypatch.setattr(tcg_compile, "POLICY", flex_here)


def test_a_failed_flex_compile_compiles_the_graph_again_with_attention_decomposed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The compile with flex attention fails (a shape its kernel does not take): the mint
    compiles the same graph again with every SDPA call decomposed, and the result is that
    second compile's (no real compile here: the compiler and the packager are stand-ins
    that record what they were given)."""
    import torch._inductor

    seen: list[list[Any]] = []
    made = tmp_path / "wrapper.so"
    made.write_bytes(b"")

    def aot_compile(module: Any, args: Any, kwargs: Any, options: Any) -> list[str]:
        seen.append(_targets(module))
        if _attention.sdpa_as_flex in seen[-1]:
            raise RuntimeError("flex attention lowering failed")
        return [str(made)]

    packaged: list[list[Any]] = []

    def package(files: list[Any], name: str, workdir: Path) -> Path:
        packaged.append(files)
        return workdir / "model.pt2"

    monkeypatch.setattr(torch._inductor, "aot_compile", aot_compile)
    monkeypatch.setattr(tcg_compile, "_package", package)
    _flex_attention_on_the_cpu(monkeypatch)

    program = _exported()
    out = tcg_compile.compile_package(
        program, "attn", RuntimeCompatibility("cpu", toolchain=record_toolchain()), tmp_path
    )
    assert out == tmp_path / "model.pt2" and packaged == [[str(made)]]
    assert len(seen) == 2
    assert seen[0].count(_attention.sdpa_as_flex) == 7
    assert _attention.sdpa_as_flex not in seen[1] and seen[1].count(SDPA) == 8


def test_a_compile_that_fails_without_flex_attention_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch._inductor

    calls: list[int] = []

    def aot_compile(module: Any, args: Any, kwargs: Any, options: Any) -> list[str]:
        calls.append(1)
        raise RuntimeError("no kernel")

    class NoAttention(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.relu()

    monkeypatch.setattr(torch._inductor, "aot_compile", aot_compile)
    _flex_attention_on_the_cpu(monkeypatch)
    program = torch.export.export(NoAttention(), (torch.randn(2, 3),))
    with pytest.raises(tcg_compile.CompileError) as err:
        tcg_compile.compile_package(
            program, "relu", RuntimeCompatibility("cpu", toolchain=record_toolchain()), tmp_path
        )
    assert err.value.code == "compile.failed" and calls == [1]


@pytest.mark.parametrize(
    ("message", "compiles"),
    [
        # Another op has no kernel: attention decomposed would meet it too, no second compile.
        ("NoValidChoicesError: No choices to select. target: aten.convolution.default", 1),
        # Flex attention itself has no kernel: compiled again with attention decomposed.
        ("NoValidChoicesError: No choices to select. target: flex_attention", 2),
        # No op named: compiled again (it may have been the attention).
        ("NoValidChoicesError: No choices to select", 2),
    ],
)
def test_a_flex_compile_refused_for_another_op_is_not_compiled_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, message: str, compiles: int
) -> None:
    import torch._inductor

    calls: list[bool] = []

    def aot_compile(module: Any, args: Any, kwargs: Any, options: Any) -> list[str]:
        calls.append(_attention.sdpa_as_flex in _targets(module))
        raise RuntimeError(message)

    monkeypatch.setattr(torch._inductor, "aot_compile", aot_compile)
    _flex_attention_on_the_cpu(monkeypatch)
    with pytest.raises(tcg_compile.CompileError) as err:
        tcg_compile.compile_package(
            _exported(), "attn", RuntimeCompatibility("cpu", toolchain=record_toolchain()), tmp_path
        )
    assert err.value.code == "compile.failed"
    assert calls == [True, False][:compiles]
