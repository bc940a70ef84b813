"""Forward-backward schedules over micro-batches: no pipelining, GPipe and 1F1B.

Every schedule is called with Megatron-core's keywords::

    losses = forward_backward_func(
        forward_step_func=forward_step, data_iterator=it, model=model,
        num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False)

The contract, as in Megatron-core:

- ``model`` is a ``torch.nn.Module`` (or a list holding one) with a ``config`` attribute (a
  ``ModelParallelConfig`` or any object with its fields; wrappers exposing ``.module`` are looked
  through). With more than one pipeline stage it needs ``set_input_tensor(tensor)``: before each
  forward the schedule calls it with the activation received from the previous stage (a leaf
  tensor that requires grad), or with None on the first stage.
- ``forward_step_func(data_iterator, model)`` runs this stage's forward on one micro-batch and
  returns ``(output_tensor, loss_func)``. On stages other than the last, ``output_tensor`` is the
  ``[s, b, h]`` activation sent to the next stage (``s // tp`` under sequence parallelism, dtype
  ``config.pipeline_dtype``).
- On the last stage the schedule calls ``loss_func(output_tensor)``, which returns
  ``(loss, reduced)`` or ``(loss, num_tokens, reduced)``. The schedule divides ``loss`` by
  ``num_microbatches`` (and, for the 3-tuple, first by ``num_tokens`` unless
  ``config.calculate_per_token_loss``), runs the backward from it, and collects ``reduced``.
  With ``collect_non_loss_data=True`` (forward only) it collects
  ``loss_func(output_tensor, non_loss_data=True)`` instead.
- The schedule returns the collected values, one per micro-batch, on the last stage and ``[]``
  on the others. Parameter gradients accumulate over the micro-batches into ``.grad``; then
  ``config.finalize_model_grads_func([model])`` runs if set (with the total number of tokens as a
  second argument under ``calculate_per_token_loss``).

``config.no_sync_func`` (a context-manager factory) is entered for every backward but the last, so
a data-parallel wrapper reduces gradients once. ``config.grad_scale_func`` scales the loss before
its backward; ``config.deallocate_pipeline_outputs`` frees each sent activation's data, keeping
only its autograd graph.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from megatron_ext import parallel_state
from megatron_ext.pipeline_parallel import p2p_communication as p2p

ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable[..., tuple]]]

SCHEDULES = ("1f1b", "gpipe", "no_pipelining")


def get_forward_backward_func(schedule: str | None = None) -> Callable[..., list]:
    """The schedule to run for the current parallel layout.

    Without ``schedule``: ``forward_backward_no_pipelining`` with one pipeline stage, else
    ``forward_backward_pipelining_without_interleaving`` (1F1B). ``schedule`` picks one by name:
    ``"1f1b"``, ``"gpipe"`` (``forward_backward_pipelining_gpipe``) or ``"no_pipelining"`` (one
    stage only). The interleaved schedule of a virtual pipeline is not implemented.
    """
    _require_initialized()
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or None, got {schedule!r}")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if schedule == "no_pipelining" or (schedule is None and pp_size == 1):
        if pp_size != 1:
            raise ValueError(
                f"schedule 'no_pipelining' needs pipeline_model_parallel_size 1, got {pp_size}"
            )
        return forward_backward_no_pipelining
    _require_no_virtual_pipeline()
    if schedule == "gpipe":
        return forward_backward_pipelining_gpipe
    return forward_backward_pipelining_without_interleaving


# Set-up shared by the schedules ------------------------------------------------------------


def _require_initialized() -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "the pipeline schedules need the model-parallel groups: call "
            "megatron_ext.parallel_state.initialize_model_parallel() first"
        )


def _require_no_virtual_pipeline() -> None:
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp is not None:
        raise NotImplementedError(
            f"virtual_pipeline_model_parallel_size={vp}: the interleaved 1F1B schedule is not "
            "implemented; initialize_model_parallel without a virtual pipeline"
        )


def get_attr_wrapped_model(model: torch.nn.Module, attr: str) -> Any:
    """``model.<attr>``, looking through wrappers (DDP, Float16Module) that keep ``.module``."""
    inner = model
    while not hasattr(inner, attr):
        if not hasattr(inner, "module"):
            raise AttributeError(
                f"{type(model).__name__} (or the module it wraps) has no attribute {attr!r}"
            )
        inner = inner.module
    return getattr(inner, attr)


def get_model_config(model: torch.nn.Module) -> Any:
    """The ``config`` of a model, looking through wrappers."""
    return get_attr_wrapped_model(model, "config")


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _unwrap_single(name: str, value: Any) -> Any:
    if isinstance(value, list):
        if len(value) != 1:
            raise NotImplementedError(
                f"{name} is a list of {len(value)} model chunks: only one chunk per stage is "
                "supported (the interleaved schedule is not implemented)"
            )
        return value[0]
    return value


def _prepare(
    *,
    model: torch.nn.Module | list[torch.nn.Module],
    data_iterator: Iterator | list[Iterator] | None,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    collect_non_loss_data: bool,
    pipelined: bool,
) -> tuple[torch.nn.Module, Iterator | None, Any, tuple[int, int, int] | None]:
    """Checks the arguments and returns (model, data_iterator, config, tensor_shape).

    Every check uses only what all ranks agree on, so bad input raises on every rank before any
    of them communicates.
    """
    _require_initialized()
    _require_positive_int("num_microbatches", num_microbatches)
    model = _unwrap_single("model", model)
    data_iterator = _unwrap_single("data_iterator", data_iterator)
    if collect_non_loss_data and not forward_only:
        raise ValueError("collect_non_loss_data=True needs forward_only=True: there is no loss to "
                         "run the backward from")
    try:
        config = get_model_config(model)
    except AttributeError:
        raise AttributeError(
            f"the model ({type(model).__name__}) has no 'config' attribute: the schedules read "
            "the ModelParallelConfig from model.config"
        ) from None
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if not pipelined:
        if pp_size != 1:
            raise ValueError(
                "forward_backward_no_pipelining needs pipeline_model_parallel_size 1, got "
                f"{pp_size}: use get_forward_backward_func()"
            )
        return model, data_iterator, config, None
    _require_no_virtual_pipeline()
    if pp_size > 1:
        try:
            get_attr_wrapped_model(model, "set_input_tensor")
        except AttributeError:
            raise AttributeError(
                f"the model ({type(model).__name__}) has no set_input_tensor(tensor): with "
                f"pipeline_model_parallel_size {pp_size} the schedule hands each stage its input "
                "activation through it"
            ) from None
    _require_positive_int("seq_length", seq_length)
    _require_positive_int("micro_batch_size", micro_batch_size)
    hidden_size = getattr(config, "hidden_size", None)
    if pp_size > 1:
        _require_positive_int("config.hidden_size", hidden_size)
    if getattr(config, "sequence_parallel", False):
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if seq_length % tp_size != 0:
            raise ValueError(
                f"seq_length {seq_length} is not divisible by the tensor-parallel size {tp_size} "
                "(needed under sequence_parallel)"
            )
        seq_length //= tp_size
    return model, data_iterator, config, (seq_length, micro_batch_size, hidden_size)


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
    """Holds ``config.no_sync_func()`` open until the last backward of the batch."""

    def __init__(self, config: Any) -> None:
        self._factory = getattr(config, "no_sync_func", None)
        self._context = None

    def disable(self) -> None:
        if self._factory is not None and self._context is None:
            self._context = self._factory()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)


def _is_first_microbatch(first_val_step: bool | None, forward_only: bool, first: bool) -> bool:
    # During validation the caller says whether this is the first step (weights changed since).
    if first_val_step is not None and forward_only:
        return first_val_step and first
    return first


# One forward and one backward --------------------------------------------------------------


def forward_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | None,
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: torch.Tensor | None,
    forward_data_store: list,
    config: Any,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: bool | None = None,
    is_first_microbatch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs one micro-batch through this stage.

    ``checkpoint_activations_microbatch``, when given, is passed on as a third argument of
    ``forward_step_func``.

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
        try:
            set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
        except AttributeError:
            set_input_tensor = None  # allowed with one stage only (checked in _prepare)
        if set_input_tensor is not None:
            set_input_tensor(input_tensor)
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
        num_tokens = torch.tensor(0, dtype=torch.int)
        if not parallel_state.is_pipeline_last_stage():
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
                loss = loss / num_tokens / num_microbatches
        else:
            loss, reduced = outputs
            loss = loss / num_microbatches
        forward_data_store.append(reduced)
        return loss, torch.as_tensor(num_tokens).detach().to("cpu", torch.int)


def _check_output(output_tensor: Any, shape: tuple[int, int, int], config: Any) -> None:
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
            f"the output of pipeline stage {parallel_state.get_pipeline_model_parallel_rank()} "
            f"has shape {tuple(output_tensor.shape)} but the next stage expects {tuple(shape)} "
            "[seq_length (/ tp under sequence_parallel), micro_batch_size, config.hidden_size]"
        )


def deallocate_output_tensor(out: torch.Tensor, deallocate_pipeline_outputs: bool = False) -> None:
    """Frees a sent activation's data; its graph (grad_fn) stays for the backward.

    A view shares its base's storage, so swapping its data would free nothing: views are kept.
    """
    if deallocate_pipeline_outputs and out._base is None:
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


def backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    model_type: Any,
    config: Any,
) -> torch.Tensor | None:
    """Runs this stage's backward for one micro-batch; returns the gradient of its input tensor
    (None on the first stage). ``model_type`` is accepted for Megatron-core's signature; only
    decoder-only pipelines exist here, so it is not used."""
    with _timed(config, "backward-compute", 2):
        if input_tensor is not None:
            input_tensor.retain_grad()
        grad_scale_func = getattr(config, "grad_scale_func", None)
        if output_tensor_grad is None and grad_scale_func is not None:
            output_tensor = grad_scale_func(output_tensor)
        if _deallocates(config):
            custom_backward(output_tensor, output_tensor_grad)
        else:
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
        if input_tensor is None:
            return None
        if input_tensor.grad is None:
            raise RuntimeError(
                "this stage's output does not depend on the activation received from the "
                "previous stage: the model must compute from the tensor given to set_input_tensor"
            )
        return input_tensor.grad


def _finalize(model: torch.nn.Module, config: Any, forward_only: bool, total_tokens: int) -> None:
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is None or forward_only:
        return
    if getattr(config, "calculate_per_token_loss", False):
        finalize([model], torch.tensor(total_tokens, dtype=torch.int))
    else:
        finalize([model])


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
) -> list:
    """One pipeline stage: forward then backward of each micro-batch in turn, accumulating
    gradients. ``seq_length`` and ``micro_batch_size`` are accepted for a uniform signature and
    not used."""
    model, data_iterator, config, _ = _prepare(
        model=model, data_iterator=data_iterator, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, pipelined=False,
    )
    store: list = []
    total_tokens = 0
    sync = _GradSync(config)
    with _timed(config, "forward-backward", 1):
        sync.disable()
        try:
            for i in range(num_microbatches):
                if i == num_microbatches - 1:
                    sync.enable()
                output_tensor, num_tokens = forward_step(
                    forward_step_func, data_iterator, model, num_microbatches, None, store, config,
                    collect_non_loss_data,
                    is_first_microbatch=_is_first_microbatch(first_val_step, forward_only, i == 0),
                )
                total_tokens += int(num_tokens)
                if not forward_only:
                    backward_step(None, output_tensor, None, None, config)
        finally:
            sync.enable()
        _finalize(model, config, forward_only, total_tokens)
    return store


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
) -> list:
    """GPipe: the forwards of all micro-batches, then all their backwards in the same order.

    Every stage holds the activations of all ``num_microbatches`` at the peak; 1F1B computes the
    same gradients with at most ``pipeline_model_parallel_size`` in flight.
    """
    return _pipelined(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, all_forwards_first=True,
    )


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
) -> list:
    """1F1B (PipeDream-Flush): stage r runs ``min(pp - r - 1, m)`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.

    A stage holds at most ``min(pp - r, m)`` micro-batches' activations at any time.
    """
    return _pipelined(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, all_forwards_first=False,
    )


def _pipelined(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    collect_non_loss_data: bool,
    first_val_step: bool | None,
    all_forwards_first: bool,
) -> list:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    GPipe is the case with every micro-batch in the warm-up (no steady phase); 1F1B warms up
    with ``min(pp - r - 1, m)`` on stage r.
    """
    model, data_iterator, config, shape = _prepare(
        model=model, data_iterator=data_iterator, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, pipelined=True,
    )
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    last_stage = parallel_state.is_pipeline_last_stage()
    num_warmup = num_microbatches if all_forwards_first else min(pp_size - pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup

    store: list = []
    total_tokens = 0
    in_flight: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    sync = _GradSync(config)

    def run_forward(i: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        nonlocal total_tokens
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, store, config,
            collect_non_loss_data,
            is_first_microbatch=_is_first_microbatch(first_val_step, forward_only, i == 0),
        )
        total_tokens += int(num_tokens)
        if not last_stage:
            _check_output(output_tensor, shape, config)
        return output_tensor

    with _timed(config, "forward-backward", 1):
        sync.disable()
        try:
            for i in range(num_warmup):
                input_tensor = p2p.recv_forward(shape, config)
                output_tensor = run_forward(i, input_tensor)
                p2p.send_forward(output_tensor, config)
                if not forward_only:
                    in_flight.append((input_tensor, output_tensor))
                    if not last_stage:
                        deallocate_output_tensor(output_tensor, _deallocates(config))

            input_tensor = p2p.recv_forward(shape, config) if num_steady > 0 else None
            for i in range(num_steady):
                last_iteration = i == num_steady - 1
                output_tensor = run_forward(num_warmup + i, input_tensor)
                if forward_only:
                    p2p.send_forward(output_tensor, config)
                    if not last_iteration:
                        input_tensor = p2p.recv_forward(shape, config)
                    continue
                output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, shape, config)
                in_flight.append((input_tensor, output_tensor))
                if not last_stage:
                    deallocate_output_tensor(output_tensor, _deallocates(config))
                input_tensor, output_tensor = in_flight.pop(0)
                if num_warmup == 0 and last_iteration:
                    sync.enable()
                input_tensor_grad = backward_step(
                    input_tensor, output_tensor, output_tensor_grad, None, config
                )
                if last_iteration:
                    input_tensor = None
                    p2p.send_backward(input_tensor_grad, config)
                else:
                    input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, shape, config)

            if not forward_only:
                for i in range(num_warmup):
                    if i == num_warmup - 1:
                        sync.enable()
                    input_tensor, output_tensor = in_flight.pop(0)
                    output_tensor_grad = p2p.recv_backward(shape, config)
                    input_tensor_grad = backward_step(
                        input_tensor, output_tensor, output_tensor_grad, None, config
                    )
                    p2p.send_backward(input_tensor_grad, config)
        finally:
            sync.enable()
        _finalize(model, config, forward_only, total_tokens)
    return store
