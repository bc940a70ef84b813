"""Grouped GEMM for the experts: ``ops.gmm(a, b, batch_sizes, trans_b=False)``.

Rows of ``a`` [tokens, k] come grouped by expert, ``batch_sizes[e]`` of them for expert ``e``
(a CPU integer tensor); each group is multiplied by its expert's ``b[e]`` ([k, n], or [n, k] with
``trans_b``), giving [tokens, n], with autograd. On CUDA, for bfloat16 on a GPU of compute
capability 9.0 or newer with k and n multiples of 8, this is ``torch._grouped_mm`` (one kernel);
everywhere else the C++ op ``torch.ops.megatron_ext.grouped_gemm``, a loop of GEMMs forward and
backward. It stands in for Megatron-core's optional ``grouped_gemm`` package, so it is always
available.
"""

from __future__ import annotations

import types

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def grouped_gemm_is_available() -> bool:
    """Always True: the grouped GEMM is this library's own."""
    return True


def assert_grouped_gemm_is_available() -> None:
    """Nothing to check: the grouped GEMM is this library's own."""


def _uses_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (hasattr(torch, "_grouped_mm") and a.is_cuda and a.dtype == b.dtype == torch.bfloat16):
        return False
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] % 8 or b.shape[1] % 8 or b.shape[2] % 8:
        return False
    return torch.cuda.get_device_capability(a.device) >= (9, 0)


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``a`` [tokens, k] grouped by expert times ``b`` [E, k, n] (or [E, n, k] with
    ``trans_b``) -> [tokens, n], with autograd."""
    if not isinstance(batch_sizes, torch.Tensor):
        batch_sizes = torch.as_tensor(batch_sizes, dtype=torch.int64)
    if _uses_grouped_mm(a, b) and batch_sizes.numel() == b.shape[0] and int(batch_sizes.sum()) == a.shape[0]:
        offs = torch.cumsum(batch_sizes.to(a.device, torch.int32), dim=0, dtype=torch.int32)
        return torch._grouped_mm(a, b.transpose(-2, -1) if trans_b else b, offs=offs)
    return torch.ops.megatron_ext.grouped_gemm(a, b, batch_sizes, trans_b)


ops = types.SimpleNamespace(gmm=gmm)
