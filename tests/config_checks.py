"""Checks shared by the config tests: the layers, DistributedDataParallel, a schedule and the
optimizer driven by config objects of a given kind, compared with megatron_ext's own configs."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ext import ModelParallelConfig
from megatron_ext import tensor_parallel as tp_
from megatron_ext.distributed import DistributedDataParallel, finalize_model_grads
from megatron_ext.optimizer import get_megatron_optimizer
from megatron_ext.pipeline_parallel import get_forward_backward_func

H, OUT, VOCAB = 8, 6, 10


def _layers(config: Any) -> list[torch.nn.Module]:
    torch.manual_seed(3)
    init = torch.nn.init.normal_
    return [
        tp_.ColumnParallelLinear(H, OUT, config=config, init_method=init),
        tp_.RowParallelLinear(
            H, OUT, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
        ),
        tp_.VocabParallelEmbedding(VOCAB, H, init_method=init, config=config),
    ]


def check_layers(make_config: Callable[..., Any]) -> None:
    """The layers built from ``make_config(**fields)`` equal those built from megatron_ext's own
    ModelParallelConfig with the same fields: weights, outputs and sequence-parallel flags."""
    fields = dict(use_cpu_initialization=True, params_dtype=torch.float64)
    ours, theirs = _layers(ModelParallelConfig(**fields)), _layers(make_config(**fields))
    x = torch.randn(3, 2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 9], [4, 0]])
    for a, b in zip(ours, theirs):
        assert torch.equal(a.weight, b.weight) and a.weight.dtype == torch.float64
        inputs = ids if isinstance(a, tp_.VocabParallelEmbedding) else x[..., : a.weight.shape[1]]
        out_a, out_b = a(inputs), b(inputs)
        out_a, out_b = (out_a[0], out_b[0]) if isinstance(out_a, tuple) else (out_a, out_b)
        assert torch.equal(out_a, out_b)
    sp = make_config(sequence_parallel=True, tensor_model_parallel_size=2, **fields)
    assert tp_.RowParallelLinear(
        H,
        OUT,
        config=sp,
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    ).sequence_parallel


def check_ddp_schedule_optimizer(
    make_config: Callable[..., Any],
    make_ddp_config: Callable[..., Any],
    make_optimizer_config: Callable[..., Any],
) -> list[float]:
    """Two micro-batches through the no-pipelining schedule, gradients through
    DistributedDataParallel (Megatron's argument order) and finalize_model_grads, one step of the
    distributed optimizer, all configured with the given classes; returns the parameters, which the
    caller compares with megatron_ext's own configs' run."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    config = make_config(params_dtype=torch.float64)
    ddp = DistributedDataParallel(
        config, make_ddp_config(overlap_grad_reduce=True, use_distributed_optimizer=True), model
    )
    model.config = config
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(make_optimizer_config(lr=0.1, use_distributed_optimizer=True), [ddp])
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    batches = [torch.randn(3, 4, dtype=torch.float64, generator=gen) for _ in range(2)]

    def forward_step(data_iterator, model):
        output = model(next(data_iterator))
        return output, lambda out: (out.square().mean(), {"loss": out.square().mean().detach()})

    for _ in range(2):
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=ddp,
            num_microbatches=2,
            seq_length=3,
            micro_batch_size=1,
            forward_only=False,
        )
        assert optimizer.step()[0]
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]
