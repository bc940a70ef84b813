"""The exception every checkpoint refusal raises (Megatron-core's ``dist_checkpointing.core``),
and how every rank comes to raise the same one."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException as _DCPException

from megatron_ext.comm_errors import reported


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


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    with reported("all-gather of the checkpoint's per-rank records", None):
        dist.all_gather_object(out, obj)
    return out


def _agree(error: str | None, prefix: str, exception: type[Exception] = CheckpointingException) -> None:
    """Shares every rank's error (None for none): all ranks raise the same exception or none does."""
    errors = sorted({e for e in _all_gather(error) if e})
    if errors:
        raise exception(prefix + "; ".join(errors))


# What a save's steps may raise: DCP's own exception is a BaseException.
_FAILURES = (Exception, _DCPException)


def os_error_behind(e: BaseException) -> BaseException:
    """The OSError a failed write raised, else ``e``. torch's zip writer turns the file's OSError
    (a full disk's ENOSPC) into ``RuntimeError: ... unexpected pos 704 vs 598``, the OSError only in
    that exception's context: the user is told the disk is full, not the writer's offsets."""
    seen: BaseException | None = e
    while isinstance(seen, (RuntimeError, OSError)):
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def _describe(e: BaseException) -> str:
    """One line for an error: DCP's per-rank failures without their tracebacks."""
    if isinstance(e, CheckpointingException):
        return str(e)
    if isinstance(e, _DCPException):
        return "; ".join(f"rank {r}: {_describe(exc)}" for r, (exc, _) in sorted(e.failures.items()))
    e = os_error_behind(e)
    return f"{type(e).__name__}: {e}"
