"""Rotary position embeddings (RoPE) in Megatron-core's layout.

Channel pair ``i`` of a head at position ``p`` is rotated by the angle ``p * base^(-2i / dim)``
over the first ``dim = kv_channels * rotary_percent`` channels; the rest pass through. The angles
are ``[s, 1, 1, dim]`` in float32: each angle twice, as ``cat(f, f)`` (rotating channel ``j``
with ``j + dim / 2``, the GPT-NeoX / Llama convention) or with ``rotary_interleaved`` as
``f0 f0 f1 f1 ...`` (rotating channels ``2i`` and ``2i + 1``, GPT-J's). The cosines and sines are
taken in float32 and rounded to the activations' dtype before they multiply, as Megatron-core and
Hugging Face transformers do.
"""

from __future__ import annotations

import torch

from megatron_ext import parallel_state
from megatron_ext.fusions.fused_rope import fused_apply_rotary_pos_emb
from megatron_ext.transformer.context_parallel import get_pos_emb_on_this_cp_rank
from megatron_ext.utils import thd_partitioned_indices


class RotaryEmbedding(torch.nn.Module):
    """The rotation angles for positions ``0 .. max_seq_len - 1`` (Megatron-core's signature)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: torch.distributed.ProcessGroup | None = None,
    ):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        if dim < 2 or dim % 2 != 0:
            raise ValueError(
                f"kv_channels ({kv_channels}) x rotary_percent ({rotary_percent}) = {dim} rotated channels; "
                "expected an even number >= 2"
            )
        if rope_scaling:
            raise NotImplementedError(
                "rope_scaling (Llama 3.1's long-context frequency scaling) is not supported"
            )
        self.dim = dim
        self.rotary_base = rotary_base
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        # Neither a parameter nor a buffer: not saved, and float32 whatever dtype the model is cast to.
        self.inv_freq = 1.0 / (rotary_base**exponents)
        # With context parallelism the angles are those of this rank's chunks of the sequence.
        self.cp_group = (
            cp_group
            if cp_group is not None
            else parallel_state.get_context_parallel_group(check_initialized=False)
        )

    def forward(
        self, max_seq_len: int, offset: int = 0, device: torch.device | None = None, packed_seq: bool = False
    ) -> torch.Tensor:
        """``[max_seq_len, 1, 1, dim]`` float32 angles (on ``device``, default the CPU); over a
        context-parallel group of size cp > 1, the ``max_seq_len / cp`` rows of this rank's chunks
        (``get_pos_emb_on_this_cp_rank``), as Megatron-core's. ``packed_seq``: the angles of
        positions ``0 .. max_seq_len - 1`` unsplit, from which ``apply_rotary_pos_emb`` takes each
        packed sequence's own (Megatron-core's ``packed_seq``)."""
        if self.inv_freq.device != torch.device(device or "cpu"):
            self.inv_freq = self.inv_freq.to(device)
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, self.inv_freq)
        if self.rotary_interleaved:
            angles = freqs.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((freqs, freqs), dim=-1)
        angles = angles[:, None, None, :]
        if self.cp_group is not None and self.cp_group.size() > 1 and not packed_seq:
            angles = get_pos_emb_on_this_cp_rank(angles, 0, self.cp_group)
        return angles


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of each channel with the sign of the sine term: ``(-x2, x1)``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def packed_positions(cu_seqlens: torch.Tensor, cp_group: torch.distributed.ProcessGroup | None = None):
    """The position, within its own sequence, of every row of this context-parallel rank's part of a
    packed row (``cu_seqlens``: the boundaries on the whole row; ``cp_group`` defaults to
    parallel_state's): positions restart at 0 with each sequence."""
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    cp, rank = (cp_group.size(), cp_group.rank()) if cp_group is not None else (1, 0)
    bounds = cu_seqlens.to("cpu", torch.long)
    rows = thd_partitioned_indices(bounds, int(bounds[-1]), cp, rank)
    return rows - bounds[torch.bucketize(rows, bounds[1:], right=True)]


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: torch.distributed.ProcessGroup | None = None,
) -> torch.Tensor:
    """Rotates ``t`` (``[s, b, heads, d]``) by ``freqs`` (``[>= s, 1, 1, dim]``, from
    ``RotaryEmbedding``), channels ``dim ..`` passing through; ``config.rotary_interleaved`` picks
    the channel pairing. With ``config.apply_rope_fusion`` one kernel does it
    (``fusions.fused_apply_rotary_pos_emb``, the same numbers). ``mscale`` multiplies the cosines
    and sines (YaRN's attention factor, ``transformer.yarn_rotary``).

    With ``config.multi_latent_attention`` the rotated channels are DeepSeek's interleaved pairs
    ``(x0, x1), (x2, x3), ..``: they are first laid out as ``x0 x2 .. | x1 x3 ..`` and then rotated
    as halves, as Megatron-core's MLA does (queries and keys alike, so their products are those of
    the interleaved rotation).

    With ``cu_seqlens`` (a packed row, ``t`` ``[t, 1, heads, d]`` or ``[t, heads, d]``: this
    context-parallel rank's rows of it) every sequence is rotated from position 0 on, by the rows
    of ``freqs`` (``RotaryEmbedding(.., packed_seq=True)``, at least the longest sequence's
    positions) of its own positions (``packed_positions``), as Megatron-core does for ``thd``."""
    if cu_seqlens is not None:
        positions = packed_positions(cu_seqlens, cp_group)
        longest = int(positions.max()) + 1
        if longest > freqs.shape[0]:
            raise ValueError(
                f"rotary angles for {freqs.shape[0]} positions, but a packed sequence reaches position "
                f"{longest - 1}; compute them for the longest sequence (max_seqlen_q / max_seqlen_kv)"
            )
        freqs = freqs.index_select(0, positions.to(freqs.device))
        if t.dim() == 3:
            return apply_rotary_pos_emb(t.unsqueeze(1), freqs, config, mscale=mscale).squeeze(1)
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    dim = freqs.shape[-1]
    if dim > t.shape[-1]:
        raise ValueError(f"rotary embeddings of {dim} channels for heads of {t.shape[-1]} channels")
    freqs = freqs[: t.shape[0]]
    fused = bool(getattr(config, "apply_rope_fusion", False))
    mla = bool(getattr(config, "multi_latent_attention", False))
    if fused and not mla and mscale == 1.0:
        return fused_apply_rotary_pos_emb(t, freqs, interleaved)
    rotated, passed = t[..., :dim], t[..., dim:]
    if mla:
        rotated = torch.cat((rotated[..., 0::2], rotated[..., 1::2]), dim=-1)
    if fused:  # the rotation is linear: the factor can follow it
        rotated = fused_apply_rotary_pos_emb(rotated, freqs, interleaved)
        rotated = rotated * mscale if mscale != 1.0 else rotated
    else:
        cos, sin = freqs.cos(), freqs.sin()
        if mscale != 1.0:
            cos, sin = cos * mscale, sin * mscale
        cos, sin = cos.to(t.dtype), sin.to(t.dtype)
        rotated = rotated * cos + _rotate_half(rotated, interleaved) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated
