"""Linear-recurrence layers (Megatron-core's ``megatron.core.ssm``)."""

from megatron_ext.ssm.gated_delta_net import GatedDeltaNet
from megatron_ext.ssm.mamba_mixer import MambaMixer

__all__ = ["GatedDeltaNet", "MambaMixer"]
