"""The one runner of every schedule: a pipeline rank's table of typed actions (``F``, ``B``, ``I``,
``W``; ``schedule_tables``) placed on a clock shared by all ranks (``plan_schedule``), each action
run by the micro-batch steps (``microbatch_step``) or the split backward (``split_backward``), and
what each tick produced exchanged with the neighbours. What a run needs besides its tables is one
``RunOptions``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from megatron_ext.comm_errors import ReportedWork
from megatron_ext.pipeline_parallel.microbatch_step import (
    _DISCONNECTED,
    ForwardStepFunc,
    _check_output,
    _deallocates,
    _scaled_loss,
    _timed,
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron_ext.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_ext.pipeline_parallel.schedule_tables import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    plan_schedule,
    stage_location,
    virtual_stage,
)
from megatron_ext.process_groups_config import ProcessGroupCollection
from megatron_ext.resolve import group_rank, group_size
from megatron_ext.split_backward import backward_input, backward_weight


@dataclass
class RunOptions:
    """What a schedule's run takes besides its tables: the user's step function, one data iterator
    and one model chunk per chunk, ``num_microbatches``, the model's ``config``, the shape of the
    activations sent between stages (None with one stage), the pipeline's communicator (None with
    one stage), the context-parallel size the loss is scaled by, Megatron-core's
    ``forward_only`` / ``collect_non_loss_data`` / ``first_val_step``, and how chunks map to
    virtual stages (``layout``: ``"interleaved"`` or ``"v"``)."""

    forward_step_func: ForwardStepFunc
    data_iterators: list
    model_chunks: list[torch.nn.Module]
    num_microbatches: int
    config: Any
    tensor_shape: Sequence[int] | None
    p2p_communicator: P2PCommunicator | None
    cp_group_size: int
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: bool | None = None
    layout: str = "interleaved"


class _GradSync:
    """Holds ``config.no_sync_func()`` (one factory, or one per chunk) open between backwards
    that must not reduce gradients yet."""

    def __init__(self, config: Any) -> None:
        factory = getattr(config, "no_sync_func", None)
        if isinstance(factory, (list, tuple)):
            factories = list(factory)

            def factory() -> contextlib.ExitStack:
                stack = contextlib.ExitStack()
                for f in factories:
                    stack.enter_context(f())
                return stack

        self._factory = factory
        self._context = None

    def disable(self) -> None:
        if self._factory is not None and self._context is None:
            self._context = self._factory()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)


def _finalize(
    chunks: list[torch.nn.Module], config: Any, forward_only: bool, total_tokens: int,
    pg_collection: ProcessGroupCollection | None, force_all_reduce: bool | None,
) -> None:
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is None or forward_only:
        return
    args: list = [chunks]
    if getattr(config, "calculate_per_token_loss", False):
        args.append(torch.tensor(total_tokens, dtype=torch.int))
    # Megatron-core passes these two keywords; finalizers written for the older signature take
    # neither, so they are passed only when the caller set them.
    kwargs: dict[str, Any] = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    if force_all_reduce:
        kwargs["force_all_reduce"] = True
    finalize(*args, **kwargs)


def _per_chunk(config: Any, name: str, num_chunks: int) -> list[Callable] | None:
    """``config.<name>``: None, one callable for every chunk, or a list of one per chunk."""
    funcs = getattr(config, name, None)
    if funcs is None:
        return None
    if isinstance(funcs, (list, tuple)):
        if len(funcs) != num_chunks:
            raise ValueError(f"config.{name} is a list of {len(funcs)} for {num_chunks} model chunks")
        return list(funcs)
    return [funcs] * num_chunks


class _RankRun:
    """This rank's run of its table: the work of each action kind, the gradient-sync hooks around
    the backwards, and the exchange with the neighbours after each tick of the plan."""

    def __init__(self, tables: Sequence[Sequence[Action]], options: RunOptions) -> None:
        self.options = o = options
        pp_group = None if o.p2p_communicator is None else o.p2p_communicator.pp_group
        self.pp_size, self.pp_rank = group_size(pp_group), group_rank(pp_group)
        if len(tables) != self.pp_size:
            raise ValueError(f"got {len(tables)} schedule tables for a pipeline of {self.pp_size} stages")
        self.num_chunks = len(o.model_chunks)
        self.num_stages = self.pp_size * self.num_chunks
        self.plan = plan_schedule(tables, self.num_chunks, o.layout)
        self.table = [a for a in self.plan[self.pp_rank] if a is not None]

        forwards = [(a.microbatch, a.chunk) for a in self.table if a.kind == FORWARD]
        self.first_forward = {c: mb for mb, c in reversed(forwards)}
        # The action after which a chunk's weight gradients are complete: its last B or W.
        self.last_weight_grad = {a.chunk: a.microbatch for a in self.table
                                 if a.kind in (BACKWARD, BACKWARD_WEIGHT)}
        # Megatron-core's partial activation checkpointing window: the warm-up plus one.
        self.partial = getattr(o.config, "num_microbatches_with_partial_activation_checkpoints", None)
        self.window = None
        if self.partial is not None:
            warmup = next((i for i, a in enumerate(self.table) if a.kind != FORWARD), len(forwards))
            self.window = warmup + 1
        self.store: list = []
        self.total_tokens = 0
        self.num_forwards = 0
        # Received (or handed on locally) activations and gradients with their receive request,
        # waited for when an action needs them.
        self.inputs: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
        self.grads: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
        self.in_flight: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.deferred: dict[tuple[int, int], Any] = {}
        # Sends are not waited for when posted (a rank goes on with its next action while its
        # neighbour finishes its own); all are waited for before the schedule returns.
        self.pending_sends: list[Any] = []
        self.sync = _GradSync(o.config)
        self.grad_sync = None if o.forward_only else _per_chunk(o.config, "grad_sync_func", self.num_chunks)
        self.param_sync = (None if o.forward_only or self.num_chunks == 1
                           else _per_chunk(o.config, "param_sync_func", self.num_chunks))

    def stage(self, chunk: int) -> int:
        return virtual_stage(self.pp_rank, chunk, self.pp_size, self.options.layout)

    def run(self) -> tuple[list, int]:
        self.sync.disable()
        try:
            for tick, action in enumerate(self.plan[self.pp_rank]):
                produced = None
                if action is not None:
                    produced = self.ACTIONS[action.kind](self, action.microbatch, action.chunk)
                self.exchange(tick, action, produced)
            for send in self.pending_sends:
                send.wait()
        finally:
            self.sync.enable()
        return self.store, self.total_tokens

    # The work of each kind -----------------------------------------------------------------

    def forward(self, mb: int, chunk: int) -> torch.Tensor | None:
        """Runs F; returns the activation for the next stage (None on the last)."""
        o = self.options
        s = self.stage(chunk)
        if self.param_sync is not None and self.first_forward[chunk] == mb:
            self.param_sync[chunk](o.model_chunks[chunk].parameters())
        input_tensor = self.take(self.inputs, mb, chunk).requires_grad_() if s > 0 else None
        checkpoint = None if self.window is None else (self.num_forwards % self.window >= self.partial)
        self.num_forwards += 1
        output_tensor, num_tokens = forward_step(
            o.forward_step_func, o.data_iterators[chunk], o.model_chunks[chunk],
            o.num_microbatches, input_tensor, self.store, o.config, o.cp_group_size,
            o.collect_non_loss_data, checkpoint,
            is_first_microbatch=check_first_val_step(
                o.first_val_step, o.forward_only, self.first_forward[chunk] == mb),
            current_microbatch=mb, vp_stage=chunk if self.num_chunks > 1 else None,
            is_last_stage=s == self.num_stages - 1,
        )
        self.total_tokens += int(num_tokens)
        if not o.forward_only:
            self.in_flight[(mb, chunk)] = (input_tensor, output_tensor)
        if s == self.num_stages - 1:
            return None
        _check_output(output_tensor, o.tensor_shape, o.config,
                      f"pipeline rank {self.pp_rank} chunk {chunk}")
        return output_tensor

    def backward(self, mb: int, chunk: int) -> torch.Tensor | None:
        """Runs B; returns the gradient for the previous stage (None on the first)."""
        input_tensor, output_tensor = self.in_flight.pop((mb, chunk))
        with self.grad_sync_around(mb, chunk):
            input_grad = backward_step(input_tensor, output_tensor, self.output_grad(mb, chunk), None,
                                       self.options.config)
        return input_grad if self.stage(chunk) > 0 else None

    def backward_input(self, mb: int, chunk: int) -> torch.Tensor | None:
        """Runs I: the input gradient only, the weight gradients deferred to W."""
        input_tensor, output_tensor = self.in_flight.pop((mb, chunk))
        output_grad = self.output_grad(mb, chunk)
        output_tensor = _scaled_loss(output_tensor, output_grad, self.options.config)
        with _timed(self.options.config, "backward-compute", 2):
            (input_grad,), self.deferred[(mb, chunk)] = backward_input(
                [output_tensor], [output_grad], [input_tensor])
        if input_tensor is not None and input_grad is None and output_tensor.requires_grad:
            raise RuntimeError(_DISCONNECTED)
        return input_grad if self.stage(chunk) > 0 else None

    def backward_weight(self, mb: int, chunk: int) -> None:
        """Runs W: the weight gradients that I deferred, with the gradient-sync hooks."""
        with self.grad_sync_around(mb, chunk), _timed(self.options.config, "backward-compute", 2):
            backward_weight(self.deferred.pop((mb, chunk)))

    ACTIONS = {FORWARD: forward, BACKWARD: backward, BACKWARD_INPUT: backward_input,
               BACKWARD_WEIGHT: backward_weight}

    def output_grad(self, mb: int, chunk: int) -> torch.Tensor | None:
        return self.take(self.grads, mb, chunk) if self.stage(chunk) < self.num_stages - 1 else None

    @contextlib.contextmanager
    def grad_sync_around(self, mb: int, chunk: int):
        """Gradients are reduced only by a chunk's last weight-gradient action (B or W): every
        other runs inside ``no_sync``. A custom ``grad_sync_func`` starts the chunk's reduction
        after that action instead, as in Megatron-core."""
        last = self.last_weight_grad[chunk] == mb
        if last and self.grad_sync is None:
            self.sync.enable()
        yield
        if last and self.grad_sync is not None:
            self.sync.enable()
            self.grad_sync[chunk](self.options.model_chunks[chunk].parameters())
        self.sync.disable()

    # The exchange --------------------------------------------------------------------------

    def destination(self, rank: int, action: Action | None) -> tuple[int, int, bool] | None:
        """Where what ``action`` of ``rank`` makes goes: ``(rank, chunk, is_activation)``."""
        if action is None or action.kind == BACKWARD_WEIGHT:
            return None
        s = virtual_stage(rank, action.chunk, self.pp_size, self.options.layout)
        if action.kind == FORWARD:
            if s == self.num_stages - 1:
                return None
            return (*stage_location(s + 1, self.pp_size, self.options.layout), True)
        if s == 0:
            return None
        return (*stage_location(s - 1, self.pp_size, self.options.layout), False)

    def exchange(self, tick: int, action: Action | None, produced: torch.Tensor | None) -> None:
        """Hands on what this tick made and posts the receives of what the neighbours made for
        this rank. Neither is waited for here: a send before the schedule returns, a receive when
        an action needs it, so a rank only waits for what it needs next."""
        send_next = send_prev = None
        dest = self.destination(self.pp_rank, action)
        if dest is not None and produced is not None:
            rank, chunk, is_activation = dest
            if rank == self.pp_rank:
                (self.inputs if is_activation else self.grads)[(action.microbatch, chunk)] = (produced, None)
            elif rank == (self.pp_rank + 1) % self.pp_size:
                send_next = produced
            else:
                send_prev = produced
        incoming: dict[str, tuple[int, int, int, bool]] = {}
        for side, rank in (("prev", (self.pp_rank - 1) % self.pp_size),
                           ("next", (self.pp_rank + 1) % self.pp_size)):
            if rank == self.pp_rank or any(rank == r for r, *_ in incoming.values()):
                continue  # one stage; or two, where the previous and the next rank are one
            neighbour = self.plan[rank][tick]
            where = self.destination(rank, neighbour)
            if where is not None and where[0] == self.pp_rank:
                incoming[side] = (rank, neighbour.microbatch, where[1], where[2])
        if send_next is None and send_prev is None and not incoming:
            return
        from_prev, from_next, requests = self.options.p2p_communicator.exchange(
            send_next, send_prev, "prev" in incoming, "next" in incoming, self.options.tensor_shape)
        self.pending_sends += [requests[name] for name in ("send_next", "send_prev") if name in requests]
        for side, tensor in (("prev", from_prev), ("next", from_next)):
            if side in incoming:
                _, mb, chunk, is_activation = incoming[side]
                store = self.inputs if is_activation else self.grads
                request = requests[f"recv_{side}"]
                if isinstance(request, ReportedWork) and request.tensor is not None:  # this receive's own
                    kind = "activation" if is_activation else "gradient"
                    request.operation += f" (the {kind} of micro-batch {mb}, model chunk {chunk})"
                store[(mb, chunk)] = (tensor, request)
        sent = send_next if send_next is not None else send_prev
        if sent is not None and dest[2] and not self.options.forward_only:
            deallocate_output_tensor(sent, _deallocates(self.options.config))

    @staticmethod
    def take(store: dict, mb: int, chunk: int) -> torch.Tensor:
        """The activation or gradient for (mb, chunk), its receive waited for, detached."""
        tensor, request = store.pop((mb, chunk))
        if request is not None:
            request.wait()
        return tensor.detach()


def run_schedule(tables: Sequence[Sequence[Action]], options: RunOptions) -> tuple[list, int]:
    """Runs this rank's table (``tables[pp_rank]``) against its neighbours'.

    ``tables`` holds the table of every rank of the pipeline group (``options.p2p_communicator``'s;
    one table and no communicator for a single stage); ``options.layout`` maps model chunks to
    virtual stages (``schedule_tables.virtual_stage``). Every rank plans every rank's table
    (``plan_schedule``), so each knows what its neighbours send at each tick: sends and receives
    always pair up. Returns ``(forward_data_store, total_num_tokens)``.
    """
    return _RankRun(tables, options).run()
