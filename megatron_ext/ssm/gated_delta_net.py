"""Megatron-core's module path of ``GatedDeltaNet`` (``megatron.core.ssm.gated_delta_net``)."""

from megatron_ext.transformer.gated_delta_net import GatedDeltaNet

__all__ = ["GatedDeltaNet"]
