"""The exception every checkpoint refusal raises (Megatron-core's ``dist_checkpointing.core``)."""

from torch.distributed.checkpoint import CheckpointException as _DCPException


class CheckpointingException(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked (incomplete, corrupted, other shape)."""


class CheckpointWriteError(CheckpointingException, _DCPException):
    """A save whose files could not be written, raised alike on every rank: both a
    CheckpointingException and DCP's ``CheckpointException`` (what Megatron-core raises then)."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self._failures = {}

    def __str__(self) -> str:
        return self.args[0]
