"""Megatron-core's ``dist_checkpointing.strategies``: the strategy objects ``save`` and ``load``
accept (megatron_ext has one backend, ``torch_dist`` v1, and the ``torch`` common backend), the
async-save queue, and the DCP storage writer that splits a rank's items over worker threads."""
