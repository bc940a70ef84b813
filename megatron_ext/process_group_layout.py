"""How the process groups of model parallelism are laid out and created: the rank layout
(``RankGenerator``: which ranks form each group of a kind, Megatron-core's order), NCCL options
per group, and group creation (every rank takes part in every ``new_group``). parallel_state
builds its groups with these and re-exports them under Megatron-core's names."""

from __future__ import annotations

import math
from datetime import timedelta
from dataclasses import dataclass
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


# Every group created by create_group that this rank belongs to (None: the default group), for
# update_pg_timeout.
_global_process_group_list: list[dist.ProcessGroup | None] | None = None


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


def forget_created_groups() -> None:
    """Forgets the groups create_group remembered (parallel_state.destroy_model_parallel)."""
    global _global_process_group_list
    _global_process_group_list = None


@dataclass
class GroupKind:
    """One kind of group in ``create_model_parallel_groups``' table: its name (parallel_state's key),
    one rank list per group, the name of its NCCL options, whether a gloo twin is made, its
    backend; ``each(ranks)`` makes the groups that go with each rank list, ``after()`` what follows
    them all."""

    name: str
    rank_lists: list[list[int]]
    nccl_options: str | None
    gloo: bool = False
    backend: str | None = None
    each: Callable[[list[int]], None] | None = None
    after: Callable[[], None] | None = None


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


def _require_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RuntimeError(f"{name} must be an integer >= 1, got {value!r}")


def create_model_parallel_groups(
    groups: dict[str, Any],
    group_ranks: dict[str, list[int]],
    hybrid_groups: dict[int, dist.ProcessGroup],
    *,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None,
    pipeline_model_parallel_comm_backend: str | None,
    use_sharp: bool,
    context_parallel_size: int,
    hierarchical_context_parallel_sizes: list[int] | None,
    hybrid_context_parallel: bool,
    expert_model_parallel_size: int,
    num_distributed_optimizer_instances: int,
    expert_tensor_parallel_size: int | None,
    nccl_communicator_config_path: str | None,
    distributed_timeout_minutes: int,
    order: str,
    get_embedding_ranks: Callable[[list[int]], list[int]] | None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None,
    create_gloo_process_groups: bool,
    high_priority_stream_groups: list[str] | None,
    sharp_enabled_group: str | None,
    create_all_gather_group: bool | None,
) -> None:
    """``parallel_state.initialize_model_parallel``'s work (its arguments, by name): checks the sizes,
    then creates every group of every kind, keeping this rank's in ``groups`` / ``group_ranks``
    (by kind) and ``hybrid_groups`` (by size)."""
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
                groups[kind] = group
                group_ranks[kind] = list(ranks)
                if group_gloo is not None:
                    groups[kind + "-gloo"] = group_gloo

    def alias(kind: str, source: str) -> None:
        if source in groups:
            groups[kind] = groups[source]

    intra_dp_cp = data_parallel_size * context_parallel_size // num_distributed_optimizer_instances

    def data_context_extras(ranks: list[int]) -> None:
        if create_all_gather_group:
            make("dp-cp-ag", [ranks], "dp_cp")
        if num_distributed_optimizer_instances > 1:
            parts = [
                ranks[i * intra_dp_cp : (i + 1) * intra_dp_cp]
                for i in range(num_distributed_optimizer_instances)
            ]
            make("intra-dp-cp", parts, "intra_dp_cp", gloo=True)

    def data_context_after() -> None:
        if num_distributed_optimizer_instances == 1:
            alias("intra-dp-cp", "dp-cp")
            alias("intra-dp-cp-gloo", "dp-cp-gloo")
        if hybrid_context_parallel:
            for ranks in dense.get_ranks("dp-cp"):
                if len(ranks) % 2 != 0:
                    raise RuntimeError(
                        "hybrid_context_parallel needs an even number of data x context ranks, got "
                        f"{len(ranks)}"
                    )
                hybrid_groups.update(create_hybrid_dp_cp_groups(rank, ranks, options("dp_cp")))

    def context_extras(ranks: list[int]) -> None:
        if hierarchical_context_parallel_sizes:
            hierarchical, _ = create_hierarchical_groups(
                rank,
                ranks,
                hierarchical_context_parallel_sizes,
                pg_options=options("hcp"),
                timeout=timeout,
                group_desc="CONTEXT_PARALLEL_GROUP",
            )
            if rank in ranks:
                groups["hcp"] = hierarchical

    embedding_ranks = get_embedding_ranks or default_embedding_ranks
    position_ranks = get_position_embedding_ranks or default_position_embedding_ranks

    def embedding_groups(ranks: list[int]) -> None:
        # Every rank takes part in every new_group call, including the duplicates some layouts
        # produce (pp=1: each pipeline "group" is one rank).
        make("embd", [embedding_ranks(ranks)], "embd")
        make("pos_embd", [position_ranks(ranks)], "pos_embd")
        if rank in ranks:
            # Every stage, member or not, learns who holds the embedding without communicating.
            group_ranks["pipeline-embd"] = list(embedding_ranks(ranks))

    intra_edp = expert_data_parallel_size // num_distributed_optimizer_instances

    def expert_data_extras(ranks: list[int]) -> None:
        if num_distributed_optimizer_instances > 1:
            hierarchical, hierarchical_gloo = create_hierarchical_groups(
                rank,
                ranks,
                [intra_edp, num_distributed_optimizer_instances],
                create_gloo_process_groups=create_gloo_process_groups,
                pg_options=[options("intra_ep_dp"), options("inter_ep_dp")],
                timeout=timeout,
                group_desc="EXPERT_DATA_PARALLEL_GROUP",
            )
            if rank in ranks:
                groups["intra-edp"], groups["inter-edp"] = hierarchical
                if hierarchical_gloo[0] is not None:
                    groups["intra-edp-gloo"] = hierarchical_gloo[0]

    def expert_data_after() -> None:
        if num_distributed_optimizer_instances == 1:
            alias("intra-edp", "edp")
            alias("intra-edp-gloo", "edp-gloo")

    # A distributed-optimizer instance: intra_edp consecutive expert model-parallel groups.
    model_groups = expert.get_ranks("tp-ep-pp")
    instances = [
        [r for g in model_groups[i : i + intra_edp] for r in g]
        for i in range(0, len(model_groups), intra_edp)
    ]
    pp_options_name = None if pipeline_model_parallel_comm_backend == "ucc" else "pp"

    # Every group kind in Megatron-core's creation order (the data x context groups first: SHARP
    # may only use the first group): its rank lists, NCCL options name, gloo twin, backend, the
    # groups made with each of its rank lists, and what follows all of them.
    table: list[GroupKind] = [
        GroupKind("dp-cp", dense.get_ranks("dp-cp"), "dp_cp", True, each=data_context_extras,
                  after=data_context_after),
        GroupKind("dp", dense.get_ranks("dp"), "dp", True),
        GroupKind("cp", dense.get_ranks("cp"), "cp", each=context_extras),
        GroupKind("mp", dense.get_ranks("tp-pp"), "mp"),
        GroupKind("tp", dense.get_ranks("tp"), "tp"),
        GroupKind("pp", dense.get_ranks("pp"), pp_options_name, backend=pipeline_model_parallel_comm_backend,
                  each=embedding_groups),
        GroupKind("tp-dp-cp", dense.get_ranks("tp-dp-cp"), "tp_dp_cp"),
        GroupKind("tp-dp", dense.get_ranks("tp-dp"), "tp_dp"),
        GroupKind("tp-cp", dense.get_ranks("tp-cp"), "tp_cp"),
        GroupKind("ep", expert.get_ranks("ep"), "ep"),
        GroupKind("etp", expert.get_ranks("tp"), "ep_tp"),
        GroupKind("etp-ep", expert.get_ranks("tp-ep"), "tp_ep_mp"),
        GroupKind("etp-ep-pp", expert.get_ranks("tp-ep-pp"), "tp_ep_pp"),
        GroupKind("edp", expert.get_ranks("dp"), "ep_dp", True, each=expert_data_extras,
                  after=expert_data_after),
        GroupKind("intra-dist-opt", instances, "intra_dist_opt_instance"),
    ]
    for kind in table:
        for ranks in kind.rank_lists:
            make(kind.name, [ranks], kind.nccl_options, gloo=kind.gloo, backend=kind.backend)
            if kind.each is not None:
                kind.each(ranks)
        if kind.after is not None:
            kind.after()
