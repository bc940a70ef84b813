"""Megatron-core's OptimizerConfig and parameter keys (``megatron.core.optimizer.optimizer_config``)."""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch


@dataclass(frozen=True)
class ParamPredicate:
    """A named test of a parameter, ``fn(param) -> bool``; equal (and hashed) by ``name`` only, so
    it can be part of a ``ParamKey``."""

    name: str
    fn: Callable[[torch.nn.Parameter], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return self.fn(param)


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """A named test of a parameter and its name, ``fn(param, name) -> bool``; equal (and hashed)
    by ``name`` only."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return self.fn(param, name)


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@dataclass(frozen=True)
class ParamKey:
    """Selects parameters (for ``config_overrides``): a parameter matches when any of the
    following holds: its name matches one of the ``name`` patterns (shell-style, ``fnmatch``;
    ``*`` also spans dots), one of the ``attr`` attributes is set and true on it, one of the
    ``predicate`` s accepts it, or one of the ``with_name_predicate`` s accepts it with its name.
    Each field takes one value or a tuple."""

    name: Union[str, tuple[str, ...]] = field(default_factory=tuple)
    attr: Union[str, tuple[str, ...]] = field(default_factory=tuple)
    predicate: Union[ParamPredicate, tuple[ParamPredicate, ...]] = field(default_factory=tuple)
    with_name_predicate: Union[ParamWithNamePredicate, tuple[ParamWithNamePredicate, ...]] = field(
        default_factory=tuple
    )

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        return (
            any(fnmatch.fnmatch(param_name, pattern) for pattern in _as_tuple(self.name))
            or any(bool(getattr(param, attr, False)) for attr in _as_tuple(self.attr))
            or any(predicate(param) for predicate in _as_tuple(self.predicate))
            or any(predicate(param, param_name) for predicate in _as_tuple(self.with_name_predicate))
        )


@dataclass
class OptimizerConfig:
    """Every field of Megatron-core 0.16's ``OptimizerConfig``, same defaults.

    Used here: ``optimizer`` ('adam' or 'sgd'), ``lr``, ``weight_decay`` (not applied to biases
    and 1-D parameters, Megatron's default), ``fp16``/``bf16``, ``loss_scale``,
    ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``, ``hysteresis``,
    ``adam_beta1/2``, ``adam_eps``, ``decoupled_weight_decay`` (AdamW), ``sgd_momentum``,
    ``use_distributed_optimizer``, ``clip_grad`` and ``log_num_zeros_in_grad``. ``min_lr``,
    ``decoupled_lr`` and ``decoupled_min_lr`` become the groups' ``max_lr`` / ``min_lr``, which
    ``OptimizerParamScheduler`` (the training loop's) reads, as in Megatron-core.
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
        # Megatron-core derives this; without the precision-aware optimizer it is False.
        self.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 cannot both be True")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"OptimizerConfig.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
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


_FIELDS = [f.name for f in dataclasses.fields(OptimizerConfig)]


def as_optimizer_config(config: Any) -> OptimizerConfig:
    """``config`` as an ``OptimizerConfig``: itself, or for any other object with its fields
    (Megatron-core's ``OptimizerConfig`` / ``AdamOptimizerConfig`` / ``SGDOptimizerConfig``
    included) a copy whose missing fields take the defaults, checked as the class checks them. An
    object with none of the fields raises TypeError."""
    if isinstance(config, OptimizerConfig):
        return config
    if isinstance(config, (type(None), bool, int, float, str, dict, list, tuple)) or not any(
        hasattr(config, name) for name in _FIELDS
    ):
        raise TypeError(
            "config must be an OptimizerConfig (megatron_ext's, Megatron-core's, or any object with its "
            f"fields, e.g. lr, optimizer, bf16), got {type(config).__name__}"
        )
    return OptimizerConfig(**{name: getattr(config, name) for name in _FIELDS if hasattr(config, name)})
