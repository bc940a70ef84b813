"""Pipeline parallelism: point-to-point stage communication and the forward-backward schedules."""

from megatron_ext.pipeline_parallel import p2p_communication, schedules
from megatron_ext.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_ext.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_gpipe,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)

__all__ = [
    "P2PCommunicator",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_gpipe",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "p2p_communication",
    "schedules",
]
