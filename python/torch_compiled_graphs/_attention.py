"""Attention of the libtorch-free variant on CUDA: ``scaled_dot_product_attention`` as flex attention.

The ``shim-v1`` variant may call no attention extern (flash, efficient and cuDNN
attention are libtorch's). Decomposed into matmuls and a softmax (the math backend) its
attention is correct but slow: the math backend computes half-precision inputs in
float32, so both matmuls run as float32 Triton templates, and the scores make a round
trip through memory. Flex attention with no score modification is the same
computation, and inductor lowers it to one fused Triton kernel (online softmax, scores
kept on chip) that the package carries.

:func:`rewrite_to_flex` rewrites a ``program.module()`` in place before the compile:
every SDPA call without dropout becomes :func:`sdpa_as_flex`, which at trace time
calls ``flex_attention`` with the call's ``scale`` and ``enable_gqa``, ``is_causal`` and
``attn_mask`` as a score modification (a boolean mask selects, a float mask adds; a
fully masked row gives zeros, as SDPA's math backend does), or, where flex attention
cannot take the call (inputs that are not 4-D, non-float dtypes), the SDPA op itself,
which the compile's math backend then decomposes. Calls whose queries and keys have the
same lengths on the same device share one block mask (flex attention's "no block
sparsity" mask), made once per call of the graph instead of once per attention.

The compile falls back to the math backend for the whole graph when a compile with
flex attention fails (``compile.compile_package``).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["rewrite_to_flex", "sdpa_as_flex"]

_FLOATS = ("float16", "bfloat16", "float32")


def _flex_takes(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any) -> bool:
    """Whether flex attention computes this SDPA call (else the SDPA op is called)."""
    import torch

    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if len({t.dtype for t in tensors}) != 1 or str(query.dtype).removeprefix("torch.") not in _FLOATS:
        return False
    if len({t.device for t in tensors}) != 1:
        return False
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        return False
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() > 4:
            return False
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return False
    return True


def sdpa_as_flex(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_mask: Any = None,
) -> Any:
    """``scaled_dot_product_attention`` computed by flex attention, where it can be.

    ``block_mask`` is a shared "no block sparsity" mask (see :func:`rewrite_to_flex`)."""
    import torch

    if not _flex_takes(query, key, value, attn_mask, dropout_p):
        return torch.ops.aten.scaled_dot_product_attention.default(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None
    if is_causal:
        # SDPA's causal mask is the lower triangle of (L, S): query i sees keys 0..i.
        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return torch.where(q_idx >= kv_idx, score, -float("inf"))

    elif attn_mask is not None:
        mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
        if mask.dtype == torch.bool:

            def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return torch.where(mask[b, h, q_idx, kv_idx], score, -float("inf"))

        else:

            def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return score + mask[b, h, q_idx, kv_idx]

    with warnings.catch_warnings():
        # Called outside torch.compile, flex attention warns that it runs unfused; here it
        # is traced into the graph that inductor compiles, fused.
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(
            query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
        )


def _empty_block_mask(query: Any, key: Any) -> Any:
    """Flex attention's own "no block sparsity" mask for these lengths (what it makes when
    given none)."""
    from torch.nn.attention import flex_attention as flex

    try:
        return flex._create_empty_block_mask(query, key)
    except TypeError:  # a torch whose helper takes other arguments: each call makes its own
        return None


def _dropout_of(node: Any) -> Any:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)


def _share_key(node: Any) -> tuple[str, str, str] | None:
    """``(query length, key length, device)`` of an SDPA node, from its recorded values."""
    import torch

    q, k = (getattr(a, "meta", {}).get("val") for a in node.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4):
        return None
    return (str(q.shape[-2]), str(k.shape[-2]), str(q.device))


def rewrite_to_flex(module: Any) -> int:
    """Rewrite every dropout-free SDPA call of ``module`` (a ``GraphModule``, with its
    nested graphs) to :func:`sdpa_as_flex`; returns how many calls were rewritten."""
    import torch
    from torch.nn.attention import flex_attention as flex

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    # A private helper of flex attention: without it each call makes its own mask.
    shared = hasattr(flex, "_create_empty_block_mask")
    count = 0
    for gm in list(module.modules()):
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        masks: dict[tuple[str, str, str], Any] = {}
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not sdpa or _dropout_of(node) != 0:
                continue
            key = _share_key(node) if shared else None
            if key is not None and key not in masks:
                with gm.graph.inserting_before(node):
                    masks[key] = gm.graph.call_function(_empty_block_mask, (node.args[0], node.args[1]))
            node.target = sdpa_as_flex
            if key is not None:
                node.kwargs = {**node.kwargs, "block_mask": masks[key]}
            changed = True
            count += 1
        if changed:
            gm.graph.lint()
            gm.recompile()
    return count
