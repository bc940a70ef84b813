"""Mixed-precision and distributed optimizers with Megatron-core's names
(``megatron.core.optimizer``)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron_ext.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_ext.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron_ext.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    ProxyDict,
)
from megatron_ext.optimizer.optimizer_config import (
    AdamOptimizerConfig,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    SGDOptimizerConfig,
    as_optimizer_config,
)
from megatron_ext.optimizer.param_groups import (
    _get_param_groups,
    check_config_overrides_consistency,
    get_standard_config_overrides,
)
from megatron_ext.optimizer_param_scheduler import ParamGroupOverride
from megatron_ext.process_groups_config import ProcessGroupCollection
from megatron_ext.resolve import find_wrapper


def _grad_scaler(config: OptimizerConfig) -> MegatronGradScaler | None:
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(config.loss_scale_window),
            hysteresis=config.hysteresis,
        )
    return None


def get_megatron_optimizer(
    config: Any,
    model_chunks: list[torch.nn.Module] | torch.nn.Module,
    config_overrides: dict[ParamKey, ParamGroupOverride] | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: ProcessGroupCollection | None = None,
    dump_param_to_param_group_map: str | None = None,
) -> MegatronOptimizer:
    """The optimizer Megatron-core would build for ``config`` (an ``OptimizerConfig``, Megatron-core's,
    or any object with its fields; missing ones take the defaults):

    * ``use_distributed_optimizer``: ``DistributedOptimizer`` (every chunk must be a
      ``DistributedDataParallel`` with ``DistributedDataParallelConfig(use_distributed_optimizer=True)``);
    * else ``fp16`` or ``bf16``: ``Float16OptimizerWithFloat16Params``;
    * else ``FP32Optimizer``.

    Parameter groups follow ``config_overrides`` (``ParamKey`` -> ``ParamGroupOverride``; None:
    no weight decay on biases and 1-D parameters, ``{}``: no override), see ``_get_param_groups``;
    each group's weight decay is ``weight_decay * wd_mult`` and its learning rate ``max_lr * lr_mult``.
    fp16 gets a ``DynamicGradScaler`` (``ConstantGradScaler`` when ``config.loss_scale`` is set);
    set ``model_config.grad_scale_func = optimizer.scale_loss`` so the schedules scale the loss.
    ``pg_collection`` replaces parallel_state's groups (checked by
    ``ProcessGroupCollection.setup_process_groups_for_optimizer``: ``dp``, ``expt_dp``, ``mp``,
    ``tp_ep_pp``, and ``intra_dist_opt`` for the distributed optimizer, with
    ``use_gloo_process_groups=False``). Megatron-core returns a ``ChainedOptimizer`` of one
    optimizer per parameter kind (dense/expert); megatron_ext has no expert parameters and returns
    the optimizer itself. ``dump_param_to_param_group_map`` is not supported (pass None).
    """
    config = as_optimizer_config(config)
    if dump_param_to_param_group_map is not None:
        raise NotImplementedError(
            "get_megatron_optimizer: dump_param_to_param_group_map is not supported by megatron_ext "
            "(pass None)"
        )
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    model_chunks = list(model_chunks)
    if not model_chunks or not all(isinstance(c, torch.nn.Module) for c in model_chunks):
        raise TypeError("model_chunks must be a non-empty list of torch.nn.Module")
    check_config_overrides_consistency(config, config_overrides)
    groups = None
    if pg_collection is not None:
        groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
            pg_collection, model_chunks, use_gloo_process_groups
        )
    if not config.use_distributed_optimizer:
        for chunk in model_chunks:
            wrapper = find_wrapper(chunk, DistributedDataParallel)
            strategy = getattr(wrapper, "sharding_strategy", "no_shard")
            if strategy != "no_shard":
                raise ValueError(
                    "get_megatron_optimizer: a model chunk is fully sharded with "
                    f"data_parallel_sharding_strategy={strategy!r}, whose optimizer state is sharded: give "
                    "OptimizerConfig("
                    "use_distributed_optimizer=True)"
                )
    param_groups = _get_param_groups(model_chunks, config, config_overrides)
    grad_scaler = _grad_scaler(config)
    if config.use_distributed_optimizer:
        optimizer = DistributedOptimizer.create(config, model_chunks, grad_scaler, param_groups)
    elif config.fp16 or config.bf16:
        optimizer = Float16OptimizerWithFloat16Params.create(config, model_chunks, grad_scaler, param_groups)
    else:
        optimizer = FP32Optimizer.create(config, model_chunks, param_groups)
    if groups is not None:
        optimizer.model_parallel_group = groups["mp_group"]
        optimizer.data_parallel_group = groups["dp_cp_group"]
        optimizer.tp_group = getattr(pg_collection, "tp", None)
        optimizer.expt_tp_group = getattr(pg_collection, "expt_tp", None)
    return optimizer


__all__ = [
    "AdamOptimizerConfig",
    "ChainedOptimizer",
    "ParamGroupOverride",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
    "ProxyDict",
    "check_config_overrides_consistency",
    "get_standard_config_overrides",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "SGDOptimizerConfig",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
]
