"""The linear of the tensor-parallel layers: ``input @ weight.T + bias`` with its backward's
collective overlapped with the weight-gradient GEMM (the C++ op
``torch.ops.megatron_ext.linear_with_grad_accumulation_and_async_allreduce``), the frozen-weight
linear, and Megatron-core's autograd-function classes over them. ``tensor_parallel.layers``
re-exports every name."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron_ext.tensor_parallel.utils import group_args, resolve_tp_group


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    async_grad_allreduce: bool | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` whose backward overlaps the input-gradient collective with the
    weight-gradient GEMM (a C++ autograd node, ``torch.ops.megatron_ext``).

    Forward: under ``sequence_parallel`` the input (sequence-sharded along dim 0) is all-gathered
    along dim 0 first. Backward: the input gradient ``grad @ weight`` is computed and its all-reduce
    (``allreduce_dgrad``) or dim-0 reduce-scatter (``sequence_parallel``) started; the weight
    gradient ``grad^T @ input`` (re-gathering the input under sequence parallelism) and the bias
    gradient are computed while it runs; then it is waited on.

    With ``gradient_accumulation_fusion`` the weight gradient is added into the ``weight.main_grad``
    the weight has at the forward (in ``main_grad``'s dtype; Megatron-core also takes it there) and
    ``weight.grad`` is left as it was; under a DistributedDataParallel (a weight with
    ``grad_added_to_main_grad``) the forward sets that flag and the weight's hook receives a
    placeholder gradient. Under ``torch.autocast`` the GEMMs run in the autocast
    dtype, as under Megatron-core's ``custom_fwd``/``custom_bwd``. ``async_grad_allreduce`` is the
    older name of ``allreduce_dgrad``.
    """
    if async_grad_allreduce is not None:
        warnings.warn(
            "async_grad_allreduce is deprecated, use allreduce_dgrad", DeprecationWarning, stacklevel=2
        )
        allreduce_dgrad = async_grad_allreduce
    if grad_output_buffer is not None:
        raise NotImplementedError(
            "linear_with_grad_accumulation_and_async_allreduce: grad_output_buffer (deferred weight-gradient "
            "computation) is not supported; pass None"
        )
    if wgrad_deferral_limit not in (0, None):
        raise NotImplementedError(
            "linear_with_grad_accumulation_and_async_allreduce: wgrad_deferral_limit="
            f"{wgrad_deferral_limit!r} is not supported; pass 0"
        )
    for name, value in (("input", input), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"linear_with_grad_accumulation_and_async_allreduce: {name} must be a torch.Tensor, "
                f"got {type(value).__name__}"
            )
    main_grad, placeholder = None, 0
    if gradient_accumulation_fusion:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "linear_with_grad_accumulation_and_async_allreduce: gradient_accumulation_fusion=True "
                "is not supported under torch.compile (the backward adds into weight.main_grad)"
            )
        main_grad = getattr(weight, "main_grad", None)
        if not isinstance(main_grad, torch.Tensor):
            raise ValueError(
                "linear_with_grad_accumulation_and_async_allreduce: gradient_accumulation_fusion=True "
                "needs weight.main_grad, a tensor of the weight's shape to accumulate the gradient in"
            )
        if hasattr(weight, "grad_added_to_main_grad"):
            # A DistributedDataParallel's handshake: the weight's hook gets a placeholder gradient
            # (zeros under zero_out_wgrad) and the flag tells it the gradient is in main_grad.
            placeholder = 2 if getattr(weight, "zero_out_wgrad", False) else 1
            weight.grad_added_to_main_grad = True
    name, group_size, _ = group_args(tp_group)
    return torch.ops.megatron_ext.linear_with_grad_accumulation_and_async_allreduce(
        input,
        weight,
        bias,
        main_grad,
        placeholder,
        bool(allreduce_dgrad),
        bool(sequence_parallel),
        name,
        group_size,
    )


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup | None,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: None = None,
    async_grad_allreduce: bool | None = None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` for a weight that is not trained: backward computes the input
    gradient only (and keeps no input activation for a weight gradient).

    Under ``sequence_parallel`` the input is all-gathered along dim 0 first (its gradient
    reduce-scattered); with ``allreduce_dgrad`` the input gradient is all-reduced over ``tp_group``
    (None: the tensor-parallel group). ``gradient_accumulation_fusion`` is accepted and unused, as in
    Megatron-core.
    """
    if async_grad_allreduce is not None:
        warnings.warn(
            "async_grad_allreduce is deprecated, not in use anymore; use allreduce_dgrad", DeprecationWarning,
            stacklevel=2,
        )
    if grad_output_buffer is not None:
        raise parallel_state.ParallelStateError(
            "grad_output_buffer kwarg is only supported with "
            "linear_with_grad_accumulation_and_async_allreduce"
        )
    if wgrad_deferral_limit is not None:
        raise parallel_state.ParallelStateError(
            "wgrad_deferral_limit is only supported with linear_with_grad_accumulation_and_async_allreduce"
        )
    tp_group = resolve_tp_group(tp_group)
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, True, tp_group)
    if allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, tp_group)
    return torch.nn.functional.linear(input, weight.detach(), bias)


# Megatron-core's autograd functions of the linears ---------------------------------------------------
#
# Here the autograd nodes are C++ (the C++ op behind linear_with_grad_accumulation_and_async_allreduce,
# the copy and gather regions), so these are plain classes whose static ``apply`` takes Megatron-core's
# arguments in its order and calls the functions above.


class LinearWithGradAccumulationAndAsyncCommunication:
    """``input @ weight.T + bias``; see :func:`linear_with_grad_accumulation_and_async_allreduce`."""

    @staticmethod
    def apply(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list[torch.Tensor] | None,
        wgrad_deferral_limit: int | None,
        tp_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        return linear_with_grad_accumulation_and_async_allreduce(
            input,
            weight,
            bias,
            gradient_accumulation_fusion,
            allreduce_dgrad,
            sequence_parallel,
            grad_output_buffer,
            wgrad_deferral_limit,
            tp_group=tp_group,
        )


class LinearWithFrozenWeight:
    """``input @ weight.T + bias`` for a weight that is not trained: backward computes the input
    gradient only, all-reduced over ``tp_group`` (None: the tensor-parallel group) when
    ``allreduce_dgrad``. Sequence parallelism's gather is :func:`linear_with_frozen_weight`'s, as in
    Megatron-core. A bias that requires grad gets its gradient (Megatron-core's gives none)."""

    @staticmethod
    def apply(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        return linear_with_frozen_weight(input, weight, bias, False, allreduce_dgrad, False, tp_group)
