"""Which layer of a Mamba hybrid stack (Nemotron-H, Granite 4) is Mamba, attention, MLP or MoE:
Megatron-core 0.16.1's ``megatron.core.ssm.mamba_hybrid_layer_allocation``, and which of those
layers a pipeline stage builds."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from megatron_ext import parallel_state
from megatron_ext.datasets.utils import log_single_rank
from megatron_ext.pipeline_parallel.schedule_tables import stage_location
from megatron_ext.transformer import transformer_block  # read at call time: the block builds Mamba layers

logger = logging.getLogger(__name__)

__all__ = [
    "Symbols",
    "allocate_layers",
    "get_layer_maps_from_layer_type_list",
    "get_layer_indices_for_pipeline_stage",
]


class Symbols:
    """The characters of a hybrid layer pattern."""

    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"
    VALID = {MAMBA, ATTENTION, MLP, MOE}


def _spread(layer_types: list[str], slots: list[int], step: float, symbol: str) -> None:
    """Walks over ``slots`` with a running distance to the next placement that starts at ``step``,
    shrinks by one per slot passed and grows by ``step`` per placement; a slot is taken when the
    distance drops under one half. The float arithmetic stays in this order so that the pattern is
    Megatron-core's to the last layer."""
    distance = step
    for slot in slots:
        if distance < 0.5:
            layer_types[slot] = symbol
            distance += step
        else:
            distance -= 1


def _auto_pattern(total: int, attention_ratio: float, mlp_ratio: float) -> list[str]:
    layer_types = [Symbols.MAMBA] * total
    # Attention layers cut the Mamba layers into attention + 1 runs of equal length, so the stack
    # starts and ends with Mamba.
    attention = round(total * attention_ratio)
    mamba = total - attention
    _spread(layer_types, list(range(total)), mamba / (attention + 1), Symbols.ATTENTION)
    # MLP layers replace Mamba layers only, spread evenly over their places, right-justified.
    mlp = round(total * mlp_ratio)
    if mlp > 0:
        mamba_slots = [i for i, s in enumerate(layer_types) if s == Symbols.MAMBA]
        _spread(layer_types, mamba_slots, (mamba - mlp) / mlp, Symbols.MLP)
    return layer_types


def _check_pattern(total: int, pattern: str) -> list[str]:
    if len(pattern) != total:
        raise ValueError(
            f"the hybrid override pattern {pattern!r} has {len(pattern)} layers, expected "
            f"total_layers_count = {total}"
        )
    for i, symbol in enumerate(pattern):
        if symbol not in Symbols.VALID:
            raise ValueError(
                f"the hybrid override pattern {pattern!r} has {symbol!r} at layer {i}, expected one "
                f"of {sorted(Symbols.VALID)}"
            )
    return list(pattern)


def _counts(layer_types: list[str]) -> dict[str, int]:
    return {s: layer_types.count(s) for s in sorted(Symbols.VALID)}


def allocate_layers(
    total_layers_count: int,
    target_attention_ratio: float,
    target_mlp_ratio: float,
    override_pattern: str | None = None,
) -> list:
    """The layer symbols of a ``total_layers_count``-layer hybrid stack (a list of ``Symbols``).

    About ``target_attention_ratio`` of the layers are attention, spread evenly with Mamba layers
    first and last; then about ``target_mlp_ratio`` of the layers become MLPs, spread evenly over the
    places of the Mamba layers (right-justified); the rest stay Mamba. ``override_pattern``
    (a string of ``Symbols``, one per layer) replaces that pattern; when either ratio is non-zero it
    must hold as many layers of each type as the ratios give (else ValueError). The ratios and the
    pattern are logged on rank 0, as Megatron-core does. Raises ValueError on a count that is not
    positive, a ratio outside [0, 1] or ratios summing over 1 (Megatron-core asserts).
    """
    if isinstance(total_layers_count, bool) or not isinstance(total_layers_count, int) or (
        total_layers_count <= 0
    ):
        raise ValueError(f"total_layers_count must be a positive integer, got {total_layers_count!r}")
    for name, ratio in (("target_attention_ratio", target_attention_ratio),
                        ("target_mlp_ratio", target_mlp_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {ratio!r}")
    if not target_attention_ratio + target_mlp_ratio <= 1.0:
        raise ValueError(
            f"target_attention_ratio + target_mlp_ratio must be at most 1, got "
            f"{target_attention_ratio!r} + {target_mlp_ratio!r}"
        )
    ratios_given = target_attention_ratio > 0.0 or target_mlp_ratio > 0.0
    layer_types = _auto_pattern(total_layers_count, target_attention_ratio, target_mlp_ratio)
    if override_pattern is not None:
        overridden = _check_pattern(total_layers_count, override_pattern)
        log_single_rank(logger, logging.INFO, "Using hybrid override pattern")
        if ratios_given and _counts(overridden) != _counts(layer_types):
            raise ValueError(
                f"the hybrid override pattern {override_pattern!r} has layer counts "
                f"{_counts(overridden)}, expected those of the ratios (attention "
                f"{target_attention_ratio}, mlp {target_mlp_ratio}): {_counts(layer_types)} "
                f"(pattern {''.join(layer_types)!r})"
            )
        if overridden == layer_types:
            log_single_rank(logger, logging.INFO, "The override pattern matches the overridden pattern")
        else:
            log_single_rank(logger, logging.INFO, "Warning: overriding pattern A with pattern B")
            log_single_rank(logger, logging.INFO, f"A: {''.join(layer_types)}")
            log_single_rank(logger, logging.INFO, f"B: {override_pattern}")
        layer_types = overridden
    if ratios_given or override_pattern is not None:
        attention = layer_types.count(Symbols.ATTENTION)
        mlp = layer_types.count(Symbols.MLP)
        log_single_rank(
            logger,
            logging.INFO,
            f"Hybrid allocation ({Symbols.MAMBA} is mamba, {Symbols.ATTENTION} is attention, "
            f"{Symbols.MLP} is mlp): {''.join(layer_types)}; {attention} attention and {mlp} mlp "
            f"layers in {total_layers_count} total layers. Target attention ratio: "
            f"{target_attention_ratio:.2f}, actual {attention / total_layers_count:.2f}. Target mlp "
            f"ratio: {target_mlp_ratio:.2f}, actual {mlp / total_layers_count:.2f}.",
        )
    return layer_types


def get_layer_maps_from_layer_type_list(layer_type_list: list[str]) -> list[dict[int, int]]:
    """Four maps, for attention, Mamba, MLP and MoE layers in that order, from a layer's global
    index in ``layer_type_list`` to its index among the layers of its type."""
    order = [Symbols.ATTENTION, Symbols.MAMBA, Symbols.MLP, Symbols.MOE]
    maps: dict[str, dict[int, int]] = {s: {} for s in order}
    for i, symbol in enumerate(layer_type_list):
        if symbol not in maps:
            raise ValueError(f"layer {i} has the layer type {symbol!r}, expected one of {order}")
        maps[symbol][i] = len(maps[symbol])
    return [maps[s] for s in order]


def get_layer_indices_for_pipeline_stage(
    layer_type_list: list[str],
    pp_size: int = 1,
    pp_rank: int = 0,
    vp_size: int | None = None,
    vp_stage: int | None = None,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
) -> list[int]:
    """The global indices (into ``layer_type_list``) of the layers that model chunk ``vp_stage``
    of pipeline rank ``pp_rank`` builds, cut exactly as transformer stacks are
    (``transformer_block.layers_per_virtual_stage``, parallel_state's pipeline layout): the first /
    last rank holds ``num_layers_in_first/last_pipeline_stage`` layers where given and the other
    ranks share the rest equally, each rank's layers split equally over its ``vp_size`` chunks.

    Megatron-core's MambaStack refuses a virtual pipeline; here it is supported. A split that does
    not come out even, or that leaves any virtual stage without layers, raises ValueError (the
    same on every rank: the whole split is checked, not only this stage).
    """
    vp = 1 if vp_size is None else vp_size
    if pp_size < 1 or vp < 1:
        raise ValueError(f"pp_size and vp_size must be at least 1, got {pp_size} and {vp_size}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    split = SimpleNamespace(
        num_layers=len(layer_type_list),
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
    )
    counts = transformer_block.layers_per_virtual_stage(split, pp_size, vp)
    for stage, n in enumerate(counts):
        if n <= 0:
            where = f"pipeline stage {stage}"
            if vp > 1:
                layout = parallel_state.get_pipeline_model_parallel_layout()
                rank, chunk = stage_location(stage, pp_size, layout)
                where = f"virtual pipeline stage {stage} (pipeline rank {rank}, model chunk {chunk})"
            raise ValueError(
                f"{where} of pp_size {pp_size} x vp_size {vp} gets {n} of the "
                f"{len(layer_type_list)} layers of the hybrid pattern {''.join(layer_type_list)!r} "
                f"(num_layers_in_first/last_pipeline_stage {num_layers_in_first_pipeline_stage}, "
                f"{num_layers_in_last_pipeline_stage}); every stage must hold at least one layer"
            )
    stage = transformer_block._virtual_stage(vp_stage, pp_rank, pp_size, vp)
    offset = sum(counts[:stage])
    return list(range(offset, offset + counts[stage]))
