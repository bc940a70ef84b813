"""Rotary position embedding in one kernel, forward and backward
(``torch.ops.megatron_ext.rotary_pos_emb``)."""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False, *, interleaved: bool | None = None
) -> torch.Tensor:
    """Megatron-core's rotary embedding of ``t`` [s, b, n, d] by the angles ``freqs`` [s, 1, 1, d_rot]
    (its ``_apply_rotary_pos_emb_bshd`` with ``mscale`` 1), in one kernel.

    ``freqs`` is in Megatron's layout: the angles repeated as ``cat(f, f)`` along the last dim, or
    each angle twice in a row when ``rotary_interleaved``. With ``cos``/``sin`` computed in freqs'
    dtype and cast to t's dtype, the first ``d_rot`` lanes of each head become
    ``t * cos + rotate_half(t) * sin``, where rotate_half maps the halves ``(x1, x2)`` to
    ``(-x2, x1)`` (interleaved: each pair ``(x[2k], x[2k+1])`` to ``(-x[2k+1], x[2k])``); the other
    ``d - d_rot`` lanes pass unchanged. The output is contiguous. Heads may lie at any strides (a view
    of a fused QKV output is read in place) as long as their lanes are contiguous; otherwise ``t`` is
    read as a contiguous copy. The backward gives t the transposed rotation of the output's
    gradient; freqs gets none.

    ``interleaved`` is the keyword of Megatron-core's wrapper of TransformerEngine's fused RoPE
    (``fused_apply_rotary_pos_emb(t, freqs, interleaved=...)``), accepted for its callers."""
    if interleaved is not None:
        if rotary_interleaved and not interleaved:
            raise ValueError(
                "fused_apply_rotary_pos_emb: rotary_interleaved=True contradicts interleaved=False"
            )
        rotary_interleaved = interleaved
    return torch.ops.megatron_ext.rotary_pos_emb(t, freqs, bool(rotary_interleaved))
