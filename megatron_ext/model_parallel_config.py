"""The configuration read by the tensor-parallel layers and the pipeline schedules.

Every field of Megatron-core 0.16.1's ``ModelParallelConfig``, with its name, default and place in
the positional order, plus ``hidden_size`` at the end (Megatron-core keeps it on
``TransformerConfig``; the schedules read it). A field whose feature megatron_ext does not
implement is accepted at its default and raises ``NotImplementedError`` naming it when set to
anything else, so nothing is silently ignored; a misspelt field raises ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def refuse_unimplemented(config: Any, unimplemented: dict[str, str]) -> None:
    """Raises NotImplementedError for the first field of ``unimplemented`` (name -> what it needs)
    whose value differs from its dataclass default."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name, why in unimplemented.items():
        default = _default(fields[name])
        value = getattr(config, name)
        if value is not default and value != default:
            raise NotImplementedError(
                f"{type(config).__name__}.{name}={value!r} is not supported ({why}); leave it at its "
                f"default {default!r}"
            )


# Fields megatron_ext does not implement, each with the feature it belongs to.
_UNIMPLEMENTED = {
    "hierarchical_context_parallel_sizes": "context-parallel attention",
    "max_seqlen_per_dp_cp_rank": "hybrid context parallelism",
    "hybrid_context_parallel": "hybrid context parallelism",
    "moe_extended_tp": "mixture-of-experts layers",
    "enable_autocast": "autocast in the schedules' forward step",
    "tp_comm_overlap": "TransformerEngine userbuffer communication overlap",
    "overlap_moe_expert_parallel_comm": "mixture-of-experts layers",
    "delay_wgrad_compute": "deferred weight-gradient computation",
    "ep_overlap_early_attn_memory_release": "mixture-of-experts layers",
    "use_ring_exchange_p2p": "ring-exchange p2p communication",
    "wgrad_deferral_limit": "deferred weight-gradient computation",
    "overlap_p2p_comm_warmup_flush": "overlapped p2p in warm-up and flush",
    "mtp_standalone": "multi-token prediction",
    "cpu_offloading": "activation CPU offloading",
    "cpu_offloading_num_layers": "activation CPU offloading",
    "_cpu_offloading_context": "activation CPU offloading",
    "cpu_offloading_weights": "activation CPU offloading",
    "cpu_offloading_double_buffering": "activation CPU offloading",
}


@dataclass
class ModelParallelConfig:
    """Settings shared by the parallel layers and schedules.

    ``sequence_parallel=True`` with ``tensor_model_parallel_size == 1`` is accepted (Megatron-core
    raises): sequence parallelism over one rank is the identity, so the layers simply run without
    it. That lets one config serve every TP size of a sweep.
    """

    # Model parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_comm_backend: str | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: list[int] | None = None
    max_seqlen_per_dp_cp_rank: int | None = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_extended_tp: bool = False

    # Initialisation
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # Training
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Callable | None = None
    finalize_model_grads_func: Callable | None = None
    grad_scale_func: Callable | None = None
    no_sync_func: Callable[[], AbstractContextManager] | None = None
    grad_sync_func: Callable | None = None
    param_sync_func: Callable | None = None
    deterministic_mode: bool = False
    enable_autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    num_microbatches_with_partial_activation_checkpoints: int | None = None

    # Optimisations
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = True
    use_te_rng_tracker: bool = False
    tp_comm_overlap: bool = False
    tp_comm_bulk_wgrad: bool = True
    tp_comm_bulk_dgrad: bool = True
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_split_ag: bool = True
    tp_comm_atomic_ag: bool = False
    tp_comm_split_rs: bool = True
    tp_comm_atomic_rs: bool = False
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    tp_comm_overlap_disable_qkv: bool = False
    tp_comm_overlap_disable_fc1: bool = False
    tp_comm_bootstrap_backend: str = "nccl"
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    ep_overlap_early_attn_memory_release: bool = False

    # Pipeline parallelism
    pipeline_dtype: torch.dtype | None = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: int | None = None
    mtp_standalone: bool = False

    # CPU offloading
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    _cpu_offloading_context: AbstractContextManager | None = None
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False

    # Timing
    barrier_with_L1_time: bool = True

    # Model shape (Megatron-core: TransformerConfig)
    hidden_size: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.params_dtype, torch.dtype):
            raise TypeError(
                f"ModelParallelConfig.params_dtype must be a torch.dtype, got {self.params_dtype!r}"
            )
        if self.fp16 and self.bf16:
            raise ValueError("ModelParallelConfig: fp16 and bf16 cannot both be True")
        refuse_unimplemented(self, _UNIMPLEMENTED)
        if self.pipeline_model_parallel_comm_backend not in (None, "nccl", "ucc"):
            raise ValueError(
                "ModelParallelConfig.pipeline_model_parallel_comm_backend must be None, 'nccl' or 'ucc', "
                f"got {self.pipeline_model_parallel_comm_backend!r}"
            )
        if self.cross_entropy_fusion_impl not in ("native", "te"):
            raise ValueError(
                "ModelParallelConfig.cross_entropy_fusion_impl must be 'native' or 'te', "
                f"got {self.cross_entropy_fusion_impl!r}"
            )
        if self.cross_entropy_fusion_impl == "te":
            raise NotImplementedError(
                "ModelParallelConfig.cross_entropy_fusion_impl='te' is not supported (TransformerEngine); "
                "the 'native' fused cross-entropy is megatron_ext's C++ op"
            )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                "ModelParallelConfig.pipeline_dtype is required when pipeline_model_parallel_size "
                f"is {self.pipeline_model_parallel_size}: it is the dtype of the tensors sent between "
                "stages (usually params_dtype)"
            )
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.defer_embedding_wgrad_compute and self.pipeline_model_parallel_size == 1:
            raise ValueError("Cannot defer embedding wgrad compute when pipeline model parallel is not used")
        if self.defer_embedding_wgrad_compute and not self.gradient_accumulation_fusion:
            raise ValueError(
                "Cannot defer embedding wgrad compute when gradient accumulation fusion is not used"
            )
        if (
            self.expert_model_parallel_size > 1
            and self.tensor_model_parallel_size > 1
            and not self.sequence_parallel
        ):
            warnings.warn(
                "When using expert parallelism and tensor parallelism for training, sequence parallelism "
                "must be used",
                stacklevel=2,
            )
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size


# Duck typing: the layers, schedules, DDP and optimizer take any config object with the fields
# they read (Megatron-core's ModelParallelConfig / TransformerConfig included); a field the object
# lacks reads as ModelParallelConfig's default.

_FIELDS = {f.name: f for f in dataclasses.fields(ModelParallelConfig)}

# Defaults that ModelParallelConfig derives from other fields in __post_init__.
_DERIVED_DEFAULTS: dict[str, Callable[[Any], Any]] = {
    "autocast_dtype": lambda config: config_field(config, "params_dtype"),
    "expert_tensor_parallel_size": lambda config: config_field(config, "tensor_model_parallel_size"),
    "microbatch_group_size_per_vp_stage": lambda config: config_field(config, "pipeline_model_parallel_size"),
}

_NOT_CONFIGS = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, torch.Tensor)


def config_field(config: Any, name: str) -> Any:
    """``config.<name>``, or ModelParallelConfig's default for it when ``config`` has no such
    attribute (derived defaults, such as ``autocast_dtype`` = ``params_dtype``, included)."""
    value = getattr(config, name, dataclasses.MISSING)
    if value is not dataclasses.MISSING and not (value is None and name in _DERIVED_DEFAULTS):
        return value
    if name in _DERIVED_DEFAULTS:
        return _DERIVED_DEFAULTS[name](config)
    if name not in _FIELDS:
        raise AttributeError(f"{type(config).__name__} has no field {name!r}, nor has ModelParallelConfig")
    return _default(_FIELDS[name])


def check_config_object(config: Any, owner: str) -> Any:
    """Raises TypeError when ``config`` cannot be a configuration object at all (None, a number,
    a string, a container, a tensor or a module)."""
    if isinstance(config, _NOT_CONFIGS) or isinstance(config, torch.nn.Module):
        raise TypeError(
            f"{owner}: config must be a configuration object with ModelParallelConfig's fields "
            "(megatron_ext.ModelParallelConfig or TransformerConfig, Megatron-core's, or any object "
            f"with the fields read, e.g. sequence_parallel, params_dtype), got {type(config).__name__}"
        )
    return config


def check_model_parallel_config(config: Any, owner: str) -> Any:
    """Returns ``config`` if it can serve as a ModelParallelConfig: megatron_ext's own, Megatron-core's
    ``ModelParallelConfig`` / ``TransformerConfig``, or any object with at least one of its fields
    (missing fields read as the defaults, see ``config_field``). Raises TypeError for anything else
    and NotImplementedError for a field set to a feature megatron_ext lacks."""
    if isinstance(config, ModelParallelConfig):
        return config  # checked by its __post_init__
    check_config_object(config, owner)
    if not any(hasattr(config, name) for name in _FIELDS):
        raise TypeError(
            f"{owner}: config must be a configuration object with ModelParallelConfig's fields "
            "(megatron_ext.ModelParallelConfig or TransformerConfig, Megatron-core's, or any object "
            f"with the fields read, e.g. sequence_parallel, params_dtype), got {type(config).__name__}"
        )
    for name, why in _UNIMPLEMENTED.items():
        default = _default(_FIELDS[name])
        value = getattr(config, name, default)
        if value is not default and value != default:
            raise NotImplementedError(
                f"{owner}: config.{name}={value!r} is not supported ({why}); leave it at its default "
                f"{default!r}"
            )
    if not isinstance(config_field(config, "params_dtype"), torch.dtype):
        dtype = config_field(config, "params_dtype")
        raise TypeError(f"{owner}: config.params_dtype must be a torch.dtype, got {dtype!r}")
    return config
