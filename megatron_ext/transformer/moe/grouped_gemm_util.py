"""Grouped GEMM for the experts: ``ops.gmm(a, b, batch_sizes, trans_b=False)``.

Rows of ``a`` [tokens, k] come grouped by expert, ``batch_sizes[e]`` of them for expert ``e``;
each group is multiplied by its expert's ``b[e]`` ([k, n], or [n, k] with ``trans_b``). Uses
``torch._grouped_mm`` on CUDA for bfloat16 where the build has it, else a loop over experts.
Replaces Megatron-core's optional ``grouped_gemm`` package, so it is always available.
"""

from __future__ import annotations

import types

import torch


def grouped_gemm_is_available() -> bool:
    """Always True: the grouped GEMM is this library's own."""
    return True


def assert_grouped_gemm_is_available() -> None:
    """Nothing to check: the grouped GEMM is this library's own."""


def _check(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool) -> list[int]:
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"gmm: expected a [tokens, k] and b [experts, k, n], got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    sizes = [int(s) for s in batch_sizes.tolist()]
    if len(sizes) != b.shape[0] or any(s < 0 for s in sizes):
        raise ValueError(f"gmm: batch_sizes must list {b.shape[0]} non-negative counts, got {sizes}")
    if sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: batch_sizes {sizes} sum to {sum(sizes)}, but a has {a.shape[0]} rows")
    k = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k:
        raise ValueError(f"gmm: a has {a.shape[1]} columns, b{' (trans_b)' if trans_b else ''} expects {k}")
    return sizes


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``a`` [tokens, k] grouped by expert times ``b`` [E, k, n] (or [E, n, k] with
    ``trans_b``) -> [tokens, n], with autograd."""
    sizes = _check(a, b, batch_sizes, trans_b)
    outs = [
        chunk @ (b[e].T if trans_b else b[e]) for e, chunk in enumerate(torch.split(a, sizes, dim=0))
    ]
    return torch.cat(outs, dim=0) if outs else a.new_empty((0, b.shape[1] if trans_b else b.shape[2]))


ops = types.SimpleNamespace(gmm=gmm)
