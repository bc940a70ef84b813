"""Linear-recurrence layers (Megatron-core's ``megatron.core.ssm``)."""

from megatron_ext.ssm.gated_delta_net import GatedDeltaNet

__all__ = ["GatedDeltaNet"]
