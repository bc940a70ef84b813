"""Mixed-precision and distributed optimizers with Megatron-core's names
(``megatron.core.optimizer``)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron_ext.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_ext.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron_ext.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron_ext.optimizer.optimizer_config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig


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
    config: OptimizerConfig,
    model_chunks: list[torch.nn.Module] | torch.nn.Module,
    config_overrides: dict | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: str | None = None,
) -> MegatronOptimizer:
    """The optimizer Megatron-core would build for ``config``:

    * ``use_distributed_optimizer``: ``DistributedOptimizer`` (every chunk must be a
      ``DistributedDataParallel`` with ``DistributedDataParallelConfig(use_distributed_optimizer=True)``);
    * else ``fp16`` or ``bf16``: ``Float16OptimizerWithFloat16Params``;
    * else ``FP32Optimizer``.

    fp16 gets a ``DynamicGradScaler`` (``ConstantGradScaler`` when ``config.loss_scale`` is set);
    set ``model_config.grad_scale_func = optimizer.scale_loss`` so the schedules scale the loss.
    Megatron-core returns one optimizer per parameter kind (dense/expert) chained; megatron_ext
    has no experts and returns the optimizer itself. ``config_overrides``, ``pg_collection`` and
    ``dump_param_to_param_group_map`` are not supported (pass None); ``use_gloo_process_groups``
    is accepted and has no effect.
    """
    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    for name, value in (("config_overrides", config_overrides), ("pg_collection", pg_collection),
                        ("dump_param_to_param_group_map", dump_param_to_param_group_map)):
        if value is not None:
            raise NotImplementedError(
                f"get_megatron_optimizer: {name} is not supported by megatron_ext (pass None)"
            )
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    model_chunks = list(model_chunks)
    if not model_chunks or not all(isinstance(c, torch.nn.Module) for c in model_chunks):
        raise TypeError("model_chunks must be a non-empty list of torch.nn.Module")
    grad_scaler = _grad_scaler(config)
    if config.use_distributed_optimizer:
        return DistributedOptimizer.create(config, model_chunks, grad_scaler)
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params.create(config, model_chunks, grad_scaler)
    return FP32Optimizer.create(config, model_chunks)


__all__ = [
    "AdamOptimizerConfig",
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
