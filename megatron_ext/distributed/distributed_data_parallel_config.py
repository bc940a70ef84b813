"""Megatron-core's DistributedDataParallelConfig: how DistributedDataParallel reduces gradients."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class DistributedDataParallelConfig:
    """The options of Megatron-core 0.16's ``DistributedDataParallelConfig``.

    Implemented: ``grad_reduce_in_fp32`` (``param.main_grad`` is float32 for 16-bit parameters),
    ``overlap_grad_reduce`` (a bucket's collective starts during the backward once all its
    gradients are complete; otherwise all start in ``finish_grad_sync``),
    ``use_distributed_optimizer`` (reduce-scatter instead of all-reduce; parameters start at
    multiples of 64 elements, buckets end at multiples of lcm(dp, 128)),
    ``num_distributed_optimizer_instances`` (the reduce-scatter within an instance, then an
    all-reduce of the slice over the instances), ``reduce_scatter_with_fp32_accumulation`` (16-bit
    slices summed in float32), ``bucket_size`` (elements per bucket; None: Megatron's
    ``max(40_000_000, 1_000_000 * dp)``), ``pad_buckets_for_high_nccl_busbw``,
    ``check_for_nan_in_grad``, ``average_in_collective`` (no scaling before the collective, its
    result divided by the group size: gloo has no AVG),
    ``overlap_param_gather`` (with ``use_distributed_optimizer``: the optimizer step leaves the
    parameter all-gathers in flight and each module's forward pre-hook waits for its own
    parameters; without it the flag has no effect, as in Megatron-core).
    The remaining fields are accepted at their defaults and refused otherwise.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False

    def __post_init__(self) -> None:
        unsupported = {
            "align_param_gather": False,
            "check_for_large_grads": False,
            "fp8_param_gather": False,
            "reuse_grad_buf_for_mxfp8_param_ag": False,
            "outer_dp_sharding_strategy": "no_shard",
            "nccl_ub": False,
            "fsdp_double_buffer": False,
            "delay_wgrad_compute": False,
        }
        for name, default in unsupported.items():
            if getattr(self, name) != default:
                raise NotImplementedError(
                    f"DistributedDataParallelConfig.{name}={getattr(self, name)!r} is not supported by "
                    f"megatron_ext (only {default!r})"
                )
        strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
        if self.data_parallel_sharding_strategy not in strategies:
            raise ValueError(
                "DistributedDataParallelConfig.data_parallel_sharding_strategy must be one of "
                f"{list(strategies)}, got {self.data_parallel_sharding_strategy!r}"
            )
        if self.use_custom_fsdp and not self.use_megatron_fsdp:
            self.use_megatron_fsdp = True  # the deprecated name, as Megatron-LM maps it
        if self.data_parallel_sharding_strategy != "no_shard" and not self.use_megatron_fsdp:
            raise ValueError(
                f"DistributedDataParallelConfig.data_parallel_sharding_strategy="
                f"{self.data_parallel_sharding_strategy!r} needs use_megatron_fsdp=True "
                "(FullyShardedDataParallel)"
            )
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size < 1
        ):
            raise ValueError(f"DistributedDataParallelConfig.bucket_size must be None or an integer >= 1, "
                             f"got {self.bucket_size!r}")
        instances = self.num_distributed_optimizer_instances
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ValueError(
                f"DistributedDataParallelConfig.num_distributed_optimizer_instances must be an integer >= 1, "
                f"got {instances!r}"
            )
        if instances > 1 and not self.use_distributed_optimizer and not self.use_megatron_fsdp:
            raise ValueError(
                "DistributedDataParallelConfig.num_distributed_optimizer_instances > 1 needs "
                "use_distributed_optimizer=True"
            )
        if instances > 1 and self.reduce_scatter_with_fp32_accumulation:
            raise NotImplementedError(
                "reduce_scatter_with_fp32_accumulation with num_distributed_optimizer_instances > 1 is not "
                "supported (as in Megatron-core)"
            )


_FIELDS = [f.name for f in dataclasses.fields(DistributedDataParallelConfig)]


def as_ddp_config(config: Any, **overrides: Any) -> DistributedDataParallelConfig:
    """``config`` as a ``DistributedDataParallelConfig``: itself, or for any other object with its
    fields (Megatron-core's class included) a copy whose missing fields take the defaults (None:
    all defaults). ``overrides`` replace fields of that copy. Values are checked as the class
    checks them; an object with none of the fields raises TypeError."""
    if isinstance(config, DistributedDataParallelConfig) and not overrides:
        return config
    if config is None:
        values = {}
    elif isinstance(config, (bool, int, float, str, dict, list, tuple)) or not any(
        hasattr(config, name) for name in _FIELDS
    ):
        raise TypeError(
            "ddp_config must be a DistributedDataParallelConfig (megatron_ext's, Megatron-core's, or any "
            f"object with its fields, e.g. overlap_grad_reduce), got {type(config).__name__}"
        )
    else:
        values = {name: getattr(config, name) for name in _FIELDS if hasattr(config, name)}
    values.update(overrides)
    return DistributedDataParallelConfig(**values)
