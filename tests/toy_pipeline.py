"""A toy pipeline shared by the schedule tests: a stack of float64 tanh(Linear) layers cut into
chunks that record the order of their forwards and backwards, its batches, and the serial run it
must reproduce."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

S, B, H, L = 3, 2, 4, 24  # sequence, micro-batch, hidden, layers (divisible by pp * v = 4, 6, 8, 12)


def make_config(**overrides) -> SimpleNamespace:
    fields = dict(
        hidden_size=H, pipeline_dtype=torch.float64, params_dtype=torch.float64,
        sequence_parallel=False, variable_seq_lengths=False, batch_p2p_comm=True,
        deallocate_pipeline_outputs=False, grad_scale_func=None, no_sync_func=None,
        finalize_model_grads_func=None, timers=None, microbatch_group_size_per_vp_stage=None,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def full_layers() -> list[torch.nn.Linear]:
    torch.manual_seed(4321)
    return [torch.nn.Linear(H, H, dtype=torch.float64) for _ in range(L)]


def make_batches(m: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11 + m)
    return [(i, torch.randn(S, B, H, generator=g, dtype=torch.float64),
             torch.randn(S, B, H, generator=g, dtype=torch.float64)) for i in range(m)]


def serial_reference(layers, batches):
    model = copy.deepcopy(layers)
    losses = []
    for _, x, target in batches:
        h = x
        for layer in model:
            h = torch.tanh(layer(h))
        loss = ((h - target) ** 2).mean()
        losses.append(loss.detach())
        (loss / len(batches)).backward()
    return losses, [(layer.weight.grad, layer.bias.grad) for layer in model]


class Recorder:
    """Shared by a rank's chunks: the order of forwards and backwards, and the peak number of
    (micro-batch, chunk) activations held for a backward."""

    def __init__(self) -> None:
        self.order: list[tuple[str, int, int]] = []
        self.live = self.peak = 0


class ToyChunk(torch.nn.Module):
    def __init__(self, layers, config, chunk: int, first: bool, recorder: Recorder) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(copy.deepcopy(layers))
        self.config, self.chunk, self.first, self.recorder = config, chunk, first, recorder
        self.input_tensor = None
        self.outputs: list[torch.Tensor] = []

    def set_input_tensor(self, tensors) -> None:
        assert isinstance(tensors, list) and len(tensors) == 1  # Megatron-core hands over a list
        self.input_tensor = tensors[0]

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        rec = self.recorder
        rec.order.append(("forward", mb, self.chunk))
        rec.live += 1
        rec.peak = max(rec.peak, rec.live)
        h.register_hook(lambda grad: self._backward_reached(mb))
        self.outputs.append(h)
        return h

    def _backward_reached(self, mb: int) -> None:
        self.recorder.order.append(("backward", mb, self.chunk))
        self.recorder.live -= 1


def forward_step(data_iterator, model):
    mb, x, target = next(data_iterator)
    output = model(mb, x)

    def loss_func(output_tensor):
        loss = ((output_tensor - target) ** 2).mean()
        return loss, {"loss": loss.detach().clone(), "mb": mb}

    return output, loss_func
