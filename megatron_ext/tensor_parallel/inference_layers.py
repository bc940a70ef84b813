"""Megatron-core's inference-optimised linears, which subclass TransformerEngine's layers and use
NVLS symmetric-memory collectives. megatron_ext has neither, so constructing one raises the error
Megatron-core raises without TransformerEngine; the names exist so that imports keep working."""

from __future__ import annotations

from typing import Any

from megatron_ext.parallel_state import ParallelStateError

_MESSAGE = (
    "--transformer-impl=inference_optimized requires transformer engine: {name} builds on "
    "TransformerEngine layers and NVLS symmetric memory, which megatron_ext does not provide; use "
    "ColumnParallelLinear / RowParallelLinear"
)


class InferenceLayerNormColumnParallelLinear:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ParallelStateError(_MESSAGE.format(name=type(self).__name__))


class InferenceRowParallelLinear:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ParallelStateError(_MESSAGE.format(name=type(self).__name__))
