"""``ProcessGroupCollection``: the process groups a model or schedule should use, passed explicitly
instead of read from ``parallel_state`` (Megatron-core's ``megatron.core.process_groups_config``)."""

from __future__ import annotations

from typing import Any

from megatron_ext import parallel_state

# Each field and the parallel_state getter (with its keywords) that gives the default group.
_DEFAULT_GETTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "tp": ("get_tensor_model_parallel_group", {"check_initialized": False}),
    "pp": ("get_pipeline_model_parallel_group", {"check_initialized": False}),
    "mp": ("get_model_parallel_group", {"check_initialized": False}),
    "embd": ("get_embedding_group", {"check_initialized": False}),
    "pos_embd": ("get_position_embedding_group", {"check_initialized": False}),
    "cp": ("get_context_parallel_group", {"check_initialized": False}),
    "tp_cp": ("get_tensor_and_context_parallel_group", {"check_initialized": False}),
    "hcp": ("get_hierarchical_context_parallel_groups", {"check_initialized": False}),
    "ep": ("get_expert_model_parallel_group", {"check_initialized": False}),
    "expt_tp": ("get_expert_tensor_parallel_group", {"check_initialized": False}),
    "tp_ep": ("get_expert_tensor_and_model_parallel_group", {"check_initialized": False}),
    "tp_ep_pp": ("get_expert_tensor_model_pipeline_parallel_group", {"check_initialized": False}),
    "tp_dp_cp": (
        "get_tensor_and_data_parallel_group", {"check_initialized": False, "with_context_parallel": True}
    ),
    "dp": ("get_data_parallel_group", {}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "expt_dp": ("get_expert_data_parallel_group", {"check_initialized": False}),
    "intra_dp_cp": (
        "get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}
    ),
    "intra_expt_dp": (
        "get_expert_data_parallel_group",
        {"check_initialized": False, "partial_expert_data_parallel": True},
    ),
    "inter_dist_opt": ("get_inter_distributed_optimizer_instance_group", {"check_initialized": False}),
    "intra_dist_opt": ("get_intra_distributed_optimizer_instance_group", {"check_initialized": False}),
}


class ProcessGroupCollection:
    """A set of named process groups; a field that was never set is absent (``hasattr`` is False).

    Fields (Megatron-core's): ``tp``, ``pp``, ``mp``, ``embd``, ``pos_embd``, ``cp``, ``tp_cp``,
    ``hcp``, ``ep``, ``expt_tp``, ``tp_ep``, ``tp_ep_pp``, ``tp_dp_cp``, ``dp``, ``dp_cp``,
    ``expt_dp``, ``intra_dp_cp``, ``intra_expt_dp``, ``inter_dist_opt``, ``intra_dist_opt``.
    Set them as keywords or attributes; None stands for a group that is not used. The schedules
    read ``tp``, ``cp``, ``pp``, ``embd``, ``pos_embd`` and ``dp_cp``.
    """

    FIELDS = tuple(_DEFAULT_GETTERS)

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
            names = [n for n in cls.FIELDS if hasattr(parallel_state, _DEFAULT_GETTERS[n][0])]
        else:
            invalid = [n for n in required_pgs if n not in cls.FIELDS]
            if invalid:
                raise ValueError(f"Invalid process groups requested: {invalid}")
            names = list(required_pgs)
            missing = [n for n in names if not hasattr(parallel_state, _DEFAULT_GETTERS[n][0])]
            if missing:
                raise ValueError(f"parallel_state has no getter for the process groups {missing}")
        groups = {}
        for name in names:
            getter, kwargs = _DEFAULT_GETTERS[name]
            groups[name] = getattr(parallel_state, getter)(**kwargs)
        return cls(**groups)
