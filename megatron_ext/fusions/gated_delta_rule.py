"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next) in one kernel a chunk at a time, forward and
backward (``torch.ops.megatron_ext.chunk_gated_delta_rule``)."""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` (what Megatron-core's GatedDeltaNet calls): q, k ``[B, T, H, K]``,
    v ``[B, T, HV, V]``, g (log decay, <= 0) and beta ``[B, T, HV]``; per head the state S ``[K, V]``
    runs ``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T`` and
    ``o_t = S_t^T (scale q_t)``, scale ``K ** -0.5`` unless given, q and k L2-normalised over K first with
    ``use_qk_l2norm_in_kernel``.

    HV a multiple of H shares each q/k head among HV / H consecutive value heads (as transformers'
    Qwen3-Next repeats them). ``initial_state`` ``[B, HV, K, V]`` (zero without); packed sequences are given
    as ``cu_seqlens`` (int32/int64 offsets ``[S + 1]``, B = 1), the state restarting at each, with
    ``initial_state`` and the final state ``[S, HV, K, V]`` then. Returns ``(o [B, T, HV, V], final_state)``,
    the final state (float32, float64 for float64 inputs) only with ``output_final_state``, else None."""
    heads, value_heads = q.shape[2] if q.dim() == 4 else None, v.shape[2] if v.dim() == 4 else None
    if heads is not None and value_heads is not None and heads != value_heads:
        if heads == 0 or value_heads % heads != 0:
            raise ValueError(
                f"chunk_gated_delta_rule: v's heads ({value_heads}) must be a multiple of q's and k's "
                f"heads ({heads})"
            )
        q = q.repeat_interleave(value_heads // heads, dim=2)
        k = k.repeat_interleave(value_heads // heads, dim=2)
    o, final_state = torch.ops.megatron_ext.chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
        chunk_size
    )
    return o, final_state if output_final_state else None
