"""The exception every checkpoint refusal raises (Megatron-core's ``dist_checkpointing.core``)."""


class CheckpointingException(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked (incomplete, corrupted, other shape)."""
