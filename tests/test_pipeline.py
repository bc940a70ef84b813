"""Pipeline schedules and stage-to-stage communication against a serial run of the whole model.

The toy model is a stack of Linear + tanh layers in float64, split evenly over the stages; every
rank builds all layers from one seed, keeps its stage's slice and computes the serial reference
itself. In a world of 4, pipeline sizes 1, 2 and 4 leave the other ranks as data-parallel
replicas fed the same data.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext.pipeline_parallel import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_gpipe,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from megatron_ext.pipeline_parallel import p2p_communication as p2p
from megatron_ext.pipeline_parallel import schedules
from tests.conftest import EXACT
from tests.distributed import run_distributed

S, B, H, L = 4, 3, 6, 8  # sequence, micro-batch, hidden, layers
WORLD = 4


def make_config(**overrides) -> SimpleNamespace:
    fields = dict(
        hidden_size=H, pipeline_dtype=torch.float64, params_dtype=torch.float64,
        sequence_parallel=False, variable_seq_lengths=False, batch_p2p_comm=True,
        deallocate_pipeline_outputs=False, grad_scale_func=None, no_sync_func=None,
        finalize_model_grads_func=None, timers=None,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def full_layers() -> list[torch.nn.Linear]:
    torch.manual_seed(1234)
    return [torch.nn.Linear(H, H, dtype=torch.float64) for _ in range(L)]


def make_batches(m: int, seq: int = S, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + m)
    return [
        (torch.randn(seq, B, H, generator=g, dtype=torch.float64),
         torch.randn(seq, B, H, generator=g, dtype=torch.float64))
        for _ in range(m)
    ]


class ToyStage(torch.nn.Module):
    """One stage's slice of the layers. Counts micro-batches whose forward ran and whose backward
    has not yet reached this stage's output (a hook on the output fires in the backward)."""

    def __init__(self, layers: list[torch.nn.Linear], config: SimpleNamespace) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(copy.deepcopy(layers))
        self.config = config
        self.input_tensor: torch.Tensor | None = None
        self.live = self.peak = 0
        self.outputs: list[torch.Tensor] = []
        self.received: list[torch.Tensor | None] = []
        self.first_microbatch_calls = 0

    def set_is_first_microbatch(self) -> None:
        self.first_microbatch_calls += 1

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        assert isinstance(tensors, list) and len(tensors) == 1  # Megatron-core hands over a list
        (tensor,) = tensors
        self.input_tensor = tensor
        self.received.append(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if ps.is_pipeline_first_stage() else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        self.live += 1
        self.peak = max(self.peak, self.live)
        h.register_hook(self._backward_reached)
        self.outputs.append(h)
        return h

    def _backward_reached(self, grad: torch.Tensor) -> None:
        self.live -= 1


class NoModelNoInput(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


def make_forward_step(three_tuple: bool = False):
    def forward_step(data_iterator, model):
        x, target = next(data_iterator)
        output = model(x)

        def loss_func(output_tensor, non_loss_data=False):
            if non_loss_data:
                return output_tensor.detach().clone()
            if three_tuple:
                total = ((output_tensor - target) ** 2).sum()
                count = torch.tensor(target.numel())
                return total, count, {"loss": (total / count).detach()}
            loss = ((output_tensor - target) ** 2).mean()
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    return forward_step


def serial_reference(layers, batches, scale: float = 1.0):
    """Per-micro-batch losses, final outputs and accumulated gradients of the unsplit model."""
    model = copy.deepcopy(layers)
    losses, outputs = [], []
    for x, target in batches:
        h = x
        for layer in model:
            h = torch.tanh(layer(h))
        loss = ((h - target) ** 2).mean()
        losses.append(loss.detach())
        outputs.append(h.detach())
        (loss * scale / len(batches)).backward()
    grads = [(layer.weight.grad, layer.bias.grad) for layer in model]
    return losses, outputs, grads


class SyncRecorder:
    """A no_sync_func that records, for each backward, whether it ran inside no_sync."""

    def __init__(self) -> None:
        self.active = False
        self.flags: list[bool] = []

    @contextlib.contextmanager
    def no_sync(self):
        assert not self.active
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _run_and_check(schedule, pp: int, m: int, forward_only: bool, layers, refs, *,
                   three_tuple=False, scale=1.0, **config_overrides) -> None:
    rank = ps.get_pipeline_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    per_stage = L // pp
    lo = rank * per_stage
    sync, finalized = SyncRecorder(), []
    config = make_config(
        no_sync_func=sync.no_sync, finalize_model_grads_func=finalized.append,
        grad_scale_func=(lambda loss: loss * scale) if scale != 1.0 else None, **config_overrides,
    )
    model = ToyStage(layers[lo:lo + per_stage], config)
    model.layers[0].weight.register_hook(lambda g: sync.flags.append(sync.active))
    batches = make_batches(m)
    store = schedule(
        forward_step_func=make_forward_step(three_tuple), data_iterator=iter(batches),
        model=[model], num_microbatches=m, seq_length=S, micro_batch_size=B,
        forward_only=forward_only,
    )
    ref_losses, _, ref_grads = refs[m]
    where = f"{schedule.__name__} pp={pp} stage={rank} m={m} forward_only={forward_only}"
    if last:
        assert len(store) == m, where
        for got, want in zip(store, ref_losses):
            assert_close(got["loss"], want, **EXACT, msg=where)
    else:
        assert store == [], where
    assert model.received[0] is None if first else model.received[0].requires_grad, where
    assert len(model.received) == m and model.first_microbatch_calls == 1, where
    if forward_only:
        assert all(p.grad is None for p in model.parameters()), where
        assert finalized == [] and sync.flags == [], where
        return
    for j, layer in enumerate(model.layers):
        ref_w, ref_b = ref_grads[lo + j]
        assert_close(layer.weight.grad, ref_w * scale, **EXACT, msg=where)
        assert_close(layer.bias.grad, ref_b * scale, **EXACT, msg=where)
    # Gradients are reduced once: every backward but the last runs inside no_sync.
    assert sync.flags == [True] * (m - 1) + [False], (where, sync.flags)
    assert len(finalized) == 1 and finalized[0][0] is model, where
    assert model.live == 0, where
    if schedule is forward_backward_pipelining_without_interleaving:
        assert model.peak == min(pp - rank, m), (where, model.peak)
    elif schedule is forward_backward_pipelining_gpipe:
        assert model.peak == m, (where, model.peak)
    else:
        assert model.peak == 1, (where, model.peak)
    freed = config.deallocate_pipeline_outputs and not last
    assert all((out.numel() == 1) == freed for out in model.outputs), where


def _schedules_worker() -> None:
    layers = full_layers()
    refs = {m: serial_reference(layers, make_batches(m)) for m in (1, 3, 8)}
    for pp in (1, 2, 4):
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
        default = get_forward_backward_func()
        if pp == 1:
            assert default is forward_backward_no_pipelining
            schedules = [forward_backward_no_pipelining]
        else:
            assert default is forward_backward_pipelining_without_interleaving
            schedules = []
        assert get_forward_backward_func(schedule="gpipe") is forward_backward_pipelining_gpipe
        assert get_forward_backward_func(schedule="1f1b") is forward_backward_pipelining_without_interleaving
        schedules += [forward_backward_pipelining_without_interleaving,
                      forward_backward_pipelining_gpipe]
        for schedule in schedules:
            for m in (1, 3, 8):
                for forward_only in (False, True):
                    _run_and_check(schedule, pp, m, forward_only, layers, refs)
        for schedule in schedules[-2:]:
            # Freed activations, unbatched p2p, a scaled loss and the 3-tuple loss_func.
            for m in (3, 8):
                _run_and_check(schedule, pp, m, False, layers, refs, deallocate_pipeline_outputs=True,
                               batch_p2p_comm=False)
                _run_and_check(schedule, pp, m, False, layers, refs, three_tuple=True, scale=4.0)
        _check_non_loss_data(pp, layers)
        ps.destroy_model_parallel()
    _check_sequence_parallel_shape(layers)


def _check_non_loss_data(pp: int, layers) -> None:
    m, per_stage = 3, L // pp
    lo = ps.get_pipeline_model_parallel_rank() * per_stage
    batches = make_batches(m)
    _, ref_outputs, _ = serial_reference(layers, batches)
    for schedule in (forward_backward_pipelining_without_interleaving,
                     forward_backward_pipelining_gpipe):
        model = ToyStage(layers[lo:lo + per_stage], make_config())
        store = schedule(forward_step_func=make_forward_step(), data_iterator=iter(batches),
                         model=model, num_microbatches=m, seq_length=S, micro_batch_size=B,
                         forward_only=True, collect_non_loss_data=True)
        if ps.is_pipeline_last_stage():
            assert len(store) == m
            for got, want in zip(store, ref_outputs):
                assert_close(got, want, **EXACT)
        else:
            assert store == []


def _check_sequence_parallel_shape(layers) -> None:
    """tp 2 x pp 2: under sequence parallelism stages exchange [seq_length / tp, b, h]."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    m, local_seq = 3, S // 2
    batches = make_batches(m, seq=local_seq)
    ref_losses, _, ref_grads = serial_reference(layers, batches)
    rank = ps.get_pipeline_model_parallel_rank()
    lo = rank * (L // 2)
    model = ToyStage(layers[lo:lo + L // 2], make_config(sequence_parallel=True))
    store = get_forward_backward_func()(
        forward_step_func=make_forward_step(), data_iterator=iter(batches), model=model,
        num_microbatches=m, seq_length=S, micro_batch_size=B)
    if ps.is_pipeline_last_stage():
        assert_close(torch.stack([d["loss"] for d in store]), torch.stack(ref_losses), **EXACT)
    assert tuple(model.received[-1].shape if rank else batches[0][0].shape) == (local_seq, B, H)
    for j, layer in enumerate(model.layers):
        assert_close(layer.weight.grad, ref_grads[lo + j][0], **EXACT)
    with pytest.raises(ValueError, match="seq_length 5 is not divisible by the tensor-parallel size 2"):
        get_forward_backward_func()(
            forward_step_func=make_forward_step(), data_iterator=iter(batches), model=model,
            num_microbatches=m, seq_length=5, micro_batch_size=B)
    ps.destroy_model_parallel()


@pytest.mark.slow
def test_schedules_match_serial():
    run_distributed(WORLD, _schedules_worker)


def _p2p_worker() -> None:
    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    k = ps.get_pipeline_model_parallel_rank()
    dp = ps.get_data_parallel_rank()
    config = make_config()
    shape = (S, B, H)

    def value(stage: int, tag: float) -> torch.Tensor:
        return torch.full(shape, 100.0 * dp + 10.0 * stage + tag, dtype=torch.float64)

    # Forward chain: each stage receives from the one before it and passes its own value on.
    got = p2p.recv_forward(shape, config)
    if k == 0:
        assert got is None
    else:
        assert got.requires_grad and got.dtype == torch.float64 and got.device.type == "cpu"
        assert_close(got.detach(), value(k - 1, 1), **EXACT)
    assert p2p.send_forward(value(k, 1), config) is None

    # Backward chain, from the last stage down.
    got = p2p.recv_backward(shape, config)
    if k == 3:
        assert got is None
    else:
        assert not got.requires_grad
        assert_close(got, value(k + 1, 2), **EXACT)
    p2p.send_backward(value(k, 2), config)

    # The 1F1B steady-state pair: even stages send forward, odd stages send backward.
    if k % 2 == 0:
        got = p2p.send_forward_recv_backward(value(k, 3), shape, config)
        assert_close(got, value(k + 1, 4), **EXACT)
    else:
        got = p2p.send_backward_recv_forward(value(k, 4), shape, config)
        assert_close(got.detach(), value(k - 1, 3), **EXACT)
    assert p2p.send_forward_recv_backward(value(k, 0), shape, config, is_last_stage=True) is None
    assert p2p.send_backward_recv_forward(value(k, 0), shape, config, is_first_stage=True) is None
    if k == 3:
        assert p2p.send_forward_recv_backward(value(k, 0), shape, config) is None
    if k == 0:
        assert p2p.send_backward_recv_forward(value(k, 0), shape, config) is None

    # The ring wraps around: stage 0 receives from stage 3 and the other way round.
    got = p2p.send_forward_recv_forward(value(k, 5), True, shape, config)
    assert_close(got.detach(), value((k - 1) % 4, 5), **EXACT)
    got = p2p.send_backward_recv_backward(value(k, 6), True, shape, config)
    assert_close(got, value((k + 1) % 4, 6), **EXACT)

    # Shapes travel with the data under variable_seq_lengths; unbatched p2p as well.
    variable = make_config(variable_seq_lengths=True, batch_p2p_comm=False)
    sent = torch.full((k + 1, B, H), float(k), dtype=torch.float64)
    got = p2p.send_forward_recv_forward(sent, True, None, variable)
    prev = (k - 1) % 4
    assert_close(got.detach(), torch.full((prev + 1, B, H), float(prev), dtype=torch.float64), **EXACT)

    # A tensor of another dtype than the pipeline's is refused before anything is sent.
    with pytest.raises(TypeError, match="dtype torch.float32 but the pipeline communicates torch.float64"):
        p2p.send_forward_recv_forward(value(k, 0).float(), True, shape, config)
    with pytest.raises(ValueError, match="tensor_shape must be a sequence of non-negative integers"):
        p2p.send_forward_recv_forward(value(k, 0), True, None, config)
    ps.destroy_model_parallel()


def _errors_worker() -> None:
    layers = full_layers()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    rank = ps.get_pipeline_model_parallel_rank()
    model = ToyStage(layers[rank * 4:rank * 4 + 4], make_config())
    kwargs = dict(forward_step_func=make_forward_step(), data_iterator=iter(make_batches(2)),
                  model=model, num_microbatches=2, seq_length=S, micro_batch_size=B)
    for schedule in (forward_backward_pipelining_without_interleaving,
                     forward_backward_pipelining_gpipe):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=f"num_microbatches must be an integer >= 1, got {bad!r}"):
                schedule(**{**kwargs, "num_microbatches": bad})
        with pytest.raises(AttributeError, match="has no set_input_tensor"):
            schedule(**{**kwargs, "model": NoModelNoInput(make_config())})
        with pytest.raises(AttributeError, match="has no 'config' attribute"):
            schedule(**{**kwargs, "model": torch.nn.Linear(2, 2)})
        if schedule is forward_backward_pipelining_without_interleaving:
            with pytest.raises(ValueError, match="list of 2 model chunks"):
                schedule(**{**kwargs, "model": [model, model]})
        with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1, got 0"):
            schedule(**{**kwargs, "micro_batch_size": 0})
        with pytest.raises(ValueError, match="config.hidden_size must be an integer >= 1, got None"):
            schedule(**{**kwargs, "model": ToyStage([], make_config(hidden_size=None))})
        with pytest.raises(ValueError, match="collect_non_loss_data=True needs forward_only=True"):
            schedule(**{**kwargs, "collect_non_loss_data": True})
    with pytest.raises(ValueError, match="no_pipelining needs pipeline_model_parallel_size 1, got 2"):
        forward_backward_no_pipelining(**kwargs)
    with pytest.raises(ValueError, match="schedule must be one of .* got 'zigzag'"):
        get_forward_backward_func(schedule="zigzag")
    with pytest.raises(ValueError, match="'no_pipelining' needs pipeline_model_parallel_size 1, got 2"):
        get_forward_backward_func(schedule="no_pipelining")
    # Nothing was sent by the refused calls: a valid run afterwards pairs up correctly.
    batches = make_batches(2)
    ref_losses, _, _ = serial_reference(layers, batches)
    store = get_forward_backward_func()(**{**kwargs, "data_iterator": iter(batches)})
    if ps.is_pipeline_last_stage():
        assert_close(torch.stack([d["loss"] for d in store]), torch.stack(ref_losses), **EXACT)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    ps.destroy_model_parallel()


def _p2p_and_errors_worker() -> None:
    _p2p_worker()
    _errors_worker()


@pytest.mark.slow
def test_p2p_communication_and_errors_raise_on_every_rank():
    # One spawned world for both: spawning costs more than the checks.
    run_distributed(WORLD, _p2p_and_errors_worker)


def test_schedules_need_initialized_parallel_state():
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        get_forward_backward_func()
    model = ToyStage(full_layers(), make_config())
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        forward_backward_pipelining_gpipe(
            forward_step_func=make_forward_step(), data_iterator=iter(make_batches(1)),
            model=model, num_microbatches=1, seq_length=S, micro_batch_size=B)


def test_pipeline_dtype_fallback():
    assert p2p.pipeline_dtype(make_config(pipeline_dtype=torch.bfloat16)) == torch.bfloat16
    assert p2p.pipeline_dtype(make_config(pipeline_dtype=None)) == torch.float64
    assert p2p.pipeline_dtype(SimpleNamespace()) == torch.float32
    with pytest.raises(TypeError, match="config.pipeline_dtype must be a torch.dtype, got 'fp16'"):
        p2p.pipeline_dtype(make_config(pipeline_dtype="fp16"))
