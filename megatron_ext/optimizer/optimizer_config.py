"""Megatron-core's OptimizerConfig (``megatron.core.optimizer.optimizer_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class OptimizerConfig:
    """Every field of Megatron-core 0.16's ``OptimizerConfig``, same defaults.

    Used here: ``optimizer`` ('adam' or 'sgd'), ``lr``, ``weight_decay`` (not applied to biases
    and 1-D parameters, Megatron's default), ``fp16``/``bf16``, ``loss_scale``,
    ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``, ``hysteresis``,
    ``adam_beta1/2``, ``adam_eps``, ``decoupled_weight_decay`` (AdamW), ``sgd_momentum``,
    ``use_distributed_optimizer``, ``clip_grad`` and ``log_num_zeros_in_grad``. Learning-rate
    schedules (``min_lr``, ``decoupled_lr``) belong to the training loop, as in Megatron-core.
    ``overlap_param_gather`` is accepted and meant to equal the ``DistributedDataParallelConfig``
    field of that name, which is what turns the overlap on (as in Megatron-core). Options of
    features megatron_ext lacks (precision-aware optimizer, CPU offload, fp8, Muon,
    ``overlap_param_gather_with_optimizer_step``) are refused when set.
    """

    lr: float | None = None
    min_lr: float | None = None
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    fp8_recipe: str | None = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    optimizer: str = "adam"
    loss_scale: float | None = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Callable | None = None
    config_logger_dir: str = ""

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 cannot both be True")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"OptimizerConfig.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        for name in ("main_grads_dtype", "main_params_dtype"):
            if getattr(self, name) != torch.float32:
                raise ValueError(f"OptimizerConfig.{name} can only be torch.float32 without the "
                                 f"precision-aware optimizer, got {getattr(self, name)}")
        unsupported = {
            "use_precision_aware_optimizer": False,
            "optimizer_cpu_offload": False,
            "overlap_param_gather_with_optimizer_step": False,
            "fp8_recipe": None,
        }
        for name, default in unsupported.items():
            if getattr(self, name) != default:
                raise NotImplementedError(
                    f"OptimizerConfig.{name}={getattr(self, name)!r} is not supported by megatron_ext"
                )
        if self.clip_grad < 0:
            raise ValueError(
                f"OptimizerConfig.clip_grad must be >= 0 (0 = no clipping), got {self.clip_grad}"
            )


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """Megatron-core's Adam-specific config."""

    optimizer: str = "adam"


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """Megatron-core's SGD-specific config."""

    optimizer: str = "sgd"
