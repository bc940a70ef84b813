"""Configs by duck typing: the parallel layers, DistributedDataParallel, the schedules and the
optimizer take any object with the fields they read (missing fields read as megatron_ext's
defaults, which are Megatron-core's) and give exactly what megatron_ext's own config classes give;
objects that are not configs are refused with TypeError, unsupported features with
NotImplementedError. ``test_megatron_core_configs.py`` runs the same checks with Megatron-core's
classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ext import ModelParallelConfig
from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.config_checks import OUT, H, check_ddp_schedule_optimizer, check_layers
from tests.distributed import run_distributed


def _duck_worker() -> dict:
    out = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    check_layers(SimpleNamespace)
    init = torch.nn.init.normal_
    for not_a_config in (None, {}, 3, "config", torch.nn.Linear(2, 2), object()):
        with pytest.raises(TypeError, match="config must be a configuration object"):
            tp_.ColumnParallelLinear(H, OUT, config=not_a_config, init_method=init)
    with pytest.raises(NotImplementedError, match=r"config.tp_comm_overlap=True is not supported"):
        tp_.ColumnParallelLinear(H, OUT, config=SimpleNamespace(tp_comm_overlap=True), init_method=init)
    with pytest.raises(TypeError, match=r"config.params_dtype must be a torch.dtype, got 'float'"):
        tp_.RowParallelLinear(
            H,
            OUT,
            config=SimpleNamespace(params_dtype="float"),
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
    ps.destroy_model_parallel()

    ps.initialize_model_parallel()  # dp 2
    plain = check_ddp_schedule_optimizer(
        lambda **kw: ModelParallelConfig(**kw), DistributedDataParallelConfig, OptimizerConfig
    )
    out["duck"] = check_ddp_schedule_optimizer(SimpleNamespace, SimpleNamespace, SimpleNamespace) == plain
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="config must be an OptimizerConfig .* got dict"):
        get_megatron_optimizer({"lr": 1.0}, [model])
    with pytest.raises(TypeError, match="ddp_config must be a DistributedDataParallelConfig .* got list"):
        DistributedDataParallel(SimpleNamespace(), [True], model)
    with pytest.raises(ValueError, match="use_megatron_fsdp=True.* is for .*FullyShardedDataParallel"):
        DistributedDataParallel(SimpleNamespace(), SimpleNamespace(use_megatron_fsdp=True), model)
    return out


def test_duck_typed_configs():
    for out in run_distributed(2, _duck_worker):
        assert out == {"duck": True}
