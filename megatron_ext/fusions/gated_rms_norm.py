"""The gated RMSNorm over groups of Mamba-2 layers (mamba-ssm's ``rmsnorm_fn``, which Megatron-core's
MambaMixer norm, ``RMSNormGated``, runs), as torch ops: autograd through them, no kernel of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """mamba-ssm's ``rmsnorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate)`` with its upcast:
    in float32 (float64 for float64 x), each group of ``group_size`` consecutive channels of the last
    dimension (all of them without) is scaled by ``1 / sqrt(mean(v^2) + eps)``, then by ``weight``
    (plus ``bias``); with ``z``, gated by ``silu(z)`` after the norm (``norm_before_gate``) or before it
    (what Megatron-core's MambaMixer uses: ``norm_before_gate=False``). Returns x's dtype."""
    width = x.shape[-1]
    size = width if group_size is None else group_size
    if size <= 0 or width % size != 0:
        raise ValueError(f"rms_norm_gated: group_size {group_size} must divide the last dimension {width}")
    if weight.shape != (width,) or (bias is not None and bias.shape != (width,)):
        raise ValueError(f"rms_norm_gated: weight and bias must be [{width}], got {tuple(weight.shape)}"
                         + ("" if bias is None else f" and {tuple(bias.shape)}"))
    if z is not None and z.shape != x.shape:
        raise ValueError(f"rms_norm_gated: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(acc)
    gate = None if z is None else F.silu(z.to(acc))
    if gate is not None and not norm_before_gate:
        v = v * gate
    groups = v.unflatten(-1, (width // size, size))
    rstd = torch.rsqrt(groups.square().mean(dim=-1, keepdim=True) + eps)
    out = (groups * rstd).flatten(-2) * weight.to(acc)
    if bias is not None:
        out = out + bias.to(acc)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)
