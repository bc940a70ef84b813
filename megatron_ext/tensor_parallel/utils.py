"""Size arithmetic and tensor splitting shared by the tensor-parallel layers."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_ext.resolve import default_group
from megatron_ext._torch_compat import all_gather_single


def comm_device(*groups: dist.ProcessGroup) -> torch.device:
    """Where a tensor must be for the collectives of ``groups``: the current CUDA device when one
    of them runs on NCCL (which moves CUDA tensors only), else the CPU (gloo)."""
    if any(dist.get_backend(group) == "nccl" for group in groups):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_device(use_cpu_initialization: bool) -> torch.device:
    """Where a layer creates its parameters: the meta device inside ``torch.device("meta")`` (a model
    built with ``init_model_with_meta_device``), else the CPU with ``use_cpu_initialization`` or
    without a GPU, else the current GPU."""
    if torch.get_default_device().type == "meta":
        return torch.device("meta")
    if use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raises ValueError unless ``numerator`` is divisible by ``denominator``."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, raising ValueError if the division is not exact."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """Splits ``tensor`` into ``num_partitions`` equal chunks along its last dim (views unless
    ``contiguous_split_chunks``)."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def resolve_tp_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group``, or the tensor-model-parallel group when it is ``None`` (the one place a group
    argument of the package falls back to parallel_state's tensor-parallel group)."""
    return default_group("tp", group)


def tp_group_size_rank(group: dist.ProcessGroup | None = None) -> tuple[dist.ProcessGroup, int, int]:
    """``resolve_tp_group(group)``, its size and this process's rank in it."""
    group = resolve_tp_group(group)
    return group, dist.get_world_size(group), dist.get_rank(group)


def group_args(group: dist.ProcessGroup | None = None) -> tuple[str, int, int]:
    """What an op's schema takes of a group: its c10d registry name, its size and this process's
    rank in it (``None`` means the tensor-model-parallel group)."""
    group, size, rank = tp_group_size_rank(group)
    return group.group_name, size, rank


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This tensor-parallel rank's chunk of ``tensor`` flattened (numel must divide by the TP size)."""
    _, world, rank = tp_group_size_rank(tp_group)
    flat = tensor.reshape(-1)
    chunk = divide(flat.numel(), world)
    data = flat[rank * chunk : (rank + 1) * chunk]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of split_tensor_into_1d_equal_chunks: all-gathers the 1-D chunks of the
    tensor-parallel group into one flat tensor."""
    group = resolve_tp_group(tp_group)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    all_gather_single(gathered, tensor.contiguous().reshape(-1), group=group)
    return gathered


class VocabUtility:
    """The range ``[first, last)`` of vocabulary rows held by one rank: the vocabulary is split
    into equal contiguous partitions."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
