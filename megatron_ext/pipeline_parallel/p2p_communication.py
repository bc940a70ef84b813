"""Point-to-point communication between adjacent stages of this rank's pipeline.

Activations travel forward (stage k to k + 1), their gradients backward (k + 1 to k). Every
message has the shape the receiver expects, ``[s, b, h]`` (``s = seq_length // tp`` under sequence
parallelism), and the dtype ``config.pipeline_dtype`` (else ``config.params_dtype``, else float32);
with ``config.variable_seq_lengths`` the three dimensions are exchanged first.

The functions take the same arguments as Megatron-core's. ``is_first_stage`` / ``is_last_stage``
(the newer Megatron-core signature) default to what parallel_state says about this rank. A
function whose transfer does not exist at this end of the pipeline (receiving forward on the first
stage, sending forward from the last, ...) does nothing and returns None.

Each call posts all its sends and receives before waiting on any of them, so two neighbours that
call matching functions (``send_forward_recv_backward`` on stage k, ``send_backward_recv_forward``
on stage k + 1) cannot deadlock, on NCCL or gloo.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ext import parallel_state

Shape = Sequence[int]

# Shapes exchanged under variable_seq_lengths always have this many dimensions ([s, b, h]).
_SHAPE_DIMS = 3


def pipeline_dtype(config: Any) -> torch.dtype:
    """The dtype of tensors sent between stages: ``pipeline_dtype``, else ``params_dtype``, else
    float32."""
    for name in ("pipeline_dtype", "params_dtype"):
        dtype = getattr(config, name, None)
        if dtype is not None:
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"config.{name} must be a torch.dtype, got {dtype!r}")
            return dtype
    return torch.float32


def communication_device() -> torch.device:
    """The current CUDA device when the pipeline group runs on NCCL, else the CPU."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_shape(tensor_shape: Shape | None, config: Any) -> None:
    if getattr(config, "variable_seq_lengths", False):
        return
    if tensor_shape is None or not all(isinstance(d, int) and d >= 0 for d in tensor_shape):
        raise ValueError(
            f"tensor_shape must be a sequence of non-negative integers, got {tensor_shape!r}"
        )


def _check_sent(tensor: torch.Tensor, what: str, config: Any) -> None:
    """The receiver allocates its buffer from its own config, so a mismatch would corrupt data."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    dtype = pipeline_dtype(config)
    if tensor.dtype != dtype:
        raise TypeError(
            f"{what} has dtype {tensor.dtype} but the pipeline communicates {dtype} "
            "(config.pipeline_dtype / config.params_dtype)"
        )
    if getattr(config, "variable_seq_lengths", False) and tensor.dim() != _SHAPE_DIMS:
        raise ValueError(
            f"{what} must have {_SHAPE_DIMS} dimensions [s, b, h] under variable_seq_lengths, "
            f"got shape {tuple(tensor.shape)}"
        )


def _post(ops: list[tuple[Any, torch.Tensor, int]], group: dist.ProcessGroup, batch: bool) -> None:
    """Posts every (isend | irecv, tensor, peer) and then waits for all of them."""
    if not ops:
        return
    if batch:
        reqs = dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for op, t, peer in ops])
    else:
        reqs = [op(t, peer, group=group) for op, t, peer in ops]
    for req in reqs:
        req.wait()


def _exchange_shapes(
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    config: Any,
) -> tuple[list[int] | None, list[int] | None]:
    device = communication_device()
    sends, recvs = {}, {}
    for direction, tensor in (("next", tensor_send_next), ("prev", tensor_send_prev)):
        if tensor is not None:
            sends[direction] = torch.tensor(tensor.shape, dtype=torch.int64, device=device)
    for direction, wanted in (("prev", recv_prev), ("next", recv_next)):
        if wanted:
            recvs[direction] = torch.empty(_SHAPE_DIMS, dtype=torch.int64, device=device)
    _transfer(sends, recvs, config)
    shape_prev = recvs["prev"].tolist() if "prev" in recvs else None
    shape_next = recvs["next"].tolist() if "next" in recvs else None
    return shape_prev, shape_next


def _transfer(sends: dict[str, torch.Tensor], recvs: dict[str, torch.Tensor], config: Any) -> None:
    group = parallel_state.get_pipeline_model_parallel_group()
    peer = {
        "next": parallel_state.get_pipeline_model_parallel_next_rank(),
        "prev": parallel_state.get_pipeline_model_parallel_prev_rank(),
    }
    ops = [(dist.isend, t, peer[d]) for d, t in sends.items()]
    ops += [(dist.irecv, t, peer[d]) for d, t in recvs.items()]
    _post(ops, group, batch=bool(getattr(config, "batch_p2p_comm", True)))


def _communicate(
    *,
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape | None,
    config: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sends to the next / previous stage and receives from the previous / next stage at once.

    Returns ``(tensor_recv_prev, tensor_recv_next)``, None where nothing was received. What
    comes from the previous stage is an activation and requires grad: its ``.grad`` is what this
    stage's backward sends back.
    """
    _check_shape(tensor_shape, config)
    if tensor_send_next is not None:
        _check_sent(tensor_send_next, "the tensor sent to the next stage", config)
    if tensor_send_prev is not None:
        _check_sent(tensor_send_prev, "the tensor sent to the previous stage", config)

    shape_prev = shape_next = tensor_shape
    if getattr(config, "variable_seq_lengths", False):
        shape_prev, shape_next = _exchange_shapes(
            tensor_send_next, tensor_send_prev, recv_prev, recv_next, config
        )

    dtype, device = pipeline_dtype(config), communication_device()
    recvs: dict[str, torch.Tensor] = {}
    if recv_prev:
        recvs["prev"] = torch.empty(tuple(shape_prev), dtype=dtype, device=device)
    if recv_next:
        recvs["next"] = torch.empty(tuple(shape_next), dtype=dtype, device=device)
    sends: dict[str, torch.Tensor] = {}
    # Autograd-tracked outputs are sent by value; gloo and NCCL want contiguous buffers.
    if tensor_send_next is not None:
        sends["next"] = tensor_send_next.detach().contiguous()
    if tensor_send_prev is not None:
        sends["prev"] = tensor_send_prev.detach().contiguous()
    _transfer(sends, recvs, config)

    if "prev" in recvs and recvs["prev"].is_floating_point():
        recvs["prev"].requires_grad_()
    return recvs.get("prev"), recvs.get("next")


def _first(is_first_stage: bool | None) -> bool:
    return parallel_state.is_pipeline_first_stage() if is_first_stage is None else is_first_stage


def _last(is_last_stage: bool | None) -> bool:
    return parallel_state.is_pipeline_last_stage() if is_last_stage is None else is_last_stage


def recv_forward(
    tensor_shape: Shape, config: Any, is_first_stage: bool | None = None
) -> torch.Tensor | None:
    """Receives the activation from the previous stage (None on the first stage)."""
    if _first(is_first_stage):
        return None
    recv, _ = _communicate(
        tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )
    return recv


def recv_backward(
    tensor_shape: Shape, config: Any, is_last_stage: bool | None = None
) -> torch.Tensor | None:
    """Receives the gradient of this stage's output from the next stage (None on the last)."""
    if _last(is_last_stage):
        return None
    _, recv = _communicate(
        tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
        tensor_shape=tensor_shape, config=config,
    )
    return recv


def send_forward(
    output_tensor: torch.Tensor, config: Any, is_last_stage: bool | None = None
) -> None:
    """Sends this stage's output to the next stage (nothing on the last stage)."""
    if _last(is_last_stage):
        return
    _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
        tensor_shape=None if getattr(config, "variable_seq_lengths", False) else output_tensor.shape,
        config=config,
    )


def send_backward(
    input_tensor_grad: torch.Tensor, config: Any, is_first_stage: bool | None = None
) -> None:
    """Sends the gradient of this stage's input to the previous stage (nothing on the first)."""
    if _first(is_first_stage):
        return
    _communicate(
        tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=False,
        tensor_shape=None if getattr(config, "variable_seq_lengths", False) else input_tensor_grad.shape,
        config=config,
    )


def send_forward_recv_backward(
    output_tensor: torch.Tensor, tensor_shape: Shape, config: Any, is_last_stage: bool | None = None
) -> torch.Tensor | None:
    """Sends this stage's output forward and receives its gradient back (None on the last stage)."""
    if _last(is_last_stage):
        return None
    _, recv = _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=True,
        tensor_shape=tensor_shape, config=config,
    )
    return recv


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    config: Any,
    is_first_stage: bool | None = None,
) -> torch.Tensor | None:
    """Sends the input gradient backward and receives the next activation (None on the first
    stage)."""
    if _first(is_first_stage):
        return None
    recv, _ = _communicate(
        tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )
    return recv


def send_forward_recv_forward(
    output_tensor: torch.Tensor | None, recv_prev: bool, tensor_shape: Shape, config: Any
) -> torch.Tensor | None:
    """Sends to the next rank of the pipeline ring and, if ``recv_prev``, receives from the
    previous one. The ring wraps around (the last stage's next is the first), as the interleaved
    schedule needs; the caller decides what to skip."""
    recv, _ = _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )
    return recv


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor | None, recv_next: bool, tensor_shape: Shape, config: Any
) -> torch.Tensor | None:
    """Sends to the previous rank of the pipeline ring and, if ``recv_next``, receives from the
    next one (the ring wraps around, as in send_forward_recv_forward)."""
    _, recv = _communicate(
        tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=recv_next,
        tensor_shape=tensor_shape, config=config,
    )
    return recv
