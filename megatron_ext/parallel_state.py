"""Process groups of model parallelism, laid out as Megatron-core lays them out.

Ranks are numbered along ``order`` (default ``"tp-cp-ep-dp-pp"``) with the first dimension
varying fastest: world 8, tp 2, pp 2 gives tensor groups [0,1][2,3][4,5][6,7], data groups
[0,2][1,3][4,6][5,7] and pipeline groups [0,4][1,5][2,6][3,7]. The expert layers get their own
layout over (expert-tensor, expert, expert-data, pipeline) sizes with the same order; both share
the pipeline groups. Every rank creates every group (``torch.distributed.new_group`` is
collective) and keeps the ones it belongs to.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import reported


class ParallelStateError(RuntimeError, AssertionError):
    """A parallel-state precondition failed (e.g. a group is not initialized).

    Megatron-core reports these with ``assert``; this class is an ``AssertionError`` too, so code
    written against it (``except AssertionError``) keeps working.
    """


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ParallelStateError(message)


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

# Every group created by create_group that this rank belongs to (None: the default group), for
# update_pg_timeout.
_global_process_group_list: list[dist.ProcessGroup | None] | None = None


class GlobalMemoryBuffer:
    """Named scratch buffers reused across calls so that a hot loop does not allocate.

    ``get_tensor(shape, dtype, name)`` returns a view of the buffer ``(name, dtype)``, grown when
    too small; callers must not use two tensors of the same name at once.
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: tuple[int, ...] | list[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable | None = None,
    ) -> torch.Tensor:
        numel = math.prod(tensor_shape)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            if mem_alloc_context is None:
                self.buffer[key] = torch.empty(numel, dtype=dtype, device=device)
            else:
                with mem_alloc_context():
                    self.buffer[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.buffer[key][:numel].view(*tensor_shape)


# Rank layout -------------------------------------------------------------------------------


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """All groups of ranks that differ only along the dimensions where ``mask`` is True.

    ``parallel_size`` lists the size of each dimension in rank order (the first varies fastest in
    the global rank). Groups are enumerated with the unmasked coordinates first-fastest, and ranks
    inside a group with the masked coordinates first-fastest, which is Megatron-core's order.
    """
    _check(len(parallel_size) == len(mask), f"parallel_size {parallel_size} and mask {mask} differ in length")
    _check(
        math.prod(parallel_size) == world_size,
        f"the product of parallel_size {parallel_size} is not the world size {world_size}",
    )
    strides = [math.prod(parallel_size[:i]) for i in range(len(parallel_size))]
    inner = [(s, st) for s, st, m in zip(parallel_size, strides, mask) if m]
    outer = [(s, st) for s, st, m in zip(parallel_size, strides, mask) if not m]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        # The offset of every coordinate tuple, first dimension fastest.
        result = [0]
        for size, stride in dims:
            result = [base + stride * i for i in range(size) for base in result]
        return result

    inside = offsets(inner)
    return [[base + off for off in inside] for base in offsets(outer)]


class RankGenerator:
    """Rank groups of one layout: sizes ``tp, ep, dp, pp, cp`` numbered along ``order``.

    Dimensions of size 1 may be left out of ``order`` (they are appended). ``get_ranks("tp-dp")``
    returns every group of ranks that differ only in their tensor and data coordinates.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        _check(
            ep == 1 or cp == 1,
            f"a RankGenerator takes ep > 1 or cp > 1, not both (got ep={ep}, cp={cp}): context "
            "parallelism belongs to the dense layout, expert parallelism to the expert layout",
        )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in self.name_to_size]
        if unknown or len(set(tokens)) != len(tokens):
            raise RuntimeError(
                f"order {order!r} must name each of tp, cp, ep, dp, pp at most once, separated by '-'"
            )
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise RuntimeError(f"the size of {name} is {size}, but order {order!r} does not place it")
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """For each dimension of ``order``, whether ``token`` (e.g. ``"tp-dp"``) names it."""
        ordered = order.split("-")
        wanted = token.split("-")
        unknown = [t for t in wanted if t not in ordered]
        if unknown:
            raise ValueError(f"token {token!r} names {unknown}, which are not in order {order!r}")
        return [t in wanted for t in ordered]

    def get_ranks(self, token: str) -> list[list[int]]:
        """The rank groups spanning the dimensions of ``token`` (e.g. ``"tp"``, ``"dp-cp"``)."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in g] for g in groups]


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The stages holding the word embedding: the first and the last."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The stages holding the position embedding: the first."""
    return [pp_ranks[0]]


# Group creation ----------------------------------------------------------------------------


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict) -> Any:
    """NCCL options for the group ``pg_name`` from ``nccl_comm_cfgs`` (None when it has none)."""
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and str(cfg["net_name"]).lower() not in ("ib", "socket"):
        raise RuntimeError(
            f"net_name ({cfg['net_name']}) is not supported. Accepted values: 'IB' or 'socket'."
        )
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: dict, pg_name: str, key_value_pair: tuple[str, Any]) -> None:
    """Sets ``nccl_comm_cfgs[pg_name][key] = value``."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


def create_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> dist.ProcessGroup:
    """``torch.distributed.new_group`` that remembers the group for update_pg_timeout."""
    global _global_process_group_list
    group = dist.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if _global_process_group_list is None:
        _global_process_group_list = [None]
    if ranks is None or dist.get_rank() in ranks:
        _global_process_group_list.append(group)
    return group


def update_pg_timeout(timeout: timedelta, pg: dist.ProcessGroup | None = None) -> None:
    """Sets the timeout of ``pg``, or of every group created here when ``pg`` is None."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return
    with reported("barrier before a timeout change", pg):
        dist.barrier(pg)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    groups = [pg] if pg is not None else (_global_process_group_list or [None])
    for group in groups:
        setter(timeout, group)


def create_hierarchical_groups(
    rank: int,
    ranks: list[int],
    hierarchical_group_sizes: list[int],
    create_gloo_process_groups: bool = False,
    pg_options: Any = None,
    timeout: timedelta | None = None,
    group_desc: str | None = None,
) -> tuple[list[dist.ProcessGroup], list[dist.ProcessGroup | None]]:
    """Splits ``ranks`` into levels: sizes [2, 2, 4] over 16 ranks give level-0 groups [0,1]...,
    level-1 groups [0,2][1,3][4,6]..., level-2 groups [0,4,8,12]...; returns this rank's group at
    each level (and its gloo twin, or None)."""
    _check(
        math.prod(hierarchical_group_sizes) == len(ranks),
        f"hierarchical group sizes {hierarchical_group_sizes} do not multiply to the {len(ranks)} ranks "
        f"{ranks}",
    )
    if not isinstance(pg_options, list):
        pg_options = [pg_options] * len(hierarchical_group_sizes)
    groups, groups_gloo = [], []
    for level, size in enumerate(hierarchical_group_sizes):
        inner = math.prod(hierarchical_group_sizes[:level])
        outer = math.prod(hierarchical_group_sizes[level + 1 :])
        # ranks viewed as [outer][size][inner]; a group varies the middle index.
        for o in range(outer):
            for i in range(inner):
                sub = [ranks[(o * size + s) * inner + i] for s in range(size)]
                group = create_group(
                    sub,
                    timeout=timeout,
                    pg_options=pg_options[level],
                    group_desc=f"HIERARCHICAL_{group_desc}_L{level}",
                )
                group_gloo = (
                    _gloo_twin(group, sub, timeout, f"HIERARCHICAL_{group_desc}_GLOO_L{level}")
                    if create_gloo_process_groups
                    else None
                )
                if rank in sub:
                    groups.append(group)
                    groups_gloo.append(group_gloo)
    return groups, groups_gloo


def create_hybrid_dp_cp_groups(rank: int, ranks: list[int], pg_options: Any) -> dict[int, dist.ProcessGroup]:
    """Groups of consecutive ``ranks`` of every power-of-two size from 2 up to half of them; this
    rank's group by size."""
    result: dict[int, dist.ProcessGroup] = {}
    sizes = [2**i for i in range(1, int(math.log2(len(ranks))))]
    for size in sizes:
        for start in range(0, len(ranks), size):
            sub = ranks[start : start + size]
            group = create_group(sub, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}")
            if rank in sub:
                result[size] = group
    return result


def _gloo_twin(group: Any, ranks: list[int], timeout: timedelta | None, group_desc: str | None) -> Any:
    # Under a gloo default backend the group already is a gloo group: return it rather than a copy.
    if dist.get_backend() == "gloo":
        return group
    return create_group(ranks, timeout=timeout, backend="gloo", group_desc=group_desc)


# Megatron-core's descriptions of the groups (``group.group_desc``; NCCL's logs and
# megatron_ext.comm_errors' messages name a group by it), by the kind of group.
_GROUP_DESCS = {
    "dp-cp": "DATA_PARALLEL_GROUP_WITH_CP",
    "dp-cp-ag": "DATA_PARALLEL_GROUP_WITH_CP_AG",
    "intra-dp-cp": "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "dp": "DATA_PARALLEL_GROUP",
    "cp": "CONTEXT_PARALLEL_GROUP",
    "mp": "MODEL_PARALLEL_GROUP",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "embd": "EMBEDDING_GROUP",
    "pos_embd": "POSITION_EMBEDDING_GROUP",
    "tp-dp-cp": "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    "tp-dp": "TENSOR_AND_DATA_PARALLEL_GROUP",
    "tp-cp": "TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "ep": "EXPERT_MODEL_PARALLEL_GROUP",
    "etp": "EXPERT_TENSOR_PARALLEL_GROUP",
    "etp-ep": "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    "etp-ep-pp": "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    "edp": "EXPERT_DATA_PARALLEL_GROUP",
    "intra-dist-opt": "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
}


def _require_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RuntimeError(f"{name} must be an integer >= 1, got {value!r}")


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
    for name, value in (
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("num_distributed_optimizer_instances", num_distributed_optimizer_instances),
    ):
        _require_positive(name, value)
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    _require_positive("expert_tensor_parallel_size", expert_tensor_parallel_size)
    if use_sharp:
        raise RuntimeError(
            "use_sharp=True is not supported: megatron_ext does not set up NCCL SHARP (CollNet)"
        )
    _check(sharp_enabled_group is None, "sharp_enabled_group is only valid when use_sharp is True")
    if pipeline_model_parallel_comm_backend not in (None, "nccl", "ucc", "gloo"):
        raise RuntimeError(
            f'"{pipeline_model_parallel_comm_backend}" backend for PP communication is not supported; '
            "expected None, 'nccl', 'ucc' or 'gloo'"
        )
    if pipeline_model_parallel_comm_backend == "gloo" and "nccl" in str(dist.get_backend()):
        raise ParallelStateError(
            "pipeline_model_parallel_comm_backend='gloo' in a job whose default backend is "
            f"{dist.get_backend()!r}: the stages would send CUDA activations over gloo; expected None, "
            "'nccl' or 'ucc' ('gloo' is for CPU jobs)"
        )

    world_size = dist.get_world_size()
    rank = dist.get_rank()
    model_size = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_size != 0:
        raise RuntimeError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) x context_parallel_size ({context_parallel_size}) = "
            f"{model_size}"
        )
    data_parallel_size = world_size // model_size
    if virtual_pipeline_model_parallel_size is not None:
        _require_positive("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
        if pipeline_model_parallel_size == 1:
            raise RuntimeError(
                f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
                "pipeline_model_parallel_size > 1, got 1 (the interleaved schedule needs a pipeline)"
            )
    expert_model_size = (
        expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size
    )
    if world_size % expert_model_size != 0:
        raise RuntimeError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size "
            f"({expert_tensor_parallel_size}) x expert_model_parallel_size ({expert_model_parallel_size}) "
            f"x pipeline_model_parallel_size ({pipeline_model_parallel_size}) = {expert_model_size}"
        )
    expert_data_parallel_size = world_size // expert_model_size
    if (
        hierarchical_context_parallel_sizes
        and math.prod(hierarchical_context_parallel_sizes) != context_parallel_size
    ):
        raise RuntimeError(
            f"hierarchical_context_parallel_sizes {hierarchical_context_parallel_sizes} must multiply to "
            f"context_parallel_size ({context_parallel_size})"
        )
    for what, size in (
        ("data x context", data_parallel_size * context_parallel_size),
        ("expert data", expert_data_parallel_size),
    ):
        if size % num_distributed_optimizer_instances != 0:
            raise RuntimeError(
                f"the {what} parallel size ({size}) is not divisible by "
                f"num_distributed_optimizer_instances ({num_distributed_optimizer_instances})"
            )

    dense = RankGenerator(
        tp=tensor_model_parallel_size,
        ep=1,
        dp=data_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        order=order,
    )
    expert = RankGenerator(
        tp=expert_tensor_parallel_size,
        ep=expert_model_parallel_size,
        dp=expert_data_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=1,
        order=order,
    )
    if not (
        order.endswith("pp")
        or pipeline_model_parallel_size == 1
        or expert_data_parallel_size == data_parallel_size
    ):
        raise RuntimeError(
            f"with order {order!r} (pp not last) the data-parallel sizes of the dense ({data_parallel_size}) "
            f"and expert ({expert_data_parallel_size}) layers must be equal"
        )
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise RuntimeError(
            f"the pipeline groups of the dense layout {dense.get_ranks('pp')} and of the expert layout "
            f"{expert.get_ranks('pp')} differ; choose sizes and an order under which they agree"
        )

    nccl_comm_cfgs: dict = {}
    if nccl_communicator_config_path is not None:
        try:
            import yaml
        except ImportError as e:
            raise RuntimeError(
                "nccl_communicator_config_path needs the yaml package (pip install pyyaml)"
            ) from e
        with open(nccl_communicator_config_path) as stream:
            nccl_comm_cfgs = yaml.safe_load(stream) or {}
    for pg_name in high_priority_stream_groups or []:
        overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, ("is_high_priority_stream", True))
    if nccl_comm_cfgs and dist.get_backend() != "nccl":
        raise RuntimeError(
            f"NCCL communicator settings (nccl_communicator_config_path / high_priority_stream_groups) "
            f"need the nccl backend, but the default process group uses {dist.get_backend()!r}"
        )

    timeout = timedelta(minutes=distributed_timeout_minutes)

    def options(name: str) -> Any:
        return get_nccl_options(name, nccl_comm_cfgs)

    def make(
        kind: str,
        rank_lists: list[list[int]],
        pg_name: str | None,
        gloo: bool = False,
        backend: str | None = None,
    ) -> None:
        """Creates one group per rank list; keeps this rank's under ``kind`` (and its gloo twin)."""
        pg_options = None if pg_name is None else options(pg_name)
        desc = _GROUP_DESCS[kind]
        for ranks in rank_lists:
            group = create_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                                 group_desc=desc)
            twin = gloo and create_gloo_process_groups
            group_gloo = _gloo_twin(group, ranks, timeout, desc + "_GLOO") if twin else None
            if rank in ranks:
                _GROUPS[kind] = group
                _GROUP_RANKS[kind] = list(ranks)
                if group_gloo is not None:
                    _GROUPS[kind + "-gloo"] = group_gloo

    # Megatron-core creates the data x context groups first (SHARP may only use the first group).
    intra_dp_cp = data_parallel_size * context_parallel_size // num_distributed_optimizer_instances
    for ranks in dense.get_ranks("dp-cp"):
        make("dp-cp", [ranks], "dp_cp", gloo=True)
        if create_all_gather_group:
            make("dp-cp-ag", [ranks], "dp_cp")
        if num_distributed_optimizer_instances > 1:
            parts = [
                ranks[i * intra_dp_cp : (i + 1) * intra_dp_cp]
                for i in range(num_distributed_optimizer_instances)
            ]
            make("intra-dp-cp", parts, "intra_dp_cp", gloo=True)
    if num_distributed_optimizer_instances == 1:
        _alias("intra-dp-cp", "dp-cp")
        _alias("intra-dp-cp-gloo", "dp-cp-gloo")

    if hybrid_context_parallel:
        for ranks in dense.get_ranks("dp-cp"):
            if len(ranks) % 2 != 0:
                raise RuntimeError(
                    f"hybrid_context_parallel needs an even number of data x context ranks, got {len(ranks)}"
                )
            _HYBRID_DP_CP_GROUPS.update(create_hybrid_dp_cp_groups(rank, ranks, options("dp_cp")))

    make("dp", dense.get_ranks("dp"), "dp", gloo=True)
    for ranks in dense.get_ranks("cp"):
        make("cp", [ranks], "cp")
        if hierarchical_context_parallel_sizes:
            groups, _ = create_hierarchical_groups(
                rank,
                ranks,
                hierarchical_context_parallel_sizes,
                pg_options=options("hcp"),
                timeout=timeout,
                group_desc="CONTEXT_PARALLEL_GROUP",
            )
            if rank in ranks:
                _GROUPS["hcp"] = groups
    make("mp", dense.get_ranks("tp-pp"), "mp")
    make("tp", dense.get_ranks("tp"), "tp")

    embedding_ranks = get_embedding_ranks or default_embedding_ranks
    position_ranks = get_position_embedding_ranks or default_position_embedding_ranks
    for ranks in dense.get_ranks("pp"):
        pp_options_name = None if pipeline_model_parallel_comm_backend == "ucc" else "pp"
        make("pp", [ranks], pp_options_name, backend=pipeline_model_parallel_comm_backend)
        # Every rank takes part in every new_group call, including the duplicates some layouts
        # produce (pp=1: each pipeline "group" is one rank).
        make("embd", [embedding_ranks(ranks)], "embd")
        make("pos_embd", [position_ranks(ranks)], "pos_embd")

    make("tp-dp-cp", dense.get_ranks("tp-dp-cp"), "tp_dp_cp")
    make("tp-dp", dense.get_ranks("tp-dp"), "tp_dp")
    make("tp-cp", dense.get_ranks("tp-cp"), "tp_cp")

    make("ep", expert.get_ranks("ep"), "ep")
    make("etp", expert.get_ranks("tp"), "ep_tp")
    make("etp-ep", expert.get_ranks("tp-ep"), "tp_ep_mp")
    make("etp-ep-pp", expert.get_ranks("tp-ep-pp"), "tp_ep_pp")
    intra_edp = expert_data_parallel_size // num_distributed_optimizer_instances
    for ranks in expert.get_ranks("dp"):
        make("edp", [ranks], "ep_dp", gloo=True)
        if num_distributed_optimizer_instances > 1:
            groups, groups_gloo = create_hierarchical_groups(
                rank,
                ranks,
                [intra_edp, num_distributed_optimizer_instances],
                create_gloo_process_groups=create_gloo_process_groups,
                pg_options=[options("intra_ep_dp"), options("inter_ep_dp")],
                timeout=timeout,
                group_desc="EXPERT_DATA_PARALLEL_GROUP",
            )
            if rank in ranks:
                _GROUPS["intra-edp"], _GROUPS["inter-edp"] = groups
                if groups_gloo[0] is not None:
                    _GROUPS["intra-edp-gloo"] = groups_gloo[0]
    if num_distributed_optimizer_instances == 1:
        _alias("intra-edp", "edp")
        _alias("intra-edp-gloo", "edp-gloo")

    # A distributed-optimizer instance: intra_edp consecutive expert model-parallel groups.
    model_groups = expert.get_ranks("tp-ep-pp")
    instances = [
        [r for g in model_groups[i : i + intra_edp] for r in g]
        for i in range(0, len(model_groups), intra_edp)
    ]
    make("intra-dist-opt", instances, "intra_dist_opt_instance")

    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _set_global_memory_buffer()


def _alias(kind: str, source: str) -> None:
    if source in _GROUPS:
        _GROUPS[kind] = _GROUPS[source]
        if source in _GROUP_RANKS:
            _GROUP_RANKS[kind] = _GROUP_RANKS[source]


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


# Megatron-core keeps each group in a module global; code that reads one (its own tests do) gets
# the group, or None before initialize_model_parallel, from these names.
_GLOBAL_NAMES = {
    **{f"_{desc}": kind for kind, desc in _GROUP_DESCS.items()},
    **{f"_{desc}_GLOO": f"{kind}-gloo" for kind, desc in _GROUP_DESCS.items()},
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra-edp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "intra-edp-gloo",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter-edp",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": "hcp",
}
_GLOBAL_RANK_NAMES = {
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp-cp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
}


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


def is_rank_in_position_embedding_group() -> bool:
    ranks = _GROUP_RANKS.get("pos_embd")
    return ranks is not None and dist.get_rank() in ranks


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated in Megatron-core 0.16: pass ``vp_stage`` to the stage queries instead."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. Pass vp_stage "
        "explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
        stacklevel=2,
    )
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
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group "
        "instead.",
        DeprecationWarning,
        stacklevel=2,
    )
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
    global _global_process_group_list, _PIPELINE_MODEL_PARALLEL_LAYOUT
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
    _global_process_group_list = None
    destroy_global_memory_buffer()
    destroy_global_symmetric_memory_buffer()
