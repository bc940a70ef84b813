"""What a rank says when a collective or a pipeline exchange fails.

A rank whose peer died or stopped fails in the collective it was waiting in: at once when the peer's
connection closes (a killed process), after the group's timeout when it stays open (a stopped or
hung one). The backend's own message names neither the operation nor the group. Every collective and
exchange the library issues, in Python and in C++, reports its failure through
:func:`failure_message`, the one place that writes such a message:

    all-reduce in the forward of reduce_from_tensor_model_parallel_region of a float64 tensor of
    shape [2, 16, 32] over the tensor-model-parallel group (global ranks [0, 1], gloo) failed on
    global rank 0, waiting for global rank 1: <the backend's message>

and raises it as ``torch.distributed.DistBackendError`` (a ``RuntimeError``), with the backend's
exception as its cause in Python. A group is named by its ``group_desc`` (``parallel_state`` gives
its groups Megatron-core's, ``TENSOR_MODEL_PARALLEL_GROUP`` read as "tensor-model-parallel group"),
else by its c10d name. A point-to-point transfer names its peer; a collective names the group's
other ranks, any of which may be the one that is gone.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["describe_group", "failure_message", "reported", "ReportedWork"]


def _group_title(group: dist.ProcessGroup) -> str:
    desc = getattr(group, "group_desc", "") or ""
    if group is dist.group.WORLD or desc == "default_pg":
        return "default process group"
    if re.fullmatch(r"[A-Z0-9_]+", desc):  # Megatron-core's style: TENSOR_MODEL_PARALLEL_GROUP
        words = [w for w in desc.lower().split("_") if w != "group"]
        return "-".join(words) + " group"
    if desc and desc != "undefined":
        return f"process group {desc!r}"
    return f"process group {group.group_name!r}"


def describe_group(group: dist.ProcessGroup | None) -> str:
    """``"the tensor-model-parallel group (global ranks [0, 1], gloo)"``; None is the default
    group."""
    group = group if group is not None else dist.group.WORLD
    try:
        ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):  # a group this process no longer (or never) held
        return f"the {_group_title(group)}"
    return f"the {_group_title(group)} (global ranks {ranks}, {backend})"


def _describe_tensor(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    where = "" if tensor.device.type == "cpu" else f" on {tensor.device}"
    return f"a {dtype} tensor of shape {list(tensor.shape)}{where}"


def failure_message(
    operation: str,
    group: dist.ProcessGroup | None,
    error: BaseException | str,
    *,
    tensor: torch.Tensor | None = None,
    peer: int | Sequence[int] | None = None,
    waiting: bool = True,
) -> str:
    """The message of a failed ``operation`` over ``group``: what it moved (``tensor``), the group
    (description and global ranks), this rank, whom it was waiting for (the global rank(s)
    ``peer`` of a point-to-point transfer, else the group's other ranks; nothing when ``waiting``
    is False, as for a call the backend refused), and the backend's ``error``."""
    group = group if group is not None else dist.group.WORLD
    me = dist.get_rank() if dist.is_initialized() else None
    message = operation
    if tensor is not None:
        message += f" of {_describe_tensor(tensor)}"
    message += f" over {describe_group(group)} failed"
    if me is not None:
        message += f" on global rank {me}"
    if waiting:
        awaited = [peer] if isinstance(peer, int) else list(peer) if peer is not None else None
        if awaited is None:
            with contextlib.suppress(RuntimeError, ValueError):
                awaited = [r for r in dist.get_process_group_ranks(group) if r != me]
        if awaited:
            message += f", waiting for global rank {awaited[0]}" if len(awaited) == 1 else \
                f", waiting for global ranks {awaited}"
    return f"{message}: {str(error).strip()}"


def _failure_message_of_group_name(
    operation: str, group_name: str, tensor: torch.Tensor | None, error: str, waiting: bool
) -> str:
    """failure_message for the C++ collectives (csrc/comm/functional.cpp), which know the group by
    its c10d name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except Exception:  # noqa: BLE001  (a name no longer registered: say what is known)
        return f"{operation} over process group {group_name!r} failed: {error}"
    return failure_message(operation, group, error, tensor=tensor, waiting=waiting)


@contextlib.contextmanager
def reported(
    operation: str,
    group: dist.ProcessGroup | None,
    *,
    tensor: torch.Tensor | None = None,
    peer: int | Sequence[int] | None = None,
) -> Iterator[None]:
    """Runs a blocking collective or transfer; a backend failure inside is raised again as
    ``DistBackendError(failure_message(...))`` from the original."""
    try:
        yield
    except RuntimeError as e:
        # A NotImplementedError is the caller's; a message of ours passes unchanged.
        if isinstance(e, NotImplementedError) or getattr(e, "_megatron_ext_reported", False):
            raise
        error = dist.DistBackendError(failure_message(operation, group, e, tensor=tensor, peer=peer))
        error._megatron_ext_reported = True
        raise error from e


class ReportedWork:
    """An asynchronous collective's or transfer's work whose ``wait()`` reports a failure as
    :func:`reported` does; everything else is the work's."""

    def __init__(
        self,
        work: Any,
        operation: str,
        group: dist.ProcessGroup | None,
        *,
        tensor: torch.Tensor | None = None,
        peer: int | Sequence[int] | None = None,
    ) -> None:
        self.work = work
        self.operation = operation
        self.group = group
        self.tensor = tensor
        self.peer = peer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with reported(self.operation, self.group, tensor=self.tensor, peer=self.peer):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)
