"""Megatron-core's helpers of ``pipeline_parallel.schedules`` that its training loop and model code
call, beside the schedules themselves: the warm-up arithmetic, the model's config through its
wrappers, the shape of the activations sent between stages, and the deferred embedding
weight-gradient hooks."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext import parallel_state
from megatron_ext.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_ext.resolve import get_attr_wrapped_model, group_size, module_with


def get_pp_rank_microbatches(
    num_microbatches: int,
    num_model_chunks: int,
    microbatch_group_size_per_vp_stage: int | None,
    forward_only: bool = False,
    overlap_moe_expert_parallel_comm: bool = False,
    p2p_communicator: P2PCommunicator | None = None,
) -> tuple[int, bool, int, int]:
    """Megatron-core's warm-up arithmetic for this pipeline rank.

    Returns ``(total, all_in_warmup, num_warmup, num_remaining)`` over the ``total =
    num_microbatches * num_model_chunks`` forwards of this rank: 1F1B warms up with
    ``pp - rank - 1`` forwards, the interleaved schedule with ``2 (pp - rank - 1) + (v - 1) g``
    (``g = microbatch_group_size_per_vp_stage``; one more with ``overlap_moe_expert_parallel_comm``),
    forward-only runs everything as warm-up, one stage none; never more than ``total``.
    """
    if p2p_communicator is not None:
        pp_size = p2p_communicator.pp_group.size()
        pp_rank = p2p_communicator.pp_group.rank()
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    total = num_microbatches * num_model_chunks
    if forward_only:
        num_warmup = total
    elif pp_size > 1:
        if vp_size is None:
            num_warmup = pp_size - pp_rank - 1
        else:
            num_warmup = 2 * (pp_size - pp_rank - 1)
            num_warmup += (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
            if overlap_moe_expert_parallel_comm:
                num_warmup += 1
    else:
        num_warmup = 0
    all_in_warmup = num_warmup >= total
    if all_in_warmup:
        num_warmup = total
    return total, all_in_warmup, num_warmup, total - num_warmup


def get_model_config(model: torch.nn.Module) -> Any:
    """The ``config`` of a model, looking through wrappers."""
    return get_attr_wrapped_model(model, "config")


def get_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    config: Any,
    tp_group: Any,
    cp_group: Any,
) -> list[tuple[int, int, int]]:
    """The shape of the activations sent between stages: ``[(s / cp (/ tp under sequence
    parallelism), b, hidden)]`` with ``s = decoder_seq_length`` if given, else ``seq_length``."""
    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    seq //= group_size(cp_group)
    if getattr(config, "sequence_parallel", False):
        seq //= group_size(tp_group)
    return [(seq, micro_batch_size, config.hidden_size)]


def clear_embedding_activation_buffer(config: Any, model: Any, is_last_stage: bool) -> Any:
    """Megatron-core's deferred embedding weight-gradient buffer: empties it on the last stage
    under ``config.defer_embedding_wgrad_compute`` and returns the module holding it (else None)."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return None
    module = module_with(model[-1] if isinstance(model, list) else model, "embedding_activation_buffer")
    if module is None:
        raise ValueError(
            "config.defer_embedding_wgrad_compute is set but the last model chunk has no "
            "embedding_activation_buffer"
        )
    module.embedding_activation_buffer.clear()
    return module


def finish_embedding_wgrad_compute(
    config: Any, embedding_module: Any, is_last_stage: bool, tp_group: Any
) -> None:
    """The deferred embedding weight gradient (``config.defer_embedding_wgrad_compute``) is not
    implemented: the output layer computes its weight gradient in its own backward."""
    if is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False):
        raise NotImplementedError(
            "config.defer_embedding_wgrad_compute=True is not implemented; leave it False"
        )
