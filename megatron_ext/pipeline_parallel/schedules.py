"""Forward-backward schedules over micro-batches: no pipelining, GPipe, 1F1B, interleaved 1F1B,
ZB-H1 and ZB-V.

Every schedule is called with Megatron-core's keywords::

    losses = forward_backward_func(
        forward_step_func=forward_step, data_iterator=it, model=model,
        num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False)

The contract, as in Megatron-core:

- ``model`` is a ``torch.nn.Module`` (or a list holding one; with a virtual pipeline a list of
  ``v`` model chunks, chunk ``c`` of pipeline rank ``r`` being virtual stage ``c * pp + r``) with
  a ``config`` attribute (a ``ModelParallelConfig`` or any object with its fields; wrappers
  exposing ``.module`` are looked through). With more than one stage it needs
  ``set_input_tensor(tensors)``: before each forward the schedule calls it with a list holding the
  activation received from the previous stage (a leaf tensor that requires grad), or ``[None]`` on
  the first stage, as Megatron-core does.
- ``forward_step_func(data_iterator, model)`` runs one model chunk's forward on one micro-batch and
  returns ``(output_tensor, loss_func)``. Except on the last stage, ``output_tensor`` is the
  ``[s, b, h]`` activation sent on (``s // tp`` under sequence parallelism, dtype
  ``config.pipeline_dtype``). The interleaved schedule takes one data iterator per chunk.
- On the last stage the schedule calls ``loss_func(output_tensor)``, which returns
  ``(loss, reduced)`` or ``(loss, num_tokens, reduced)``. The schedule divides ``loss`` by
  ``num_microbatches`` (and, for the 3-tuple, first by ``num_tokens`` unless
  ``config.calculate_per_token_loss``), runs the backward from it, and collects ``reduced``.
  With ``collect_non_loss_data=True`` (forward only) it collects
  ``loss_func(output_tensor, non_loss_data=True)`` instead.
- The schedule returns the collected values, one per micro-batch, on the last stage and ``[]``
  on the others. Parameter gradients accumulate over the micro-batches into ``.grad``; then
  ``config.finalize_model_grads_func(model_chunks)`` runs if set (with the total number of tokens
  as a second argument under ``calculate_per_token_loss``).

``config.no_sync_func`` (a context-manager factory, or one per chunk) is entered for every
backward but the last of each chunk, so a data-parallel wrapper reduces gradients once.
With ``config.grad_sync_func`` (one callable or one per chunk) every backward runs inside no_sync
and ``grad_sync_func[c](chunk.parameters())`` is called after chunk c's last backward; with model
chunks, ``config.param_sync_func[c](chunk.parameters())`` is called before chunk c's first forward
(neither in forward-only runs). ``config.grad_scale_func`` scales the loss before its backward;
``config.deallocate_pipeline_outputs`` frees each sent activation's data, keeping only its graph.

How the schedules are built: each is one ordered table per pipeline rank of typed actions
(``schedule_tables``: ``F``, ``B``, and a backward split into ``I`` and ``W``), run by one runner
(``run_schedule``). The runner places every rank's actions on a common clock (``plan_schedule``),
each at the first tick where its inputs exist, and exchanges what each tick produced with its
neighbours. Every rank computes every rank's table, so each knows what its neighbours send at
each tick: sends and receives always pair up, with no deadlock, on gloo and NCCL. A new schedule
is a new table. The zero-bubble schedules (``zb-h1``, ``zb-v``) split each backward with
``split_backward``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence, Union

import torch

from megatron_ext import parallel_state
from megatron_ext.comm_errors import ReportedWork
from megatron_ext.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_ext.pipeline_parallel.schedule_tables import (  # noqa: F401  (re-exported)
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    ActionKind,
    ScheduleEntry,
    format_pipeline_order,
    get_schedule_table,
    gpipe_table,
    interleaved_table,
    no_pipelining_table,
    one_f_one_b_table,
    plan_schedule,
    schedule_table,
    stage_location,
    virtual_stage,
    zbv_table,
    zero_bubble_h1_table,
    _require_positive_int,
)
from megatron_ext.split_backward import backward_input, backward_weight
from megatron_ext.process_groups_config import ProcessGroupCollection, resolve_pg_collection
from megatron_ext.resolve import get_attr_wrapped_model, group_size, module_with

ForwardStepFunc = Callable[..., tuple[torch.Tensor, Callable[..., tuple]]]
Shape = Union[list[int], torch.Size]

SCHEDULES = ("1f1b", "gpipe", "interleaved", "no_pipelining", "zb-h1", "zb-v")


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, *, schedule: str | None = None
) -> Callable[..., list]:
    """The schedule to run, as Megatron-core chooses it.

    With neither ``pp_size`` nor ``vp_size`` both come from parallel_state; otherwise the given
    values are used as they are (None meaning no virtual pipeline). One stage:
    ``forward_backward_no_pipelining``; several: ``forward_backward_pipelining_with_interleaving``
    with a virtual pipeline size, else ``forward_backward_pipelining_without_interleaving`` (1F1B).

    ``schedule`` (keyword, not in Megatron-core) picks one by name: ``"1f1b"``, ``"gpipe"``
    (``forward_backward_pipelining_gpipe``), ``"interleaved"``, ``"no_pipelining"``, ``"zb-h1"``
    (``forward_backward_pipelining_zero_bubble_h1``) or ``"zb-v"``
    (``forward_backward_pipelining_zbv``).
    """
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or None, got {schedule!r}")
    if pp_size is None and vp_size is None:
        _require_initialized()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if schedule == "no_pipelining" or (schedule is None and pp_size == 1):
        if pp_size != 1:
            raise ValueError(
                f"schedule 'no_pipelining' needs pipeline_model_parallel_size 1, got {pp_size}"
            )
        return forward_backward_no_pipelining
    if schedule == "gpipe":
        return forward_backward_pipelining_gpipe
    if schedule == "zb-h1":
        return forward_backward_pipelining_zero_bubble_h1
    if schedule == "zb-v":
        return forward_backward_pipelining_zbv
    v_layout = parallel_state.get_pipeline_model_parallel_layout() == "v"
    if schedule is None and vp_size is not None and v_layout:
        return forward_backward_pipelining_zbv
    if schedule == "interleaved" or (schedule is None and vp_size is not None):
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


# Megatron-core's warm-up arithmetic -----------------------------------------------------------


def get_pp_rank_microbatches(
    num_microbatches: int,
    num_model_chunks: int,
    microbatch_group_size_per_vp_stage: int | None,
    forward_only: bool = False,
    overlap_moe_expert_parallel_comm: bool = False,
    p2p_communicator: P2PCommunicator | None = None,
) -> tuple[int, bool, int, int]:
    """Megatron-core's warm-up arithmetic for this pipeline rank.

    Returns ``(total, all_in_warmup, num_warmup, num_remaining)`` over the ``total =
    num_microbatches * num_model_chunks`` forwards of this rank: 1F1B warms up with
    ``pp - rank - 1`` forwards, the interleaved schedule with ``2 (pp - rank - 1) + (v - 1) g``
    (``g = microbatch_group_size_per_vp_stage``; one more with ``overlap_moe_expert_parallel_comm``),
    forward-only runs everything as warm-up, one stage none; never more than ``total``.
    """
    if p2p_communicator is not None:
        pp_size = p2p_communicator.pp_group.size()
        pp_rank = p2p_communicator.pp_group.rank()
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    total = num_microbatches * num_model_chunks
    if forward_only:
        num_warmup = total
    elif pp_size > 1:
        if vp_size is None:
            num_warmup = pp_size - pp_rank - 1
        else:
            num_warmup = 2 * (pp_size - pp_rank - 1)
            num_warmup += (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
            if overlap_moe_expert_parallel_comm:
                num_warmup += 1
    else:
        num_warmup = 0
    all_in_warmup = num_warmup >= total
    if all_in_warmup:
        num_warmup = total
    return total, all_in_warmup, num_warmup, total - num_warmup


# Set-up shared by the schedules ------------------------------------------------------------


def _require_initialized() -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "the pipeline schedules need the model-parallel groups: call "
            "megatron_ext.parallel_state.initialize_model_parallel() first"
        )


def get_model_config(model: torch.nn.Module) -> Any:
    """The ``config`` of a model, looking through wrappers."""
    return get_attr_wrapped_model(model, "config")


def _as_chunks(name: str, value: Any, many: bool, need_list: bool = False) -> list:
    if isinstance(value, list):
        if not many and len(value) != 1:
            raise ValueError(
                f"{name} is a list of {len(value)} model chunks: this schedule runs one chunk per "
                "stage; use forward_backward_pipelining_with_interleaving"
            )
        if not value:
            raise ValueError(f"{name} is an empty list")
        return value
    if need_list:
        raise ValueError(f"the interleaved schedule needs {name} as a list, one per model chunk")
    return [value]


# The groups the schedules read from a pg_collection; one stage without p2p needs no embedding groups.
_SCHEDULE_GROUPS = ("tp", "cp", "embd", "pos_embd", "pp", "dp_cp")
_ONE_STAGE_GROUPS = ("tp", "cp", "pp", "dp_cp")


def _groups(
    p2p_communicator: P2PCommunicator | None, pg_collection: ProcessGroupCollection | None, config: Any
) -> tuple[P2PCommunicator, ProcessGroupCollection]:
    """Megatron-core's rule: neither (use parallel_state's groups) or both."""
    if (p2p_communicator is None) != (pg_collection is None):
        raise ValueError(
            "Invalid combination of p2p_communicator, pg_collection: provide none (the groups of "
            "parallel_state) or both"
        )
    pg_collection = resolve_pg_collection(pg_collection, _SCHEDULE_GROUPS, "the pipeline schedule")
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pg_collection.pp, config)
    return p2p_communicator, pg_collection


def _config_of(model: torch.nn.Module) -> Any:
    try:
        config = get_model_config(model)
    except AttributeError:
        raise AttributeError(
            f"the model ({type(model).__name__}) has no 'config' attribute: the schedules read "
            "the ModelParallelConfig from model.config"
        ) from None
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("config.defer_embedding_wgrad_compute=True is not supported: the output layer "
                         "computes its weight gradient in its own backward (set it to False)")
    return config


def _common_checks(num_microbatches: int, forward_only: bool, collect_non_loss_data: bool) -> None:
    _require_positive_int("num_microbatches", num_microbatches)
    if collect_non_loss_data and not forward_only:
        raise ValueError("collect_non_loss_data=True needs forward_only=True: there is no loss to "
                         "run the backward from")


def get_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    config: Any,
    tp_group: Any,
    cp_group: Any,
) -> list[tuple[int, int, int]]:
    """The shape of the activations sent between stages: ``[(s / cp (/ tp under sequence
    parallelism), b, hidden)]`` with ``s = decoder_seq_length`` if given, else ``seq_length``."""
    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    seq //= group_size(cp_group)
    if getattr(config, "sequence_parallel", False):
        seq //= group_size(tp_group)
    return [(seq, micro_batch_size, config.hidden_size)]


def _tensor_shape(
    seq_length: int, micro_batch_size: int, config: Any, pgs: ProcessGroupCollection,
    decoder_seq_length: int | None = None,
) -> tuple[int, int, int]:
    """Checks the shape arguments on every rank alike (before anyone communicates). The stages
    exchange ``decoder_seq_length`` positions when it is given, as in Megatron-core."""
    _require_positive_int("seq_length", seq_length)
    _require_positive_int("micro_batch_size", micro_batch_size)
    _require_positive_int("config.hidden_size", getattr(config, "hidden_size", None))
    name, length = "seq_length", seq_length
    if decoder_seq_length is not None:
        _require_positive_int("decoder_seq_length", decoder_seq_length)
        name, length = "decoder_seq_length", decoder_seq_length
    cp_size, tp_size = group_size(pgs.cp), group_size(pgs.tp)
    if length % cp_size != 0:
        raise ValueError(f"{name} {length} is not divisible by the context-parallel size {cp_size}")
    if getattr(config, "sequence_parallel", False) and (length // cp_size) % tp_size != 0:
        raise ValueError(
            f"{name} {length}" + (f" / context-parallel size {cp_size}" if cp_size > 1 else "")
            + f" is not divisible by the tensor-parallel size {tp_size} (needed under sequence_parallel)"
        )
    return get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        config=config, tp_group=pgs.tp, cp_group=pgs.cp,
    )[0]


@contextlib.contextmanager
def _timed(config: Any, name: str, log_level: int):
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timers(name, log_level=log_level).start()
    try:
        yield
    finally:
        timers(name).stop()


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


def check_first_val_step(first_val_step: bool | None, forward_only: bool, cond: bool) -> bool:
    """During validation the caller says whether this is the first step (weights changed since)."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def set_current_microbatch(model: torch.nn.Module, microbatch_id: int) -> None:
    """Tells the model's transformer layers (``model.decoder.layers``) which micro-batch runs."""
    try:
        decoder = get_attr_wrapped_model(model, "decoder")
    except AttributeError:
        return
    for layer in getattr(decoder, "layers", []):
        layer.current_microbatch = microbatch_id


def clear_embedding_activation_buffer(config: Any, model: Any, is_last_stage: bool) -> Any:
    """Megatron-core's deferred embedding weight-gradient buffer: empties it on the last stage
    under ``config.defer_embedding_wgrad_compute`` and returns the module holding it (else None)."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return None
    module = module_with(model[-1] if isinstance(model, list) else model, "embedding_activation_buffer")
    if module is None:
        raise ValueError(
            "config.defer_embedding_wgrad_compute is set but the last model chunk has no "
            "embedding_activation_buffer"
        )
    module.embedding_activation_buffer.clear()
    return module


def finish_embedding_wgrad_compute(
    config: Any, embedding_module: Any, is_last_stage: bool, tp_group: Any
) -> None:
    """The deferred embedding weight gradient (``config.defer_embedding_wgrad_compute``) is not
    implemented: the output layer computes its weight gradient in its own backward."""
    if is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False):
        raise NotImplementedError(
            "config.defer_embedding_wgrad_compute=True is not implemented; leave it False"
        )


# One forward and one backward --------------------------------------------------------------


def forward_step_calc_loss(
    model: torch.nn.Module,
    output_tensor: Any,
    loss_func: Callable[..., tuple] | None,
    config: Any,
    vp_stage: int | None,
    collect_non_loss_data: bool,
    num_microbatches: int,
    forward_data_store: list,
    cp_group_size: int | None = None,
    is_last_stage: bool | None = None,
) -> tuple[Any, torch.Tensor]:
    """On the last stage, turns the model's output into the loss to run the backward from (see the
    module docstring) and stores the reduced values; elsewhere returns the output unchanged.
    Returns ``(output_or_loss, num_tokens)``."""
    if cp_group_size is None and is_last_stage is None:
        cp_group_size = parallel_state.get_context_parallel_world_size()
        if vp_stage is None:
            is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        else:
            vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
            is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and (
                vp_size is None or vp_stage == vp_size - 1
            )
    elif cp_group_size is None or is_last_stage is None:
        raise ValueError("cp_group_size and is_last_stage must be given together")
    num_tokens = torch.tensor(0, dtype=torch.int)
    if not is_last_stage:
        return output_tensor, num_tokens
    if loss_func is None:
        forward_data_store.append(output_tensor)
        return output_tensor, num_tokens
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor, num_tokens
    outputs = loss_func(output_tensor)
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        raise TypeError(
            "loss_func must return (loss, reduced) or (loss, num_tokens, reduced), got "
            f"{type(outputs).__name__}"
            + (f" of length {len(outputs)}" if isinstance(outputs, (tuple, list)) else "")
        )
    if len(outputs) == 3:
        loss, num_tokens, reduced = outputs
        if not getattr(config, "calculate_per_token_loss", False):
            # A micro-batch whose tokens are all masked out contributes zero, not NaN.
            loss = loss / torch.clamp(torch.as_tensor(num_tokens), min=1) / num_microbatches
    else:
        loss, reduced = outputs
        if cp_group_size != 1:
            loss = loss * cp_group_size
        loss = loss / num_microbatches
    forward_data_store.append(reduced)
    return loss, torch.as_tensor(num_tokens).detach().to("cpu", torch.int)


def forward_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | None,
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: torch.Tensor | list | None,
    forward_data_store: list,
    config: Any,
    cp_group_size: int | None = None,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: bool | None = None,
    is_first_microbatch: bool = False,
    current_microbatch: int | None = None,
    vp_stage: int | None = None,
    is_last_stage: bool | None = True,
) -> tuple[Any, torch.Tensor]:
    """Runs one micro-batch through one model chunk (Megatron-core's signature).

    ``checkpoint_activations_microbatch``, when given, is passed on as a third argument of
    ``forward_step_func``. ``is_last_stage``: whether this chunk is the pipeline's last virtual
    stage (with ``cp_group_size`` None and ``is_last_stage`` None both come from parallel_state).

    Returns ``(output_tensor, num_tokens)``: the activation to send on, or on the last stage the
    loss scaled for accumulation over micro-batches (whose reduced values are appended to
    ``forward_data_store``).
    """
    with _timed(config, "forward-compute", 2):
        if is_first_microbatch:
            try:
                get_attr_wrapped_model(model, "set_is_first_microbatch")()
            except AttributeError:
                pass
        if current_microbatch is not None:
            set_current_microbatch(model, current_microbatch)
        unwrap = not isinstance(input_tensor, list)
        try:
            set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
        except AttributeError:
            set_input_tensor = None  # allowed with one stage only (checked by the schedules)
        if set_input_tensor is not None:
            # As in Megatron-core, the model receives a list (one tensor per input; None on the
            # first stage): models written for it index input_tensor[0].
            set_input_tensor(input_tensor if isinstance(input_tensor, list) else [input_tensor])
        if checkpoint_activations_microbatch is None:
            result = forward_step_func(data_iterator, model)
        else:
            result = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(
                "forward_step_func must return (output_tensor, loss_func), got "
                f"{type(result).__name__}"
            )
        output_tensor, loss_func = result
        output_tensor, num_tokens = forward_step_calc_loss(
            model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
            num_microbatches, forward_data_store, cp_group_size, is_last_stage,
        )
    return (output_tensor, num_tokens) if unwrap else ([output_tensor], num_tokens)


def _check_output(output_tensor: Any, shape: Sequence[int], config: Any, where: str) -> None:
    """The next stage allocates its receive buffer from ``shape``, so the sent activation must
    have exactly that shape (unless shapes travel with the data)."""
    if not isinstance(output_tensor, torch.Tensor):
        raise TypeError(
            "forward_step_func must return a tensor as output_tensor on stages other than the "
            f"last, got {type(output_tensor).__name__}"
        )
    if getattr(config, "variable_seq_lengths", False):
        return
    if tuple(output_tensor.shape) != tuple(shape):
        raise ValueError(
            f"the output of {where} has shape {tuple(output_tensor.shape)} but the next stage "
            f"expects {tuple(shape)} [seq_length (/ tp under sequence_parallel), "
            "micro_batch_size, config.hidden_size]"
        )


def deallocate_output_tensor(out: torch.Tensor | None, deallocate_pipeline_outputs: bool = False) -> None:
    """Frees a sent activation's data; its graph (grad_fn) stays for the backward.

    A view shares its base's storage, so swapping its data would free nothing: views are kept.
    """
    if out is not None and deallocate_pipeline_outputs and out._base is None:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """torch.autograd.backward without its shape check: a deallocated output has lost its shape
    but not its graph."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _deallocates(config: Any) -> bool:
    return bool(getattr(config, "deallocate_pipeline_outputs", False))


_DISCONNECTED = (
    "this stage's output does not depend on the activation received from the previous stage: "
    "the model must compute from the tensor given to set_input_tensor"
)


def _scaled_loss(output: torch.Tensor, grad: torch.Tensor | None, config: Any) -> torch.Tensor:
    """The last stage's loss (``grad`` None) through ``config.grad_scale_func`` when set."""
    grad_scale_func = getattr(config, "grad_scale_func", None)
    return grad_scale_func(output) if grad is None and grad_scale_func is not None else output


def backward_step(
    input_tensor: torch.Tensor | list | None,
    output_tensor: torch.Tensor | list,
    output_tensor_grad: torch.Tensor | list | None,
    model_type: Any,
    config: Any,
) -> torch.Tensor | list | None:
    """Runs one chunk's backward for one micro-batch; returns the gradient of its input tensor
    (None on the first stage). ``model_type`` is accepted for Megatron-core's signature; only
    decoder-only pipelines exist here, so it is not used."""
    with _timed(config, "backward-compute", 2):
        unwrap = not isinstance(input_tensor, list)
        inputs = [input_tensor] if unwrap else input_tensor
        for x in inputs:
            if x is not None:
                x.retain_grad()
        output = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        grad = output_tensor_grad[0] if isinstance(output_tensor_grad, list) else output_tensor_grad
        output = _scaled_loss(output, grad, config)
        if output.requires_grad:
            if _deallocates(config):
                custom_backward(output, grad)
            else:
                torch.autograd.backward(output, grad_tensors=grad)
        grads = []
        for x in inputs:
            if x is not None and x.grad is None and output.requires_grad:
                raise RuntimeError(_DISCONNECTED)
            grads.append(None if x is None else x.grad)
        return grads[0] if unwrap else grads


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


# The runner --------------------------------------------------------------------------------


class _RankRun:
    """This rank's run of its table: the work of each action kind, the gradient-sync hooks around
    the backwards, and the exchange with the neighbours after each tick of the plan."""

    def __init__(
        self, tables, *, layout, forward_step_func, data_iterators, model_chunks, num_microbatches,
        config, tensor_shape, p2p_communicator, cp_group_size, forward_only, collect_non_loss_data,
        first_val_step,
    ) -> None:
        self.pp_size = 1 if p2p_communicator is None else p2p_communicator.pp_group.size()
        self.pp_rank = 0 if p2p_communicator is None else p2p_communicator.pp_group.rank()
        if len(tables) != self.pp_size:
            raise ValueError(f"got {len(tables)} schedule tables for a pipeline of {self.pp_size} stages")
        self.num_chunks = len(model_chunks)
        self.num_stages = self.pp_size * self.num_chunks
        self.layout = layout
        self.plan = plan_schedule(tables, self.num_chunks, layout)
        self.table = [a for a in self.plan[self.pp_rank] if a is not None]
        self.forward_step_func, self.data_iterators = forward_step_func, data_iterators
        self.model_chunks, self.num_microbatches, self.config = model_chunks, num_microbatches, config
        self.tensor_shape, self.p2p = tensor_shape, p2p_communicator
        self.cp_group_size, self.forward_only = cp_group_size, forward_only
        self.collect_non_loss_data, self.first_val_step = collect_non_loss_data, first_val_step

        forwards = [(a.microbatch, a.chunk) for a in self.table if a.kind == FORWARD]
        self.first_forward = {c: mb for mb, c in reversed(forwards)}
        # The action after which a chunk's weight gradients are complete: its last B or W.
        self.last_weight_grad = {a.chunk: a.microbatch for a in self.table
                                 if a.kind in (BACKWARD, BACKWARD_WEIGHT)}
        # Megatron-core's partial activation checkpointing window: the warm-up plus one.
        self.partial = getattr(config, "num_microbatches_with_partial_activation_checkpoints", None)
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
        self.sync = _GradSync(config)
        self.grad_sync = None if forward_only else _per_chunk(config, "grad_sync_func", self.num_chunks)
        self.param_sync = (None if forward_only or self.num_chunks == 1
                           else _per_chunk(config, "param_sync_func", self.num_chunks))

    def stage(self, chunk: int) -> int:
        return virtual_stage(self.pp_rank, chunk, self.pp_size, self.layout)

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
        s = self.stage(chunk)
        if self.param_sync is not None and self.first_forward[chunk] == mb:
            self.param_sync[chunk](self.model_chunks[chunk].parameters())
        input_tensor = self.take(self.inputs, mb, chunk).requires_grad_() if s > 0 else None
        checkpoint = None if self.window is None else (self.num_forwards % self.window >= self.partial)
        self.num_forwards += 1
        output_tensor, num_tokens = forward_step(
            self.forward_step_func, self.data_iterators[chunk], self.model_chunks[chunk],
            self.num_microbatches, input_tensor, self.store, self.config, self.cp_group_size,
            self.collect_non_loss_data, checkpoint,
            is_first_microbatch=check_first_val_step(
                self.first_val_step, self.forward_only, self.first_forward[chunk] == mb),
            current_microbatch=mb, vp_stage=chunk if self.num_chunks > 1 else None,
            is_last_stage=s == self.num_stages - 1,
        )
        self.total_tokens += int(num_tokens)
        if not self.forward_only:
            self.in_flight[(mb, chunk)] = (input_tensor, output_tensor)
        if s == self.num_stages - 1:
            return None
        _check_output(output_tensor, self.tensor_shape, self.config,
                      f"pipeline rank {self.pp_rank} chunk {chunk}")
        return output_tensor

    def backward(self, mb: int, chunk: int) -> torch.Tensor | None:
        """Runs B; returns the gradient for the previous stage (None on the first)."""
        input_tensor, output_tensor = self.in_flight.pop((mb, chunk))
        with self.grad_sync_around(mb, chunk):
            input_grad = backward_step(input_tensor, output_tensor, self.output_grad(mb, chunk), None,
                                       self.config)
        return input_grad if self.stage(chunk) > 0 else None

    def backward_input(self, mb: int, chunk: int) -> torch.Tensor | None:
        """Runs I: the input gradient only, the weight gradients deferred to W."""
        input_tensor, output_tensor = self.in_flight.pop((mb, chunk))
        output_grad = self.output_grad(mb, chunk)
        output_tensor = _scaled_loss(output_tensor, output_grad, self.config)
        with _timed(self.config, "backward-compute", 2):
            (input_grad,), self.deferred[(mb, chunk)] = backward_input(
                [output_tensor], [output_grad], [input_tensor])
        if input_tensor is not None and input_grad is None and output_tensor.requires_grad:
            raise RuntimeError(_DISCONNECTED)
        return input_grad if self.stage(chunk) > 0 else None

    def backward_weight(self, mb: int, chunk: int) -> None:
        """Runs W: the weight gradients that I deferred, with the gradient-sync hooks."""
        with self.grad_sync_around(mb, chunk), _timed(self.config, "backward-compute", 2):
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
            self.grad_sync[chunk](self.model_chunks[chunk].parameters())
        self.sync.disable()

    # The exchange --------------------------------------------------------------------------

    def destination(self, rank: int, action: Action | None) -> tuple[int, int, bool] | None:
        """Where what ``action`` of ``rank`` makes goes: ``(rank, chunk, is_activation)``."""
        if action is None or action.kind == BACKWARD_WEIGHT:
            return None
        s = virtual_stage(rank, action.chunk, self.pp_size, self.layout)
        if action.kind == FORWARD:
            if s == self.num_stages - 1:
                return None
            return (*stage_location(s + 1, self.pp_size, self.layout), True)
        if s == 0:
            return None
        return (*stage_location(s - 1, self.pp_size, self.layout), False)

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
        from_prev, from_next, requests = self.p2p.exchange(
            send_next, send_prev, "prev" in incoming, "next" in incoming, self.tensor_shape)
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
        if sent is not None and dest[2] and not self.forward_only:
            deallocate_output_tensor(sent, _deallocates(self.config))

    @staticmethod
    def take(store: dict, mb: int, chunk: int) -> torch.Tensor:
        """The activation or gradient for (mb, chunk), its receive waited for, detached."""
        tensor, request = store.pop((mb, chunk))
        if request is not None:
            request.wait()
        return tensor.detach()


def run_schedule(
    tables: Sequence[Sequence[Action]],
    *,
    forward_step_func: ForwardStepFunc,
    data_iterators: list,
    model_chunks: list[torch.nn.Module],
    num_microbatches: int,
    config: Any,
    tensor_shape: Sequence[int] | None,
    p2p_communicator: P2PCommunicator | None,
    cp_group_size: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    layout: str = "interleaved",
) -> tuple[list, int]:
    """Runs this rank's table (``tables[pp_rank]``) against its neighbours'.

    ``tables`` holds the table of every rank of the pipeline group (``p2p_communicator.pp_group``;
    one table and no communicator for a single stage); ``layout`` maps model chunks to virtual
    stages (``schedule_tables.virtual_stage``). Every rank plans every rank's table
    (``plan_schedule``), so each knows what its neighbours send at each tick: sends and receives
    always pair up. Returns ``(forward_data_store, total_num_tokens)``.
    """
    return _RankRun(
        tables, layout=layout, forward_step_func=forward_step_func, data_iterators=data_iterators,
        model_chunks=model_chunks, num_microbatches=num_microbatches, config=config,
        tensor_shape=tensor_shape, p2p_communicator=p2p_communicator, cp_group_size=cp_group_size,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
    ).run()


# The schedules -----------------------------------------------------------------------------


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """One pipeline stage: forward then backward of each micro-batch in turn, accumulating
    gradients. ``seq_length``, ``micro_batch_size``, ``decoder_seq_length`` and ``p2p_communicator``
    are accepted for a uniform signature and not used (nothing is sent between stages)."""
    _require_initialized()
    _common_checks(num_microbatches, forward_only, collect_non_loss_data)
    chunks = _as_chunks("model", model, many=False)
    iterators = _as_chunks("data_iterator", data_iterator, many=False)
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported by forward_backward_no_pipelining")
    config = _config_of(chunks[0])
    pgs = resolve_pg_collection(pg_collection, _ONE_STAGE_GROUPS, "forward_backward_no_pipelining")
    pp_size = group_size(pgs.pp)
    if pp_size != 1:
        raise ValueError(
            "forward_backward_no_pipelining needs pipeline_model_parallel_size 1, got "
            f"{pp_size}: use get_forward_backward_func()"
        )
    with _timed(config, "forward-backward", 1):
        store, total_tokens = run_schedule(
            [no_pipelining_table(num_microbatches, forward_only)],
            forward_step_func=forward_step_func, data_iterators=iterators, model_chunks=chunks,
            num_microbatches=num_microbatches, config=config, tensor_shape=None,
            p2p_communicator=None, cp_group_size=group_size(pgs.cp), forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        )
        _finalize(chunks, config, forward_only, total_tokens, pg_collection, force_all_reduce)
    return store


def _pipelined(
    kind: str,
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    forward_only: bool,
    collect_non_loss_data: bool,
    first_val_step: bool | None,
    adjust_tensor_shapes_fn: Callable | None,
    p2p_communicator: P2PCommunicator | None,
    pg_collection: ProcessGroupCollection | None,
    force_all_reduce: bool | None,
) -> list:
    """The checks and set-up shared by the pipelined schedules, then the runner on ``kind``'s
    tables. Every check uses only what all ranks agree on, so bad input raises on every rank
    before any of them communicates."""
    _require_initialized()
    _common_checks(num_microbatches, forward_only, collect_non_loss_data)
    interleaved = kind in ("interleaved", "zb-v")
    chunks = _as_chunks("model", model, many=interleaved or kind == "gpipe", need_list=interleaved)
    if kind == "zb-v" and len(chunks) != 2:
        raise ValueError(f"the zb-v schedule runs 2 model chunks per rank (a V: chunk 0 is stage "
                         f"rank, chunk 1 stage 2 * pp - 1 - rank), got {len(chunks)}")
    if interleaved:  # checked here, counted after the table's checks (Megatron-core's order)
        _as_chunks("data_iterator", data_iterator, many=True, need_list=True)
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported: every stage sends [s, b, h]")
    layout = parallel_state.get_pipeline_model_parallel_layout()
    if kind == "zb-v" and layout != "v" and parallel_state.get_virtual_pipeline_model_parallel_world_size():
        raise ValueError("the zb-v schedule runs model chunks built in the V layout: call "
                         "parallel_state.set_pipeline_model_parallel_layout('v') before building the model")
    if kind != "zb-v" and layout == "v":
        raise ValueError(f"parallel_state's pipeline layout is 'v' (ZB-V's): the {kind} schedule runs "
                         "model chunks built in the interleaved layout")
    config = _config_of(chunks[0])
    if getattr(config, "overlap_p2p_comm", False):
        raise ValueError("config.overlap_p2p_comm=True is not supported: the schedules wait for "
                         "each exchange (set it to False)")
    communicator, pgs = _groups(p2p_communicator, pg_collection, config)
    pp_size = communicator.pp_group.size()
    num_chunks = len(chunks)
    if pp_size > 1 or num_chunks > 1:
        for chunk in chunks:
            try:
                get_attr_wrapped_model(chunk, "set_input_tensor")
            except AttributeError:
                raise AttributeError(
                    f"the model ({type(chunk).__name__}) has no set_input_tensor(tensor): with "
                    f"pipeline_model_parallel_size {pp_size} the schedule hands each stage its "
                    "input activation through it"
                ) from None
    shape = _tensor_shape(seq_length, micro_batch_size, config, pgs, decoder_seq_length)

    if kind == "interleaved":
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp_size
        if group > num_microbatches or group < pp_size:
            raise ValueError(
                f"microbatch_group_size_per_vp_stage {group} must lie in [pipeline size "
                f"{pp_size}, num_microbatches {num_microbatches}]"
            )
        remainder = num_microbatches % group
        if 0 < remainder < pp_size:
            raise RuntimeError(
                f"num_microbatches {num_microbatches} leaves a last group of {remainder} "
                f"micro-batches (groups of microbatch_group_size_per_vp_stage {group}): it must be "
                f"0 or at least the pipeline size {pp_size}, else the pipeline stalls"
            )
        tables = [interleaved_table(num_microbatches, num_chunks, group, pp_size, r, forward_only)
                  for r in range(pp_size)]
    elif kind == "gpipe":
        group = getattr(config, "microbatch_group_size_per_vp_stage", None)
        tables = [gpipe_table(num_microbatches, forward_only, num_chunks, group)] * pp_size
    elif kind == "zb-h1":
        tables = [zero_bubble_h1_table(num_microbatches, pp_size, r, forward_only) for r in range(pp_size)]
    elif kind == "zb-v":
        tables = [zbv_table(num_microbatches, pp_size, r, forward_only) for r in range(pp_size)]
    else:
        tables = [one_f_one_b_table(num_microbatches, pp_size, r, forward_only) for r in range(pp_size)]
    if isinstance(data_iterator, list) or interleaved:
        iterators = _as_chunks("data_iterator", data_iterator, many=True, need_list=interleaved)
        if interleaved and len(iterators) != len(chunks):
            raise ValueError(
                f"the {kind} schedule needs one data iterator per model chunk: got "
                f"{len(iterators)} for {len(chunks)} chunks"
            )
        iterators = iterators * len(chunks) if len(iterators) == 1 else iterators
    else:
        iterators = [data_iterator] * len(chunks)
    if len(iterators) != len(chunks):
        raise ValueError(f"got {len(iterators)} data iterators for {len(chunks)} model chunks")

    with _timed(config, "forward-backward", 1):
        store, total_tokens = run_schedule(
            tables, forward_step_func=forward_step_func, data_iterators=iterators,
            model_chunks=chunks, num_microbatches=num_microbatches, config=config,
            tensor_shape=shape, p2p_communicator=communicator,
            cp_group_size=group_size(pgs.cp), forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
            layout="v" if kind == "zb-v" else "interleaved",
        )
        _finalize(chunks, config, forward_only, total_tokens, pg_collection, force_all_reduce)
    return store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """1F1B (PipeDream-Flush): stage r runs ``min(pp - r - 1, m)`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.

    A stage holds at most ``min(pp - r, m)`` micro-batches' activations at any time. Custom
    process groups: pass both ``p2p_communicator`` and ``pg_collection`` (or neither).
    """
    return _pipelined(
        "1f1b",
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )


def forward_backward_pipelining_gpipe(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """GPipe: the forwards of all micro-batches, then all their backwards in the same order.

    Every stage holds the activations of all ``num_microbatches`` at the peak; 1F1B computes the
    same gradients with at most ``pipeline_model_parallel_size`` in flight. ``model`` may be a
    list of chunks (a virtual pipeline), run in the interleaved schedule's forward order.
    """
    return _pipelined(
        "gpipe",
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: list[Iterator],
    model: list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """Interleaved 1F1B over a virtual pipeline: ``model`` is this rank's list of ``v`` chunks
    (chunk c is virtual stage ``c * pp + rank``) and ``data_iterator`` one iterator per chunk.

    Forwards go in ``get_schedule_table`` order (groups of
    ``config.microbatch_group_size_per_vp_stage`` micro-batches, default ``pp``, through chunk 0,
    then chunk 1, ...), backwards in the same order through the chunks last to first; rank r
    warms up with ``2 (pp - r - 1) + (v - 1) g`` forwards. The pipeline bubble is
    ``(pp - 1) / (v m)`` of the ideal time instead of 1F1B's ``(pp - 1) / m``. As in Megatron-core,
    ``g`` must lie in ``[pp, m]`` (ValueError) and ``m mod g`` be 0 or at least ``pp``
    (RuntimeError). The stages exchange ``seq_length`` positions; ``decoder_seq_length`` is
    ignored here, as in Megatron-core's interleaved schedule.
    """
    return _pipelined(
        "interleaved", forward_step_func=forward_step_func, data_iterator=data_iterator,
        model=model, num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, decoder_seq_length=None,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce,
    )


def forward_backward_pipelining_zero_bubble_h1(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """ZB-H1 (``zero_bubble_h1_table``): 1F1B with each backward split into its input half ``I``,
    which the previous stage waits for, and its weight half ``W``, which fills the bubble
    (``split_backward``). 1F1B's peak activation memory; a third of its bubble when F, I and W
    cost the same. The same arguments as the other schedules; the gradients equal 1F1B's."""
    return _pipelined(
        "zb-h1",
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )


def forward_backward_pipelining_zbv(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: list[Iterator],
    model: list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """ZB-V (``zbv_table``): two model chunks per rank in a V, chunk 0 holding virtual stage
    ``rank`` and chunk 1 stage ``2 pp - 1 - rank`` (so rank 0 holds the first and the last
    stage), backwards split into ``I`` and ``W``. No rank idles between its first and its last
    action when F, I and W cost the same, at 1F1B's peak activation memory. ``model`` and
    ``data_iterator`` are lists of two, built for the V (``schedule_tables.virtual_stage`` with
    ``layout="v"``); ``num_microbatches`` must be at least ``2 pp - 1``."""
    return _pipelined(
        "zb-v",
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )
