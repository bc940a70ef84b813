"""Process groups of model parallelism, laid out as Megatron-core lays them out.

Ranks are numbered along ``order`` (default ``"tp-cp-ep-dp-pp"``) with the first dimension
varying fastest: world 8, tp 2, pp 2 gives tensor groups [0,1][2,3][4,5][6,7], data groups
[0,2][1,3][4,6][5,7] and pipeline groups [0,4][1,5][2,6][3,7]. The expert layers get their own
layout over (expert-tensor, expert, expert-data, pipeline) sizes with the same order; both share
the pipeline groups. Every rank creates every group (``torch.distributed.new_group`` is
collective) and keeps the ones it belongs to.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch.distributed as dist

from megatron_ext.global_memory_buffer import GlobalMemoryBuffer
from megatron_ext.process_group_layout import (  # noqa: F401  (Megatron-core's names, re-exported)
    _GLOBAL_NAMES,
    _GLOBAL_RANK_NAMES,
    ParallelStateError,
    RankGenerator,
    _check,
    create_group,
    create_model_parallel_groups,
    create_hierarchical_groups,
    create_hybrid_dp_cp_groups,
    default_embedding_ranks,
    default_position_embedding_ranks,
    forget_created_groups,
    generate_masked_orthogonal_rank_groups,
    get_nccl_options,
    overwrite_nccl_comm_cfgs,
    update_pg_timeout,
)


# The groups this rank belongs to, by kind, and the global ranks of each.
_GROUPS: dict[str, Any] = {}
_GROUP_RANKS: dict[str, list[int]] = {}
# Hybrid data x context groups of this rank, by size.
_HYBRID_DP_CP_GROUPS: dict[int, dist.ProcessGroup] = {}

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: int | None = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: int | None = None
# Which virtual stage model chunk c of pipeline rank r holds: "interleaved" (c * pp + r, as in
# Megatron-core) or "v" (ZB-V's two chunks: r, then 2 pp - 1 - r).
_PIPELINE_MODEL_PARALLEL_LAYOUT = "interleaved"

# Overrides set by the set_* functions (Megatron-core keeps these for tests and mocks).
_OVERRIDES: dict[str, int] = {}

_GLOBAL_MEMORY_BUFFER: GlobalMemoryBuffer | None = None
_GLOBAL_SYMMETRIC_MEMORY_BUFFER: Any = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
) -> None:
    """Creates every group of tensor, pipeline, context, data and expert parallelism.

    ``torch.distributed`` must be initialised first. The data-parallel size is
    ``world_size / (tensor x pipeline x context)``; the expert-data-parallel size is
    ``world_size / (expert_tensor x expert x pipeline)`` (``expert_tensor_parallel_size`` defaults
    to the tensor size). SHARP (``use_sharp``) is not supported.
    """
    arguments = dict(locals())  # every argument, passed on by name
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _check(
        dist.is_available() and dist.is_initialized(),
        "torch.distributed is not initialized: call torch.distributed.init_process_group() "
        "before megatron_ext.parallel_state.initialize_model_parallel()",
    )
    _check(
        "dp" not in _GROUPS,
        "model parallel groups are already initialized: call destroy_model_parallel() first",
    )
    create_model_parallel_groups(_GROUPS, _GROUP_RANKS, _HYBRID_DP_CP_GROUPS, **arguments)

    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _set_global_memory_buffer()


def is_initialized() -> bool:
    """Whether the data-parallel group exists (initialize_model_parallel has run)."""
    return "dp" in _GROUPS


def is_unitialized() -> bool:
    """Deprecated: ``not is_initialized()``."""
    warnings.warn(
        "is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2
    )
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """Whether the tensor, pipeline and data groups exist."""
    return all(k in _GROUPS for k in ("tp", "pp", "dp"))


def _group(kind: str, what: str, check_initialized: bool = True) -> Any:
    if kind in _GROUPS or not check_initialized:
        return _GROUPS.get(kind)
    if is_initialized() and kind in ("embd", "pos_embd"):
        # Only some pipeline stages belong to the embedding groups.
        raise ParallelStateError(f"rank {dist.get_rank()} is not a member of any {what} group")
    raise ParallelStateError(
        f"the {what} group is not initialized: call "
        "megatron_ext.parallel_state.initialize_model_parallel() first"
    )


def __getattr__(name: str) -> Any:
    """Megatron-core's module globals of the groups (``_MODEL_PARALLEL_GROUP``,
    ``_DATA_PARALLEL_GROUP_GLOO``, ``_PIPELINE_GLOBAL_RANKS``, ...), read-only."""
    if name in _GLOBAL_NAMES:
        return _GROUPS.get(_GLOBAL_NAMES[name])
    if name in _GLOBAL_RANK_NAMES:
        return _GROUP_RANKS.get(_GLOBAL_RANK_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ranks(kind: str, what: str) -> list[int]:
    _group(kind, what)
    return _GROUP_RANKS[kind]


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


# Groups ------------------------------------------------------------------------------------


def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Tensor x pipeline: the ranks that hold one replica of the model."""
    return _group("mp", "model parallel", check_initialized)


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("tp", "tensor model parallel", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("pp", "pipeline model parallel", check_initialized)


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> dist.ProcessGroup:
    """The data-parallel group; with ``with_context_parallel`` the data x context group (its
    distributed-optimizer-instance part with ``partial_data_parallel``; its separate all-gather
    twin with ``independent_all_gather``)."""
    if with_context_parallel:
        if partial_data_parallel:
            return _group("intra-dp-cp", "intra partial data parallel")
        if independent_all_gather:
            return _group("dp-cp-ag", "data parallel all-gather (create_all_gather_group=True)")
        return _group("dp-cp", "data parallel with context parallel")
    _check(not partial_data_parallel, "partial_data_parallel=True needs with_context_parallel=True")
    return _group("dp", "data parallel")


def has_separate_all_gather_group() -> bool:
    """Whether initialize_model_parallel(create_all_gather_group=True) made a separate group."""
    return "dp-cp-ag" in _GROUPS


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> dist.ProcessGroup:
    """The gloo twin of get_data_parallel_group (the same group when the backend is gloo)."""
    if with_context_parallel:
        if partial_data_parallel:
            return _group("intra-dp-cp-gloo", "intra partial data parallel gloo")
        return _group("dp-cp-gloo", "data parallel with context parallel gloo")
    _check(not partial_data_parallel, "partial_data_parallel=True needs with_context_parallel=True")
    return _group("dp-gloo", "data parallel gloo")


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("cp", "context parallel", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of this rank's context-parallel group."""
    if "cp" not in _GROUP_RANKS and not check_initialized:
        return None
    return _ranks("cp", "context parallel")


def get_hierarchical_context_parallel_groups(
    check_initialized: bool = True,
) -> list[dist.ProcessGroup] | None:
    """This rank's context-parallel groups at each level of hierarchical_context_parallel_sizes."""
    return _group("hcp", "hierarchical context parallel", check_initialized)


def get_hybrid_data_context_parallel_groups(
    check_initialized: bool = True, group_size: int | None = None
) -> dist.ProcessGroup | None:
    """This rank's hybrid data x context group of ``group_size`` ranks."""
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return _group("dp-cp", "data parallel with context parallel", check_initialized)
    if group_size not in _HYBRID_DP_CP_GROUPS:
        if not check_initialized and not _HYBRID_DP_CP_GROUPS:
            return None
        raise ParallelStateError(
            f"no hybrid data x context parallel group of size {group_size}: sizes are "
            f"{sorted(_HYBRID_DP_CP_GROUPS)} (initialize_model_parallel(hybrid_context_parallel=True))"
        )
    return _HYBRID_DP_CP_GROUPS[group_size]


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The first and last pipeline stage of this rank's pipeline (their word embeddings are tied)."""
    return _group("embd", "embedding", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("pos_embd", "position embedding", check_initialized)


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> dist.ProcessGroup:
    """The FP8 amax reduction group: tensor x data (x context), or tensor (x context) only."""
    if with_context_parallel:
        return _group("tp-cp" if tp_only_amax_red else "tp-dp-cp", "FP8 amax reduction")
    return _group("tp" if tp_only_amax_red else "tp-dp", "FP8 amax reduction")


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> dist.ProcessGroup | None:
    if with_context_parallel:
        return _group("tp-dp-cp", "tensor and data parallel with context parallel", check_initialized)
    return _group("tp-dp", "tensor and data parallel", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("tp-cp", "tensor and context parallel", check_initialized)


# Sizes and ranks ---------------------------------------------------------------------------


def _set_override(key: str, value: int | None) -> None:
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    _set_override("tp_size", world_size)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _set_override("pp_size", world_size)


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def get_tensor_model_parallel_world_size() -> int:
    if "tp_size" in _OVERRIDES:
        return _OVERRIDES["tp_size"]
    return get_tensor_model_parallel_group().size()


def get_pipeline_model_parallel_world_size() -> int:
    if "pp_size" in _OVERRIDES:
        return _OVERRIDES["pp_size"]
    return get_pipeline_model_parallel_group().size()


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _set_override("tp_rank", rank)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _set_override("pp_rank", rank)


def get_tensor_model_parallel_rank() -> int:
    if "tp_rank" in _OVERRIDES:
        return _OVERRIDES["tp_rank"]
    return get_tensor_model_parallel_group().rank()


def get_pipeline_model_parallel_rank() -> int:
    if "pp_rank" in _OVERRIDES:
        return _OVERRIDES["pp_rank"]
    return dist.get_rank(group=get_pipeline_model_parallel_group())


# Stages ------------------------------------------------------------------------------------


def _vp_stage_required(vp_stage: int | None) -> None:
    _check(
        vp_stage is not None,
        "vp_stage must be passed if virtual pipeline is enabled (ignore_virtual=False with "
        "virtual_pipeline_model_parallel_size set)",
    )


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the first pipeline stage. With ``ignore_virtual=False`` and a
    virtual pipeline, also whether ``vp_stage`` is the first model chunk."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        _vp_stage_required(vp_stage)
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last pipeline stage. With ``ignore_virtual=False`` and a
    virtual pipeline, also whether ``vp_stage`` is the last model chunk (in the V layout the last
    virtual stage is chunk 1 of pipeline rank 0)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        _vp_stage_required(vp_stage)
        if vp_stage != vp_size - 1:
            return False
        if _PIPELINE_MODEL_PARALLEL_LAYOUT == "v":
            return get_pipeline_model_parallel_rank() == 0
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def set_pipeline_model_parallel_layout(layout: str) -> None:
    """Sets which virtual stage each model chunk holds (not in Megatron-core): ``"interleaved"``
    (chunk c of pipeline rank r holds stage ``c * pp + r``, the default) or ``"v"`` (the ZB-V
    schedule's two chunks: stage ``r``, then ``2 pp - 1 - r``, so that pipeline rank 0 holds the
    first and the last stage). Call it after ``initialize_model_parallel`` and before building
    the model; ``"v"`` needs ``virtual_pipeline_model_parallel_size`` 2. For the V layout pass
    ``get_embedding_ranks=lambda ranks: [ranks[0]]`` to ``initialize_model_parallel``: both copies
    of the tied word embedding live on the first pipeline rank."""
    global _PIPELINE_MODEL_PARALLEL_LAYOUT
    if layout not in ("interleaved", "v"):
        raise ValueError(f"the pipeline layout must be 'interleaved' or 'v', got {layout!r}")
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if layout == "v" and vp_size != 2:
        raise ValueError(
            f"the V layout needs virtual_pipeline_model_parallel_size 2 (two model chunks per "
            f"rank), got {vp_size}"
        )
    _PIPELINE_MODEL_PARALLEL_LAYOUT = layout


def get_pipeline_model_parallel_layout() -> str:
    """``"interleaved"`` or ``"v"`` (``set_pipeline_model_parallel_layout``)."""
    return _PIPELINE_MODEL_PARALLEL_LAYOUT


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank holds a copy of the tied word embedding (first or last stage; with
    ``ignore_virtual=False``, in model chunk ``vp_stage``)."""
    ranks = _GROUP_RANKS.get("embd")
    rank = dist.get_rank()
    if ranks is None or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank in (ranks[0], ranks[-1]):
        # In the V layout one rank is both: chunk 0 holds the embedding, chunk 1 the copy.
        return (rank == ranks[0] and is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)) or (
            rank == ranks[-1] and is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
    return True


def get_pipeline_embedding_ranks() -> list[int]:
    """This pipeline's embedding group's ranks, known on every stage (not in Megatron-core)."""
    _group("pp", "pipeline model parallel")
    return list(_GROUP_RANKS["pipeline-embd"])


def is_rank_in_position_embedding_group() -> bool:
    ranks = _GROUP_RANKS.get("pos_embd")
    return ranks is not None and dist.get_rank() in ranks


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated in Megatron-core 0.16: pass ``vp_stage`` to the stage queries instead."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    warnings.warn("set_virtual_pipeline_model_parallel_rank in global scope is deprecated. Pass vp_stage "
                  "explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
                  DeprecationWarning, stacklevel=2)
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's tensor group."""
    return _ranks("tp", "tensor model parallel")[0]


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's model-parallel group."""
    return _ranks("mp", "model parallel")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in this rank's data group."""
    if with_context_parallel:
        return _ranks("dp-cp", "data parallel with context parallel")[0]
    return _ranks("dp", "data parallel")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp", "pipeline model parallel")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp", "pipeline model parallel")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (the first stage follows the last)."""
    ranks = _ranks("pp", "pipeline model parallel")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (the last stage precedes the first)."""
    ranks = _ranks("pp", "pipeline model parallel")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Size of the data-parallel group (0 when torch.distributed is not initialized)."""
    if "dp_size" in _OVERRIDES:
        return _OVERRIDES["dp_size"]
    if not _dist_ready():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).size()


def set_data_parallel_rank(rank: int | None) -> None:
    _set_override("dp_rank", rank)


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """This rank's data-parallel rank (0 when torch.distributed is not initialized)."""
    if "dp_rank" in _OVERRIDES:
        return _OVERRIDES["dp_rank"]
    if not _dist_ready():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).rank()


def get_context_parallel_world_size() -> int:
    return get_context_parallel_group().size() if _dist_ready() else 0


def get_context_parallel_rank() -> int:
    return get_context_parallel_group().rank() if _dist_ready() else 0


def get_tensor_and_context_parallel_world_size() -> int:
    return get_tensor_and_context_parallel_group().size() if _dist_ready() else 0


def get_tensor_and_context_parallel_rank() -> int:
    return get_tensor_and_context_parallel_group().rank() if _dist_ready() else 0


# Expert layout -----------------------------------------------------------------------------


def get_expert_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("ep", "expert model parallel", check_initialized)


def get_expert_model_parallel_src_rank() -> int:
    return _ranks("ep", "expert model parallel")[0]


def get_expert_model_parallel_world_size() -> int:
    if "ep_size" in _OVERRIDES:
        return _OVERRIDES["ep_size"]
    return get_expert_model_parallel_group().size() if _dist_ready() else 0


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    _set_override("ep_size", world_size)


def get_expert_model_parallel_rank() -> int:
    if "ep_rank" in _OVERRIDES:
        return _OVERRIDES["ep_rank"]
    return get_expert_model_parallel_group().rank() if _dist_ready() else 0


def set_expert_model_parallel_rank(rank: int | None) -> None:
    _set_override("ep_rank", rank)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("etp", "expert tensor parallel", check_initialized)


def get_expert_tensor_parallel_world_size() -> int | None:
    """Size of the expert-tensor group; without one, the tensor size set by
    set_tensor_model_parallel_world_size (None if unset), as Megatron-core does."""
    if "etp_size" in _OVERRIDES:
        return _OVERRIDES["etp_size"]
    if "etp" not in _GROUPS:
        return _OVERRIDES.get("tp_size")
    return _GROUPS["etp"].size()


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    _set_override("etp_size", world_size)


def get_expert_tensor_parallel_rank() -> int | None:
    """This rank in the expert-tensor group; without one, the rank set by
    set_tensor_model_parallel_rank (None if unset), as Megatron-core does."""
    if "etp_rank" in _OVERRIDES:
        return _OVERRIDES["etp_rank"]
    if "etp" not in _GROUPS:
        return _OVERRIDES.get("tp_rank")
    return _GROUPS["etp"].rank()


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    _set_override("etp_rank", rank)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    return _group("etp-ep", "expert tensor and model parallel", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return get_expert_tensor_and_model_parallel_group().size() if _dist_ready() else 0


def get_expert_tensor_and_model_parallel_rank() -> int:
    return get_expert_tensor_and_model_parallel_group().rank() if _dist_ready() else 0


def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    return _group("etp-ep-pp", "expert tensor-model-pipeline parallel", check_initialized)


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> dist.ProcessGroup | None:
    if partial_expert_data_parallel:
        return _group("intra-edp", "intra partial expert data parallel", check_initialized)
    return _group("edp", "expert data parallel", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> dist.ProcessGroup:
    """Deprecated name of get_expert_data_parallel_group."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, please use "
                  "get_expert_data_parallel_group instead.", DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> dist.ProcessGroup:
    if partial_expert_data_parallel:
        return _group("intra-edp-gloo", "intra partial expert data parallel gloo")
    return _group("edp-gloo", "expert data parallel gloo")


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    if not _dist_ready():
        return 0
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel).rank()


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    if not _dist_ready():
        return 0
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel).size()


def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """All ranks of one distributed-optimizer instance."""
    return _group("intra-dist-opt", "intra distributed optimizer instance", check_initialized)


def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """The ranks holding the same shard in the different distributed-optimizer instances
    (exists only with num_distributed_optimizer_instances > 1)."""
    return _group("inter-edp", "inter distributed optimizer instance", check_initialized)


# Memory buffers ----------------------------------------------------------------------------


def _set_global_memory_buffer() -> None:
    global _GLOBAL_MEMORY_BUFFER
    _check(_GLOBAL_MEMORY_BUFFER is None, "global memory buffer is already initialized")
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    _check(_GLOBAL_MEMORY_BUFFER is not None, "global memory buffer is not initialized")
    return _GLOBAL_MEMORY_BUFFER


def get_global_symmetric_memory_buffer() -> Any:
    """Megatron-core's symmetric-memory buffer for NVLS inference collectives; megatron_ext
    never creates one, so this raises as Megatron-core does before it is set."""
    _check(_GLOBAL_SYMMETRIC_MEMORY_BUFFER is not None, "global symmetric memory buffer is not initialized")
    return _GLOBAL_SYMMETRIC_MEMORY_BUFFER


def destroy_global_memory_buffer() -> None:
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def destroy_global_symmetric_memory_buffer() -> None:
    global _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    _GLOBAL_SYMMETRIC_MEMORY_BUFFER = None


def get_all_ranks() -> str:
    """``"tp_dp_cp_pp_ep"``: this rank's coordinate in each group, joined by underscores."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(r or 0) for r in ranks)


def destroy_model_parallel() -> None:
    """Destroys the groups created by initialize_model_parallel and resets every setting."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    global _PIPELINE_MODEL_PARALLEL_LAYOUT
    groups: dict[int, Any] = {}
    for value in [*_GROUPS.values(), *_HYBRID_DP_CP_GROUPS.values()]:
        for g in value if isinstance(value, list) else [value]:
            groups[id(g)] = g
    if dist.is_initialized():
        for group in groups.values():
            dist.destroy_process_group(group)
    _GROUPS.clear()
    _GROUP_RANKS.clear()
    _HYBRID_DP_CP_GROUPS.clear()
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
    _PIPELINE_MODEL_PARALLEL_LAYOUT = "interleaved"
    forget_created_groups()
    destroy_global_memory_buffer()
    destroy_global_symmetric_memory_buffer()
