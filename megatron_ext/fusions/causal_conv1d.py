"""The short depthwise causal convolution of Mamba-2 and Gated DeltaNet layers in one kernel, forward and
backward (``torch.ops.megatron_ext.causal_conv1d``)."""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal-conv1d package's ``causal_conv1d_fn`` (what Megatron-core's MambaMixer and GatedDeltaNet
    call): ``act(conv1d(x, weight[:, None], bias, padding=W - 1, groups=D)[..., :L])`` for x ``[B, D, L]``,
    weight ``[D, W]``, bias ``[D]``, activation None (or "identity"), "silu" or "swish".

    ``initial_states`` ``[B, D, W - 1]`` are the inputs before each row's start (zeros without). Packed
    sequences are given as ``cu_seqlens`` (int32/int64 offsets ``[S + 1]``, B = 1): the convolution
    restarts at each start, with ``initial_states`` ``[S, D, W - 1]`` then, one per sequence. The package's
    ``seq_idx`` and its final states are not offered: a value for them is refused."""
    if seq_idx is not None:
        raise ValueError("causal_conv1d_fn: seq_idx is not supported; give packed sequences as cu_seqlens")
    if return_final_states or final_states_out is not None:
        raise ValueError(
            "causal_conv1d_fn: return_final_states and final_states_out are not supported (a row's final "
            "states are its last W - 1 inputs)"
        )
    return torch.ops.megatron_ext.causal_conv1d(
        x, weight, bias, cu_seqlens, initial_states, "none" if activation is None else activation
    )
