"""Point-to-point communication between adjacent stages of a pipeline.

Activations travel forward (stage k to k + 1), their gradients backward (k + 1 to k). Every
message has the shape the receiver expects, ``[s, b, h]`` (``s = seq_length // tp`` under sequence
parallelism), and the dtype ``config.pipeline_dtype`` (else ``config.params_dtype``, else float32);
with ``config.variable_seq_lengths`` the three dimensions are exchanged first.

``P2PCommunicator(pp_group, config)`` is Megatron-core 0.16's class: it talks to the neighbours of
this rank in ``pp_group`` (any process group, so custom pipelines work) and its methods take
Megatron's arguments. The module-level functions (``recv_forward(tensor_shape, config)``, ...) are
the older Megatron-core interface over the pipeline group of ``parallel_state``;
``is_first_stage`` / ``is_last_stage`` default there to what parallel_state says about this rank.
A transfer that does not exist at this end of the pipeline (receiving forward on the first stage,
sending forward from the last, ...) does nothing and returns None.

Each call posts all its sends and receives before waiting on any of them, so two neighbours that
make matching calls (``send_forward_recv_backward`` on stage k, ``send_backward_recv_forward``
on stage k + 1) cannot deadlock, on NCCL or gloo. Sends are posted before receives, the one to
the next stage first, and receives from the previous stage before those from the next: with two
stages (where previous and next are the same rank) an activation and a gradient exchanged in one
call are therefore matched in the same order on both ends.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.comm_errors import ReportedWork, reported
from megatron_ext.tensor_parallel.utils import comm_device
from megatron_ext.resolve import default_group

Shape = Union[list[int], torch.Size]

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


def is_single_shape(x: Any) -> bool:
    """Whether ``x`` is one shape (a ``torch.Size`` or a non-empty sequence of ints) rather than a
    list of shapes."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(d, int) for d in x)


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


class _AllOf:
    """The requests of one coalesced batch, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class P2PCommunicator:
    """Sends and receives between this rank and its neighbours in ``pp_group``.

    ``next_rank`` / ``prev_rank`` are the global ranks of the next and previous members of
    ``pp_group``; the pipeline is a ring (the last stage's next is the first), as the interleaved
    schedule needs. ``virtual_pipeline_model_parallel_size`` is read from ``config``.
    """

    def __init__(self, pp_group: dist.ProcessGroup, config: Any) -> None:
        if pp_group is None:
            raise ValueError("P2PCommunicator needs a pipeline process group, got None")
        self.pp_group = pp_group
        self.config = config
        size, rank = pp_group.size(), pp_group.rank()
        self.next_rank: int | None = dist.get_global_rank(pp_group, (rank + 1) % size)
        self.prev_rank: int | None = dist.get_global_rank(pp_group, (rank - 1) % size)
        self.virtual_pipeline_model_parallel_size = getattr(
            config, "virtual_pipeline_model_parallel_size", None
        )

    # Transport ---------------------------------------------------------------------------

    def _post(
        self,
        sends: dict[str, torch.Tensor],
        recvs: dict[str, torch.Tensor],
        wait: bool = True,
    ) -> dict[str, Any]:
        """Posts the sends (next, then prev) and receives (prev, then next); waits for all of them
        unless ``wait`` is False, in which case the requests are returned by name
        (``"send_next"``, ``"recv_prev"``, ...)."""
        neighbour = {"next": self.next_rank, "prev": self.prev_rank}
        named = [(f"send_{d}", dist.isend, sends[d], neighbour[d]) for d in ("next", "prev") if d in sends]
        named += [(f"recv_{d}", dist.irecv, recvs[d], neighbour[d]) for d in ("prev", "next") if d in recvs]
        if not named:
            return {}
        # A failure names the transfer, the group and the peer (megatron_ext.comm_errors). The peer
        # by its pipeline rank: with two stages the previous and the next are one rank.
        pp_rank = {"next": (self.pp_group.rank() + 1) % self.pp_group.size(),
                   "prev": (self.pp_group.rank() - 1) % self.pp_group.size()}
        what = {name: f"{'send to' if name.startswith('send') else 'receive from'} pipeline rank "
                      f"{pp_rank[name[5:]]}" for name, *_ in named}
        peers = sorted({p for *_, p in named})
        peer = peers[0] if len(peers) == 1 else peers
        exchange = "pipeline exchange (" + "; ".join(what.values()) + ")"
        # On NCCL every transfer goes in one batch, whatever batch_p2p_comm says: sends posted one
        # by one before the receives deadlock there (a send waits for its receive, queued behind
        # the peer's own send). NCCL may coalesce a batch into one request: each name waits on it.
        on_gpu = any(t.is_cuda for _, _, t, _ in named)
        if on_gpu or (wait and bool(getattr(self.config, "batch_p2p_comm", True))):
            ops = [dist.P2POp(op, t, p, self.pp_group) for _, op, t, p in named]
            with reported(exchange, self.pp_group, peer=peer):
                works = dist.batch_isend_irecv(ops)
            if len(works) == len(named):
                reqs = {n: ReportedWork(w, what[n], self.pp_group, tensor=t, peer=p)
                        for (n, _, t, p), w in zip(named, works)}
            else:
                together = ReportedWork(_AllOf(works), exchange, self.pp_group, peer=peer)
                reqs = {n: together for n, *_ in named}
        else:
            reqs = {}
            for name, op, t, p in named:
                with reported(what[name], self.pp_group, tensor=t, peer=p):
                    reqs[name] = ReportedWork(op(t, p, group=self.pp_group), what[name], self.pp_group,
                                              tensor=t, peer=p)
        if wait:
            for req in reqs.values():
                req.wait()
            return {}
        return reqs

    def _communicate_shapes(
        self,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
    ) -> tuple[list[int], list[int]]:
        """Exchanges the shapes of the tensors about to be sent (for variable sequence lengths).
        Returns ``(recv_prev_shape, recv_next_shape)``, ``[0, 0, 0]`` where nothing is received."""
        device = comm_device(self.pp_group)
        sends, recvs = {}, {}
        for direction, tensor in (("next", tensor_send_next), ("prev", tensor_send_prev)):
            if tensor is not None:
                sends[direction] = torch.tensor(tensor.shape, dtype=torch.int64, device=device)
        for direction, wanted in (("prev", recv_prev), ("next", recv_next)):
            if wanted:
                recvs[direction] = torch.empty(_SHAPE_DIMS, dtype=torch.int64, device=device)
        self._post(sends, recvs)
        empty = [0] * _SHAPE_DIMS
        return (
            recvs["prev"].tolist() if "prev" in recvs else empty,
            recvs["next"].tolist() if "next" in recvs else empty,
        )

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape | None,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        """Sends to the next / previous stage and receives from the previous / next stage at once.

        Returns ``(tensor_recv_prev, tensor_recv_next, reqs)``: None where nothing was received;
        ``reqs`` is None once waited for, else the pending requests by name. What comes from the
        previous stage is an activation and requires grad: its ``.grad`` is what this stage's
        backward sends back.
        """
        config = self.config
        if recv_prev or recv_next:
            _check_shape(tensor_shape, config)
        if tensor_send_next is not None:
            _check_sent(tensor_send_next, "the tensor sent to the next stage", config)
        if tensor_send_prev is not None:
            _check_sent(tensor_send_prev, "the tensor sent to the previous stage", config)

        shape_prev = shape_next = tensor_shape
        if getattr(config, "variable_seq_lengths", False):
            shape_prev, shape_next = self._communicate_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next
            )

        dtype, device = pipeline_dtype(config), comm_device(self.pp_group)
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
        reqs = self._post(sends, recvs, wait=wait_on_reqs)

        if "prev" in recvs and recvs["prev"].is_floating_point():
            recvs["prev"].requires_grad_()
        return recvs.get("prev"), recvs.get("next"), (None if wait_on_reqs else reqs)

    # Megatron-core's methods --------------------------------------------------------------

    def recv_forward(self, tensor_shapes: Any, is_first_stage: bool) -> Any:
        """Receives the activation(s) from the previous stage (None on the first stage)."""
        single = is_single_shape(tensor_shapes) or tensor_shapes is None
        received = []
        for shape in [tensor_shapes] if single else tensor_shapes:
            if is_first_stage:
                received.append(None)
                continue
            received.append(self._communicate(
                tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
                tensor_shape=shape,
            )[0])
        return received[0] if single else received

    def recv_backward(self, tensor_shapes: Any, is_last_stage: bool) -> Any:
        """Receives the gradient(s) of this stage's output from the next stage (None on the
        last stage)."""
        single = is_single_shape(tensor_shapes) or tensor_shapes is None
        received = []
        for shape in [tensor_shapes] if single else tensor_shapes:
            if is_last_stage:
                received.append(None)
                continue
            received.append(self._communicate(
                tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
                tensor_shape=shape,
            )[1])
        return received[0] if single else received

    def send_forward(self, output_tensors: Any, is_last_stage: bool) -> None:
        """Sends this stage's output(s) to the next stage (nothing on the last stage)."""
        if is_last_stage:
            return
        for tensor in output_tensors if isinstance(output_tensors, list) else [output_tensors]:
            self._communicate(
                tensor_send_next=tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
                tensor_shape=None,
            )

    def send_backward(self, input_tensor_grads: Any, is_first_stage: bool) -> None:
        """Sends the gradient(s) of this stage's input to the previous stage (nothing on the
        first stage)."""
        if is_first_stage:
            return
        grads = input_tensor_grads if isinstance(input_tensor_grads, list) else [input_tensor_grads]
        for tensor in grads:
            self._communicate(
                tensor_send_next=None, tensor_send_prev=tensor, recv_prev=False, recv_next=False,
                tensor_shape=None,
            )

    def send_forward_recv_backward(self, output_tensors: Any, tensor_shapes: Any, is_last_stage: bool) -> Any:
        """Sends this stage's output(s) forward and receives their gradient(s) back (None on the
        last stage)."""
        single = not isinstance(output_tensors, list)
        outputs = [output_tensors] if single else output_tensors
        shapes = tensor_shapes if isinstance(tensor_shapes, list) and not single else [tensor_shapes]
        received = []
        for tensor, shape in zip(outputs, shapes):
            if is_last_stage:
                received.append(None)
                continue
            received.append(self._communicate(
                tensor_send_next=tensor, tensor_send_prev=None, recv_prev=False, recv_next=True,
                tensor_shape=shape,
            )[1])
        return received[0] if single else received

    def send_backward_recv_forward(
        self, input_tensor_grads: Any, tensor_shapes: Any, is_first_stage: bool
    ) -> Any:
        """Sends the input gradient(s) backward and receives the next activation(s) (None on the
        first stage)."""
        single = not isinstance(input_tensor_grads, list)
        grads = [input_tensor_grads] if single else input_tensor_grads
        shapes = tensor_shapes if isinstance(tensor_shapes, list) and not single else [tensor_shapes]
        received = []
        for tensor, shape in zip(grads, shapes):
            if is_first_stage:
                received.append(None)
                continue
            received.append(self._communicate(
                tensor_send_next=None, tensor_send_prev=tensor, recv_prev=True, recv_next=False,
                tensor_shape=shape,
            )[0])
        return received[0] if single else received

    def send_forward_recv_forward(
        self,
        output_tensor: torch.Tensor | None,
        recv_prev: bool,
        tensor_shape: Shape | None,
        overlap_p2p_comm: bool = False,
    ) -> Any:
        """Sends to the next rank of the ring and, if ``recv_prev``, receives from the previous
        one. With ``overlap_p2p_comm`` returns ``(tensor, requests)`` without waiting."""
        received, _, reqs = self._communicate(
            tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev,
            recv_next=False, tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm,
        )
        return (received, reqs) if overlap_p2p_comm else received

    def send_backward_recv_backward(
        self,
        input_tensor_grad: torch.Tensor | None,
        recv_next: bool,
        tensor_shape: Shape | None,
        overlap_p2p_comm: bool = False,
    ) -> Any:
        """Sends to the previous rank of the ring and, if ``recv_next``, receives from the next
        one. With ``overlap_p2p_comm`` returns ``(tensor, requests)`` without waiting."""
        _, received, reqs = self._communicate(
            tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
            recv_next=recv_next, tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm,
        )
        return (received, reqs) if overlap_p2p_comm else received

    def exchange(
        self,
        send_next: torch.Tensor | None,
        send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """Posts sends to and receives from both neighbours without waiting for any: returns
        ``(buffer from prev, buffer from next, requests by name)`` (``"send_next"``,
        ``"recv_prev"``, ...). A buffer holds its data once its request is waited for; the caller
        keeps the send requests (and so the sent tensors) until it waits for them."""
        received_prev, received_next, reqs = self._communicate(
            tensor_send_next=send_next, tensor_send_prev=send_prev, recv_prev=recv_prev,
            recv_next=recv_next, tensor_shape=tensor_shape, wait_on_reqs=False,
        )
        return received_prev, received_next, reqs or {}

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor | None,
        input_tensor_grad: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One exchange with both neighbours: sends the activation forward and the input gradient
        backward, receives ``(activation from prev, gradient from next)`` as asked."""
        received_prev, received_next, _ = self._communicate(
            tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
            recv_next=recv_next, tensor_shape=tensor_shape,
        )
        return received_prev, received_next


# The module-level interface over parallel_state's pipeline group ---------------------------


def _communicator(config: Any) -> P2PCommunicator:
    return P2PCommunicator(default_group("pp"), config)


def _first(is_first_stage: bool | None) -> bool:
    if is_first_stage is None:
        return parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    return is_first_stage


def _last(is_last_stage: bool | None) -> bool:
    if is_last_stage is None:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return is_last_stage


def _sent_shape(tensor: torch.Tensor, config: Any) -> Shape | None:
    return None if getattr(config, "variable_seq_lengths", False) else tensor.shape


def recv_forward(
    tensor_shape: Shape, config: Any, is_first_stage: bool | None = None
) -> torch.Tensor | None:
    """Receives the activation from the previous stage (None on the first stage)."""
    if _first(is_first_stage):
        return None
    _check_shape(tensor_shape, config)
    return _communicator(config).recv_forward(tensor_shape, False)


def recv_backward(
    tensor_shape: Shape, config: Any, is_last_stage: bool | None = None
) -> torch.Tensor | None:
    """Receives the gradient of this stage's output from the next stage (None on the last)."""
    if _last(is_last_stage):
        return None
    _check_shape(tensor_shape, config)
    return _communicator(config).recv_backward(tensor_shape, False)


def send_forward(output_tensor: torch.Tensor, config: Any, is_last_stage: bool | None = None) -> None:
    """Sends this stage's output to the next stage (nothing on the last stage)."""
    if not _last(is_last_stage):
        _communicator(config).send_forward(output_tensor, False)


def send_backward(input_tensor_grad: torch.Tensor, config: Any, is_first_stage: bool | None = None) -> None:
    """Sends the gradient of this stage's input to the previous stage (nothing on the first)."""
    if not _first(is_first_stage):
        _communicator(config).send_backward(input_tensor_grad, False)


def send_forward_recv_backward(
    output_tensor: torch.Tensor, tensor_shape: Shape, config: Any, is_last_stage: bool | None = None
) -> torch.Tensor | None:
    """Sends this stage's output forward and receives its gradient back (None on the last stage)."""
    if _last(is_last_stage):
        return None
    _check_shape(tensor_shape, config)
    return _communicator(config).send_forward_recv_backward(output_tensor, tensor_shape, False)


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
    _check_shape(tensor_shape, config)
    return _communicator(config).send_backward_recv_forward(input_tensor_grad, tensor_shape, False)


def send_forward_recv_forward(
    output_tensor: torch.Tensor | None, recv_prev: bool, tensor_shape: Shape, config: Any
) -> torch.Tensor | None:
    """Sends to the next rank of the pipeline ring and, if ``recv_prev``, receives from the
    previous one. The ring wraps around (the last stage's next is the first), as the interleaved
    schedule needs; the caller decides what to skip."""
    _check_shape(tensor_shape, config)
    return _communicator(config).send_forward_recv_forward(output_tensor, recv_prev, tensor_shape)


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor | None, recv_next: bool, tensor_shape: Shape, config: Any
) -> torch.Tensor | None:
    """Sends to the previous rank of the pipeline ring and, if ``recv_next``, receives from the
    next one (the ring wraps around, as in send_forward_recv_forward)."""
    _check_shape(tensor_shape, config)
    return _communicator(config).send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape)
