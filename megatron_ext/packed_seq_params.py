"""Megatron-core's ``PackedSeqParams``: how a row of packed sequences (``qkv_format="thd"``) is cut.

``cu_seqlens_q`` / ``cu_seqlens_kv`` are the cumulative sequence lengths ``[0, l_0, l_0 + l_1, ..,
total]`` of the whole row (before any split over context-parallel ranks), ``max_seqlen_q`` /
``max_seqlen_kv`` the longest sequence. The ``_padded`` variants, where given, are the boundaries
of the sequences padded to a multiple of ``2 * cp`` tokens: the layout of the row, of which each
sequence's real tokens are the first ``cu_seqlens`` ones. megatron_ext's attention, rotary
embeddings and ``utils.get_thd_batch_on_this_cp_rank`` read these fields; ``local_cp_size`` and
``cp_group`` (Megatron-core's dynamic context parallelism) must stay None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class PackedSeqParams:
    """The fields Megatron-core 0.16.1's ``megatron.core.packed_seq_params.PackedSeqParams`` has, in
    its order and with its defaults."""

    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: dist.ProcessGroup = None
