"""``ProcessGroupCollection``: the process groups a model or schedule should use, passed explicitly
instead of read from ``parallel_state`` (Megatron-core's ``megatron.core.process_groups_config``)."""

from __future__ import annotations

from typing import Any

from megatron_ext import parallel_state
from megatron_ext.resolve import DEFAULT_GROUPS, default_group, get_attr_wrapped_model


class ProcessGroupCollectionError(ValueError, AssertionError):
    """A ``pg_collection`` lacks a group its user reads (Megatron-core asserts there, hence also an
    AssertionError)."""


class ProcessGroupCollection:
    """A set of named process groups; a field that was never set is absent (``hasattr`` is False).

    Fields (Megatron-core's): ``tp``, ``pp``, ``mp``, ``embd``, ``pos_embd``, ``cp``, ``tp_cp``,
    ``hcp``, ``ep``, ``expt_tp``, ``tp_ep``, ``tp_ep_pp``, ``tp_dp_cp``, ``dp``, ``dp_cp``,
    ``expt_dp``, ``intra_dp_cp``, ``intra_expt_dp``, ``inter_dist_opt``, ``intra_dist_opt``.
    Set them as keywords or attributes; None stands for a group that is not used. The schedules
    read ``tp``, ``cp``, ``pp``, ``embd``, ``pos_embd`` and ``dp_cp``.
    """

    FIELDS = tuple(DEFAULT_GROUPS)

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if key not in self.FIELDS:
                raise ValueError(f"Unknown attribute: {key} (a ProcessGroupCollection has {self.FIELDS})")
            setattr(self, key, value)

    def __repr__(self) -> str:
        present = []
        for name in self.FIELDS:
            if hasattr(self, name):
                group = getattr(self, name)
                size = "None" if group is None else (len(group) if isinstance(group, list) else group.size())
                present.append(f"{name}({size})")
        return f"ProcessGroupCollection({', '.join(present) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> "ProcessGroupCollection":
        """The groups ``parallel_state`` created: all fields, or only ``required_pgs``. A field
        whose getter this build's parallel_state lacks is left unset unless it was asked for by
        name (then ValueError)."""
        if required_pgs is None:
            names = [n for n in cls.FIELDS if hasattr(parallel_state, DEFAULT_GROUPS[n].name)]
        else:
            invalid = [n for n in required_pgs if n not in cls.FIELDS]
            if invalid:
                raise ValueError(f"Invalid process groups requested: {invalid}")
            names = list(required_pgs)
            missing = [n for n in names if not hasattr(parallel_state, DEFAULT_GROUPS[n].name)]
            if missing:
                raise ValueError(f"parallel_state has no getter for the process groups {missing}")
        return cls(**{name: default_group(name, check_initialized=False) for name in names})

    # The groups DistributedDataParallel and the optimizer use --------------------------------

    @staticmethod
    def setup_process_groups_for_ddp(pg_collection: "ProcessGroupCollection | None", config: Any,
                                     ddp_config: Any) -> dict[str, Any]:
        """The groups a ``DistributedDataParallel`` uses, by key (``dp_group``, ``dp_cp_group``,
        ``intra_dp_cp_group``, ``expt_dp_group``, ``intra_expt_dp_group``, ``tp_group``,
        ``pp_group``, ``ep_group``, ``inter_dist_opt_group``, ``intra_dist_opt_group``): parallel_state's
        without ``pg_collection``; else taken from it, where ``dp`` and ``tp``, ``pp``, ``ep`` are
        required, ``dp_cp`` defaults to ``dp`` without context parallelism, a missing ``expt_dp``
        is None (there are no expert parameters), and several distributed-optimizer instances need
        ``intra_dp_cp``, ``intra_expt_dp`` and ``inter_dist_opt``. ValueError names what is missing."""
        instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
        distributed = bool(getattr(ddp_config, "use_distributed_optimizer", False))
        if pg_collection is None:
            return {
                **_default_data_parallel_groups(),
                "tp_group": default_group("tp"),
                "pp_group": default_group("pp"),
                "ep_group": default_group("ep", check_initialized=False),
                "inter_dist_opt_group": default_group("inter_dist_opt") if instances > 1 else None,
                "intra_dist_opt_group": (default_group("intra_dist_opt", check_initialized=False)
                                         if distributed else None),
            }
        groups = {"dp_group": _required(pg_collection, "dp")}
        groups["dp_cp_group"] = _dp_cp(pg_collection, config, groups["dp_group"])
        # megatron_ext has no expert parameters: a missing expert group stays None (Megatron-core
        # creates a group of this rank alone).
        expt_dp = getattr(pg_collection, "expt_dp", None)
        groups["expt_dp_group"] = expt_dp
        if instances == 1:
            groups.update(intra_dp_cp_group=groups["dp_cp_group"], intra_expt_dp_group=expt_dp,
                          inter_dist_opt_group=None)
        else:
            names = ("intra_dp_cp", "intra_expt_dp", "inter_dist_opt")
            missing = [n for n in names if not hasattr(pg_collection, n)]
            if missing:
                raise ValueError(
                    f"pg_collection lacks {missing}: intra_dp_cp, intra_expt_dp and inter_dist_opt process "
                    f"groups are required with num_distributed_optimizer_instances={instances}"
                )
            groups.update(intra_dp_cp_group=pg_collection.intra_dp_cp,
                          intra_expt_dp_group=pg_collection.intra_expt_dp,
                          inter_dist_opt_group=pg_collection.inter_dist_opt)
        missing = [n for n in ("tp", "pp", "ep") if not hasattr(pg_collection, n)]
        if missing:
            raise ValueError(f"tp, pp and ep process groups are required but pg_collection lacks {missing}")
        groups.update(tp_group=pg_collection.tp, pp_group=pg_collection.pp, ep_group=pg_collection.ep)
        intra_dist_opt = getattr(pg_collection, "intra_dist_opt", None)
        groups["intra_dist_opt_group"] = intra_dist_opt if distributed else None
        return groups

    @staticmethod
    def setup_process_groups_for_optimizer(pg_collection: "ProcessGroupCollection | None", model_chunks: list,
                                           use_gloo_process_groups: bool = True) -> dict[str, Any]:
        """The groups ``get_megatron_optimizer`` uses, by key (``dp_group``, ``dp_cp_group``,
        ``intra_dp_cp_group``, ``expt_dp_group``, ``intra_expt_dp_group``, ``mp_group``,
        ``expt_tp_pp_group``, ``inter_dist_opt_group``, ``intra_dist_opt_group``,
        ``intra_dp_cp_group_gloo``, ``intra_expt_dp_group_gloo``): parallel_state's without
        ``pg_collection``; else from it, where ``dp``, ``expt_dp``, ``mp`` and ``tp_ep_pp`` must be
        present (None allowed, except for ``dp``), ``intra_dist_opt`` too for a distributed
        optimizer, and gloo groups cannot be combined with it. ValueError names what is missing."""
        ddp_config = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
        instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1) if ddp_config else 1
        distributed = bool(getattr(ddp_config, "use_distributed_optimizer", False)) if ddp_config else False
        if pg_collection is None:
            gloo = use_gloo_process_groups
            ps = parallel_state
            return {
                **_default_data_parallel_groups(),
                "mp_group": default_group("mp"),
                "expt_tp_pp_group": default_group("tp_ep_pp", check_initialized=False),
                "inter_dist_opt_group": default_group("inter_dist_opt") if instances > 1 else None,
                "intra_dist_opt_group": default_group("intra_dist_opt", check_initialized=False),
                "intra_dp_cp_group_gloo": (_gloo(ps.get_data_parallel_group_gloo, with_context_parallel=True,
                                                 partial_data_parallel=True) if gloo else None),
                "intra_expt_dp_group_gloo": (_gloo(ps.get_expert_data_parallel_group_gloo,
                                                   partial_expert_data_parallel=True) if gloo else None),
            }
        groups = {"dp_group": _required(pg_collection, "dp")}
        model_config = None
        if model_chunks:
            try:
                model_config = get_attr_wrapped_model(model_chunks[0], "config")
            except AttributeError:
                model_config = None
        groups["dp_cp_group"] = _dp_cp(pg_collection, model_config, groups["dp_group"])
        groups["expt_dp_group"] = _required(pg_collection, "expt_dp", none_allowed=True)
        if ddp_config is None or instances == 1:
            groups.update(
                intra_dp_cp_group=groups["dp_cp_group"],
                intra_expt_dp_group=groups["expt_dp_group"],
                inter_dist_opt_group=None,
            )
        else:
            names = ("intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt")
            missing = [n for n in names if not hasattr(pg_collection, n)]
            if missing:
                raise ValueError(
                    f"pg_collection lacks {missing}: intra_dp_cp, intra_expt_dp, inter_dist_opt and "
                    f"intra_dist_opt are required with num_distributed_optimizer_instances={instances}"
                )
            groups.update(intra_dp_cp_group=pg_collection.intra_dp_cp,
                          intra_expt_dp_group=pg_collection.intra_expt_dp,
                          inter_dist_opt_group=pg_collection.inter_dist_opt)
        groups["intra_dist_opt_group"] = (_required(pg_collection, "intra_dist_opt", none_allowed=True)
                                          if distributed else None)
        groups["mp_group"] = _required(pg_collection, "mp", none_allowed=True)
        groups["expt_tp_pp_group"] = _required(pg_collection, "tp_ep_pp", none_allowed=True)
        if use_gloo_process_groups:
            raise ValueError(
                "Gloo process groups are not supported when pg_collection is provided: pass "
                "use_gloo_process_groups=False"
            )
        groups.update(intra_dp_cp_group_gloo=None, intra_expt_dp_group_gloo=None)
        return groups


def resolve_pg_collection(
    pg_collection: ProcessGroupCollection | None, fields: tuple[str, ...], user: str
) -> ProcessGroupCollection:
    """The groups ``fields`` that ``user`` reads: ``pg_collection``, checked to hold every one of
    them (None stands for a group that is not used), or parallel_state's groups when it is None."""
    if pg_collection is None:
        return ProcessGroupCollection.use_mpu_process_groups(list(fields))
    missing = [f for f in fields if not hasattr(pg_collection, f)]
    if missing:
        raise ProcessGroupCollectionError(
            f"{user}: pg_collection lacks {missing}; it needs {list(fields)} (set a group to None "
            "when there is no such group)"
        )
    return pg_collection


def _default_data_parallel_groups() -> dict[str, Any]:
    """parallel_state's data-parallel groups, by the keys DDP and the optimizer use."""
    return {
        "dp_group": default_group("dp"),
        "dp_cp_group": default_group("dp_cp"),
        "intra_dp_cp_group": default_group("intra_dp_cp"),
        "expt_dp_group": default_group("expt_dp", check_initialized=False),
        "intra_expt_dp_group": default_group("intra_expt_dp", check_initialized=False),
    }


def _required(pg_collection: ProcessGroupCollection, name: str, none_allowed: bool = False) -> Any:
    if not hasattr(pg_collection, name):
        hint = " (set it to None explicitly if you don't need it)" if none_allowed else ""
        raise ValueError(f"{name} process group is required but not provided in pg_collection{hint}")
    return getattr(pg_collection, name)


def _dp_cp(pg_collection: ProcessGroupCollection, config: Any, dp_group: Any) -> Any:
    """``dp_cp``, or ``dp`` itself when there is no context parallelism."""
    if hasattr(pg_collection, "dp_cp"):
        return pg_collection.dp_cp
    cp_size = getattr(config, "context_parallel_size", 1) if config is not None else 1
    if cp_size != 1:
        raise ValueError(
            f"dp_cp process group is required when context_parallel_size is {cp_size} but not provided "
            "in pg_collection"
        )
    return dp_group


def _gloo(getter: Any, **kwargs: Any) -> Any:
    try:
        return getter(**kwargs)
    except parallel_state.ParallelStateError:  # gloo groups were not created
        return None
