"""Small pieces shared by the transformer modules."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from megatron_ext.dist_checkpointing.rank_shards import (
    make_sharded_object_for_checkpoint,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron_ext.fusions.fused_rms_norm import fused_rms_norm


@contextlib.contextmanager
def initialization_seed(base_seed: int | None, offset: int) -> Iterator[None]:
    """Draws the parameters built inside from the CPU generator seeded with ``base_seed + offset``
    and restores the generator afterwards.

    Seeding each layer by its global index makes a layer's (master) weights the same whichever
    pipeline stage builds it, so every parallel layout starts from the serial model's weights.
    ``base_seed=None`` leaves the generator alone.
    """
    if base_seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        # Only the CPU generator: torch.manual_seed would also reseed (and not restore) CUDA's.
        torch.random.default_generator.manual_seed(base_seed + offset)
        yield


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameter, same numbers) computed by megatron_ext's fused kernel
    (``fusions.fused_rms_norm``: one pass forward, one backward, float32 statistics for 16-bit inputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


def layer_norm(config: Any, hidden_size: int) -> torch.nn.Module:
    """The transformer's normalisation over the last ``hidden_size`` features: ``torch.nn.LayerNorm``
    or, with ``config.normalization == "RMSNorm"``, ``torch.nn.RMSNorm`` (what Megatron-core's local
    layers build; the fused kernel, ``FusedRMSNorm``, with ``config.persist_layer_norm`` or
    ``config.memory_efficient_layer_norm``), both with ``config.layernorm_epsilon``. Its parameters
    carry ``sequence_parallel`` (Megatron's attribute): under sequence parallelism each tensor-parallel
    rank normalises its own part of the sequence, so their gradients are partial sums that
    ``finalize_model_grads`` all-reduces."""
    eps, dtype = config.layernorm_epsilon, config.params_dtype
    if getattr(config, "normalization", "LayerNorm") == "RMSNorm":
        fused = getattr(config, "persist_layer_norm", False) or getattr(
            config, "memory_efficient_layer_norm", False
        )
        norm = (FusedRMSNorm if fused else torch.nn.RMSNorm)(hidden_size, eps=eps, dtype=dtype)
    else:
        norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def make_sharded_tensors_for_checkpoint(
    state_dict: dict[str, Any],
    prefix: str,
    tensor_parallel_layers_axis_map: dict[str, int] | None = None,
    sharded_offsets: tuple = (),
    extra_state_suffix: str = "_extra_state",
    tp_group: Any = None,
    dp_cp_group: Any = None,
) -> dict[str, Any]:
    """Megatron-core's helper: each entry of ``state_dict`` under ``prefix + name`` as a
    ShardedTensor split over tensor-parallel ranks along the axis ``tensor_parallel_layers_axis_map``
    gives it, else replicated; ``*_extra_state`` entries as ShardedObjects."""
    axis_map = tensor_parallel_layers_axis_map or {}
    groups = (
        {} if tp_group is None and dp_cp_group is None else {"tp_group": tp_group, "dp_cp_group": dp_cp_group}
    )
    out = {}
    for name, tensor in state_dict.items():
        key = f"{prefix}{name}"
        if name.endswith(extra_state_suffix):
            out[key] = make_sharded_object_for_checkpoint(tensor, key, sharded_offsets)
        elif name in axis_map:
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                tensor, key, axis_map[name], prepend_offsets=sharded_offsets, **groups
            )
        else:
            out[key] = make_sharded_tensor_for_checkpoint(tensor, key, sharded_offsets, **groups)
    return out


def selectively_recomputed(config: Any, module: str) -> bool:
    """Whether selective recomputation covers ``module`` (one of Megatron-core's
    ``recompute_modules``: "core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts")."""
    return getattr(config, "recompute_granularity", None) == "selective" and module in (
        getattr(config, "recompute_modules", None) or ()
    )
