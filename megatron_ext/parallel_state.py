"""Process groups of 3D parallelism, laid out as Megatron-core lays them out.

Ranks are numbered along ``order`` (default ``"tp-cp-ep-dp-pp"``) with the first dimension
varying fastest: world 8, tp 2, pp 2 gives tensor groups [0,1][2,3][4,5][6,7], data groups
[0,2][1,3][4,6][5,7] and pipeline groups [0,4][1,5][2,6][3,7]. Every rank creates every group
(``torch.distributed.new_group`` is collective) and keeps the ones it belongs to.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

_ORDER_DIMS = ("tp", "cp", "ep", "dp", "pp")

# The groups this rank belongs to, and the global ranks of each.
_GROUPS: dict[str, dist.ProcessGroup] = {}
_GROUP_RANKS: dict[str, list[int]] = {}

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: int | None = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: int | None = None

# Overrides set by the set_* functions (Megatron-core keeps these for tests and mocks).
_OVERRIDES: dict[str, int] = {}


def generate_groups(sizes: dict[str, int], order: str, dims: str) -> list[list[int]]:
    """All groups of ranks that differ only along ``dims`` (e.g. ``"tp-pp"``).

    ``sizes`` maps each dimension of ``order`` to its size; the first dimension of ``order``
    varies fastest in the global rank. Groups are listed with the other dimensions' coordinates
    enumerated fastest-first, and ranks inside a group likewise, which reproduces Megatron-core's
    rank lists exactly.
    """
    order_dims = order.split("-")
    wanted = dims.split("-")
    unknown = [d for d in wanted if d not in order_dims]
    if unknown:
        raise ValueError(f"group dimensions {unknown} are not in order {order!r}")
    strides, stride = {}, 1
    for d in order_dims:
        strides[d] = stride
        stride *= sizes[d]
    inside = [d for d in order_dims if d in wanted]
    outside = [d for d in order_dims if d not in wanted]

    def coords(ds: list[str]):
        # itertools.product varies its last factor fastest; we want the first dim fastest.
        for c in itertools.product(*(range(sizes[d]) for d in reversed(ds))):
            yield dict(zip(reversed(ds), c))

    groups = []
    for out in coords(outside):
        base = sum(strides[d] * v for d, v in out.items())
        groups.append([base + sum(strides[d] * v for d, v in inn.items()) for inn in coords(inside)])
    return groups


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise RuntimeError(f"{name} must be an integer >= 1, got {value!r}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_split_rank: int | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: float = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
) -> None:
    """Creates the tensor, pipeline, data, model and embedding groups.

    ``torch.distributed`` must be initialised first. The data-parallel size is
    ``world_size / (tensor_model_parallel_size * pipeline_model_parallel_size)``. Context and
    expert parallelism are accepted only at size 1.
    """
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "before megatron_ext.parallel_state.initialize_model_parallel()"
        )
    if model_parallel_is_initialized():
        raise RuntimeError(
            "model parallel groups are already initialized: call destroy_model_parallel() first"
        )
    _require_positive("tensor_model_parallel_size", tensor_model_parallel_size)
    _require_positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    for name, value in (
        ("context_parallel_size", context_parallel_size),
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("num_distributed_optimizer_instances", num_distributed_optimizer_instances),
    ):
        _require_positive(name, value)
        if value != 1:
            raise RuntimeError(f"{name}={value} is not supported: megatron_ext supports only 1")
    if expert_tensor_parallel_size not in (None, tensor_model_parallel_size):
        raise RuntimeError(
            f"expert_tensor_parallel_size={expert_tensor_parallel_size} is not supported: "
            "expert parallelism is not implemented"
        )
    if hierarchical_context_parallel_sizes:
        raise RuntimeError("hierarchical_context_parallel_sizes is not supported")
    if pipeline_model_parallel_split_rank is not None:
        raise RuntimeError("pipeline_model_parallel_split_rank (encoder-decoder pipelines) is not supported")
    if virtual_pipeline_model_parallel_size is not None:
        _require_positive("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
        if pipeline_model_parallel_size == 1:
            raise RuntimeError(
                f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
                "pipeline_model_parallel_size > 1, got 1"
            )
    if sorted(order.split("-")) != sorted(_ORDER_DIMS):
        raise RuntimeError(f"order must be a permutation of {'-'.join(_ORDER_DIMS)}, got {order!r}")

    world_size = dist.get_world_size()
    model_size = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_size != 0:
        raise RuntimeError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) = {model_size}"
        )
    sizes = {
        "tp": tensor_model_parallel_size,
        "cp": context_parallel_size,
        "ep": expert_model_parallel_size,
        "dp": world_size // model_size,
        "pp": pipeline_model_parallel_size,
    }
    rank = dist.get_rank()
    timeout = timedelta(minutes=distributed_timeout_minutes)

    def make(kind: str, rank_lists: list[list[int]]) -> None:
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _GROUPS[kind] = group
                _GROUP_RANKS[kind] = list(ranks)

    make("tp", generate_groups(sizes, order, "tp"))
    pipeline_groups = generate_groups(sizes, order, "pp")
    make("pp", pipeline_groups)
    make("dp", generate_groups(sizes, order, "dp"))
    make("dp-cp", generate_groups(sizes, order, "cp-dp"))
    make("cp", generate_groups(sizes, order, "cp"))
    make("mp", generate_groups(sizes, order, "tp-pp"))
    make("tp-dp", generate_groups(sizes, order, "tp-dp"))

    embedding_ranks = get_embedding_ranks or _default_embedding_ranks
    position_ranks = get_position_embedding_ranks or (lambda ranks: ranks[:1])
    # Every rank must take part in every new_group call, including the duplicates some layouts
    # produce (pp=1: each pipeline "group" is one rank).
    make("embd", [embedding_ranks(r) for r in pipeline_groups])
    make("pos_embd", [position_ranks(r) for r in pipeline_groups])

    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size


def _default_embedding_ranks(pipeline_ranks: list[int]) -> list[int]:
    if len(pipeline_ranks) == 1:
        return list(pipeline_ranks)
    return [pipeline_ranks[0], pipeline_ranks[-1]]


def model_parallel_is_initialized() -> bool:
    """Whether initialize_model_parallel has run (and destroy_model_parallel has not)."""
    return "tp" in _GROUPS


is_initialized = model_parallel_is_initialized


def _group(kind: str, what: str) -> dist.ProcessGroup:
    if kind in _GROUPS:
        return _GROUPS[kind]
    if model_parallel_is_initialized():
        # Only the first and last pipeline stages belong to the embedding groups.
        raise RuntimeError(f"rank {dist.get_rank()} is not a member of any {what} group")
    raise RuntimeError(
        f"the {what} group is not initialized: call "
        "megatron_ext.parallel_state.initialize_model_parallel() first"
    )


def _ranks(kind: str, what: str) -> list[int]:
    _group(kind, what)
    return _GROUP_RANKS[kind]


# Groups ------------------------------------------------------------------------------------


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    if not check_initialized:
        return _GROUPS.get("tp")
    return _group("tp", "tensor model parallel")


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    if not check_initialized:
        return _GROUPS.get("pp")
    return _group("pp", "pipeline model parallel")


def get_data_parallel_group(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> dist.ProcessGroup:
    return _group("dp-cp", "data parallel") if with_context_parallel else _group("dp", "data parallel")


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    if not check_initialized:
        return _GROUPS.get("cp")
    return _group("cp", "context parallel")


def get_model_parallel_group() -> dist.ProcessGroup:
    """Tensor x pipeline: the ranks that hold one replica of the model."""
    return _group("mp", "model parallel")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    return _group("tp-dp", "tensor and data parallel")


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The first and last pipeline stage of this rank's pipeline (their word embeddings are tied)."""
    if not check_initialized:
        return _GROUPS.get("embd")
    return _group("embd", "embedding")


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    if not check_initialized:
        return _GROUPS.get("pos_embd")
    return _group("pos_embd", "position embedding")


# Sizes and ranks ---------------------------------------------------------------------------


def get_tensor_model_parallel_world_size() -> int:
    if "tp_size" in _OVERRIDES:
        return _OVERRIDES["tp_size"]
    return dist.get_world_size(group=_group("tp", "tensor model parallel"))


def get_tensor_model_parallel_rank() -> int:
    if "tp_rank" in _OVERRIDES:
        return _OVERRIDES["tp_rank"]
    return dist.get_rank(group=_group("tp", "tensor model parallel"))


def get_pipeline_model_parallel_world_size() -> int:
    if "pp_size" in _OVERRIDES:
        return _OVERRIDES["pp_size"]
    return dist.get_world_size(group=_group("pp", "pipeline model parallel"))


def get_pipeline_model_parallel_rank() -> int:
    if "pp_rank" in _OVERRIDES:
        return _OVERRIDES["pp_rank"]
    return dist.get_rank(group=_group("pp", "pipeline model parallel"))


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return dist.get_world_size(group=get_data_parallel_group(with_context_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return dist.get_rank(group=get_data_parallel_group(with_context_parallel))


def get_context_parallel_world_size() -> int:
    return dist.get_world_size(group=_group("cp", "context parallel"))


def get_context_parallel_rank() -> int:
    return dist.get_rank(group=_group("cp", "context parallel"))


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    _set_override("tp_size", world_size)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _set_override("tp_rank", rank)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _set_override("pp_size", world_size)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _set_override("pp_rank", rank)


def _set_override(key: str, value: int | None) -> None:
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's tensor group."""
    return _ranks("tp", "tensor model parallel")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in this rank's data group."""
    return _ranks("dp-cp" if with_context_parallel else "dp", "data parallel")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp", "pipeline model parallel")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp", "pipeline model parallel")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (the first stage follows the last)."""
    ranks = _ranks("pp", "pipeline model parallel")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (the last stage precedes the first)."""
    ranks = _ranks("pp", "pipeline model parallel")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


# Stages ------------------------------------------------------------------------------------


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the first stage (and, with a virtual pipeline, its first chunk)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        if _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the last stage (and, with a virtual pipeline, its last chunk)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        if _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK != _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """Whether this rank holds a copy of the tied word embedding (first or last stage)."""
    rank = dist.get_rank()
    _group("tp", "tensor model parallel")
    ranks = _GROUP_RANKS.get("embd", [])
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage()
    if rank == ranks[-1]:
        return is_pipeline_last_stage()
    return True


def is_rank_in_position_embedding_group() -> bool:
    _group("tp", "tensor model parallel")
    return dist.get_rank() in _GROUP_RANKS.get("pos_embd", [])


def destroy_model_parallel() -> None:
    """Destroys the groups created by initialize_model_parallel and resets every setting."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    for group in {id(g): g for g in _GROUPS.values()}.values():
        if dist.is_initialized():
            dist.destroy_process_group(group)
    _GROUPS.clear()
    _GROUP_RANKS.clear()
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
