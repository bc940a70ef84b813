"""Helpers that Megatron-core keeps in ``megatron.core.utils``: ShardedTensors of a rank's tensors
(they live in ``dist_checkpointing.rank_shards``) and a batch's share of a context-parallel rank,
of a plain batch and of a row of packed sequences."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.rank_shards import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.resolve import group_rank, group_size

__all__ = [
    "make_sharded_tensor_for_checkpoint",
    "make_tp_sharded_tensor_for_checkpoint",
    "get_batch_on_this_cp_rank",
    "get_thd_batch_on_this_cp_rank",
    "thd_partitioned_indices",
]


def get_batch_on_this_cp_rank(
    batch: dict[str, Any], cp_group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """This context-parallel rank's part of ``batch`` (Megatron-core's signature and layout): each
    tensor's sequence (dim 1; dim 2 for ``attention_mask``) cut into ``2 * cp`` chunks, of which
    rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``, so every rank has the same causal work.
    ``cp_group`` defaults to parallel_state's. Updates ``batch`` in place and returns it; ValueError
    if a sequence does not divide into ``2 * cp`` chunks."""
    if cp_group is None:
        cp = parallel_state.get_context_parallel_world_size()
        rank = parallel_state.get_context_parallel_rank()
    else:
        cp, rank = group_size(cp_group), group_rank(cp_group)
    if cp <= 1:
        return batch
    for key, value in batch.items():
        if value is None:
            continue
        dim = 2 if key == "attention_mask" else 1
        if value.shape[dim] % (2 * cp):
            raise ValueError(
                f"get_batch_on_this_cp_rank: batch[{key!r}] has sequence length {value.shape[dim]} (dim "
                f"{dim}), which does not divide into 2 * context_parallel_size = {2 * cp} chunks"
            )
        chunks = value.unflatten(dim, (2 * cp, -1))
        index = torch.tensor([rank, 2 * cp - 1 - rank], device=value.device)
        batch[key] = chunks.index_select(dim, index).flatten(dim, dim + 1)
    return batch


def thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """The rows of a packed row that context-parallel rank ``cp_rank`` holds (TransformerEngine's
    ``thd_get_partitioned_indices``): each sequence, ``cu_seqlens_padded[i] .. [i + 1]``, cut into
    ``2 * cp_size`` chunks, of which the rank keeps chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``,
    sequence after sequence (at cp 1 every row, in order). ValueError unless the boundaries increase
    from 0 to ``total_tokens`` and every sequence divides into the chunks."""
    bounds = [int(x) for x in cu_seqlens_padded.tolist()]
    if bounds[:1] != [0] or bounds[-1] != total_tokens or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens_padded must increase strictly from 0 to the row's {total_tokens} tokens, got "
            f"{bounds}"
        )
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        if cp_size == 1:
            parts.append(torch.arange(a, b))
            continue
        if (b - a) % (2 * cp_size):
            raise ValueError(
                f"a packed sequence of {b - a} tokens (padded) does not divide into 2 * cp = {2 * cp_size} "
                "chunks; pad each sequence to a multiple of it"
            )
        chunk = (b - a) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(a + c * chunk, a + (c + 1) * chunk))
    return torch.cat(parts).to(cu_seqlens_padded.device)


def get_thd_batch_on_this_cp_rank(
    batch: dict[str, Any],
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: torch.Tensor,
    cp_size: int | None = None,
    cp_rank: int | None = None,
) -> tuple[dict[str, Any], PackedSeqParams]:
    """This context-parallel rank's part of a batch of packed sequences (Megatron-core's signature):
    every tensor but ``attention_mask``, ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen``
    indexed along dim 1 by ``thd_partitioned_indices``, and the ``PackedSeqParams``
    (``qkv_format="thd"``) the model's forward takes. ``cp_size`` / ``cp_rank`` default to
    parallel_state's. Updates ``batch`` in place."""
    longest = int(max_seqlen.reshape(-1)[0].item())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    cp = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    if cp > 1:
        index = thd_partitioned_indices(cu_seqlens_padded, batch["tokens"].size(1), cp, rank)
        for key, value in batch.items():
            if key in ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen") or value is None:
                continue
            batch[key] = value.index_select(1, index.to(value.device))
    return batch, params
