"""The configuration read by the tensor-parallel layers and the pipeline schedules.

Field names and defaults are Megatron-core's ``ModelParallelConfig``; only the fields megatron_ext
reads (plus ``hidden_size``, which Megatron-core keeps on ``TransformerConfig``) are accepted, so a
misspelt or unsupported field raises ``TypeError`` rather than being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch


@dataclass
class ModelParallelConfig:
    """Settings shared by the parallel layers and schedules.

    ``sequence_parallel=True`` with ``tensor_model_parallel_size == 1`` is accepted (Megatron-core
    raises): sequence parallelism over one rank is the identity, so the layers simply run without
    it. That lets one config serve every TP size of a sweep.
    """

    # Model parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1

    # Initialisation
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # Training
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Any = None
    finalize_model_grads_func: Callable | None = None
    grad_scale_func: Callable | None = None
    no_sync_func: Callable[[], ContextManager] | None = None
    grad_sync_func: Callable | None = None
    param_sync_func: Callable | None = None
    deterministic_mode: bool = False
    enable_autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    num_microbatches_with_partial_activation_checkpoints: int | None = None
    calculate_per_token_loss: bool = False

    # Optimisations
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False

    # Pipeline parallelism
    pipeline_dtype: torch.dtype | None = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False

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
            raise TypeError(f"ModelParallelConfig.params_dtype must be a torch.dtype, got {self.params_dtype!r}")
        if self.fp16 and self.bf16:
            raise ValueError("ModelParallelConfig: fp16 and bf16 cannot both be True")
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                "ModelParallelConfig.pipeline_dtype is required when pipeline_model_parallel_size "
                f"is {self.pipeline_model_parallel_size}: it is the dtype of the tensors sent between "
                "stages (usually params_dtype)"
            )
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
