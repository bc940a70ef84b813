"""The Mamba-2 SSD (state-space duality) scan in one kernel, forward and backward
(``torch.ops.megatron_ext.mamba_chunk_scan``), and mamba-ssm's ``mamba_chunk_scan_combined`` over it."""

from __future__ import annotations

import math

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def _boundaries_of_seq_idx(seq_idx: torch.Tensor, length: int) -> torch.Tensor:
    """The offsets [0, ..., L] of the runs of equal values of a [1, L] sequence index."""
    if seq_idx.dim() != 2 or seq_idx.shape[0] != 1 or seq_idx.shape[1] != length:
        raise ValueError(
            f"mamba_chunk_scan_combined: seq_idx must be [1, {length}] (batch 1, x's length), got shape "
            f"{tuple(seq_idx.shape)}"
        )
    row = seq_idx[0]
    starts = (row[1:] != row[:-1]).nonzero().flatten() + 1
    edge = torch.tensor([0], dtype=torch.long, device=row.device)
    return torch.cat([edge, starts.long(), edge + length])


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (what Megatron-core's MambaMixer calls outside its
    memory-efficient training path), with its arguments and returns: ``out``, ``(out, final_states)``,
    ``(out, varlen_states)`` or ``(out, final_states, varlen_states)``.

    x ``[B, L, H, P]``, dt ``[B, L, H]``, A ``[H]``, B and C ``[B, L, G, N]``, D ``[H]`` or ``[H, P]``, z like
    x, dt_bias ``[H]``, initial_states ``[B, H, P, N]``; the states come back in float32 (float64 for
    float64 inputs). Packed sequences (batch 1) are given by ``seq_idx`` ``[1, L]`` (a sequence index per
    token; the state restarts wherever it changes) and/or ``cu_seqlens`` ``[S + 1]``; given both, they must
    mark the same sequences. With packed sequences, ``initial_states`` is ``[S, H, P, N]`` (one per
    sequence) or, as mamba-ssm takes it, ``[1, H, P, N]`` for the first sequence only; ``final_states`` is
    the last sequence's and ``varlen_states`` ``[S, H, P, N]`` every sequence's. Unlike mamba-ssm, where
    cu_seqlens alone only selects the varlen states, cu_seqlens alone also restarts the state."""
    length = x.shape[1] if x.dim() == 4 else 0
    if seq_idx is not None:
        boundaries = _boundaries_of_seq_idx(seq_idx, length)
        if cu_seqlens is not None and not torch.equal(boundaries, cu_seqlens.to(torch.long)):
            raise ValueError(
                "mamba_chunk_scan_combined: cu_seqlens "
                f"{cu_seqlens.tolist()} does not mark the sequences of seq_idx (which start at "
                f"{boundaries.tolist()})"
            )
        cu_seqlens = boundaries
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("mamba_chunk_scan_combined: return_varlen_states needs cu_seqlens (or seq_idx)")
    if len(dt_limit) != 2:
        raise ValueError(f"mamba_chunk_scan_combined: dt_limit must be (min, max), got {dt_limit!r}")
    dt_min, dt_max = float(dt_limit[0]), float(dt_limit[1])
    if cu_seqlens is not None and initial_states is not None:
        sequences = cu_seqlens.shape[0] - 1
        if initial_states.dim() == 4 and initial_states.shape[0] == 1 and sequences > 1:
            rest = initial_states.new_zeros((sequences - 1, *initial_states.shape[1:]))
            initial_states = torch.cat([initial_states, rest])
    out, states = torch.ops.megatron_ext.mamba_chunk_scan(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens, dt_softplus, dt_min,
        None if math.isinf(dt_max) and dt_max > 0 else dt_max,
    )
    result = [out]
    if return_final_states:
        result.append(states if cu_seqlens is None else states[-1:])
    if return_varlen_states:
        result.append(states)
    return out if len(result) == 1 else tuple(result)
