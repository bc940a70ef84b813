"""One micro-batch through one model chunk: the forward step (the model's output turned into the
loss on the last stage) and the backward step, with Megatron-core's signatures. The runner
(``runner.py``) calls them for every ``F`` and ``B`` action of a schedule's table."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from megatron_ext import parallel_state
from megatron_ext.pipeline_parallel.aux_loss import set_aux_loss_scale
from megatron_ext.resolve import get_attr_wrapped_model

ForwardStepFunc = Callable[..., tuple[torch.Tensor, Callable[..., tuple]]]


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
    # Read when the backward runs, on every stage: the MoE and MTP losses' gradient scale.
    set_aux_loss_scale(config, num_microbatches, cp_group_size)
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
