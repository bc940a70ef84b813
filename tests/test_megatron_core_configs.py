"""Megatron-core's own config classes (``ModelParallelConfig``, ``TransformerConfig``,
``DistributedDataParallelConfig``, ``OptimizerConfig``, ``ParamKey``) drive megatron_ext's layers,
DistributedDataParallel, schedules and optimizer exactly as megatron_ext's classes do. Skipped
when megatron-core is not installed (megatron_ext itself never imports it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ext import ModelParallelConfig  # noqa: E402
from megatron_ext import parallel_state as ps  # noqa: E402
from megatron_ext.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron_ext.optimizer import OptimizerConfig, _get_param_groups  # noqa: E402
from tests.config_checks import check_ddp_schedule_optimizer, check_layers  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def _megatron_worker() -> dict:
    from megatron.core import ModelParallelConfig as MCoreModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig as MCoreDDPConfig
    from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig
    from megatron.core.optimizer import ParamKey as MCoreParamKey
    from megatron.core.transformer import TransformerConfig as MCoreTransformerConfig

    def transformer_config(**fields):
        return MCoreTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **fields)

    out = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    check_layers(MCoreModelParallelConfig)
    check_layers(transformer_config)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel()  # dp 2
    plain = check_ddp_schedule_optimizer(
        lambda **kw: ModelParallelConfig(**kw), DistributedDataParallelConfig, OptimizerConfig
    )
    out["mcore"] = (
        check_ddp_schedule_optimizer(transformer_config, MCoreDDPConfig, MCoreOptimizerConfig) == plain
    )
    # Megatron-core's ParamKey selects parameters in config_overrides.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    groups = _get_param_groups(
        [model], MCoreOptimizerConfig(lr=0.1), {MCoreParamKey(name="1.*"): {"wd_mult": 0.5}}
    )
    out["groups"] = [(len(g["params"]), g["wd_mult"]) for g in groups]
    return out


@pytest.mark.slow  # Megatron-core's own config objects through every layer, the schedules and the optimizer
def test_megatron_core_configs():
    for out in run_distributed(2, _megatron_worker):
        assert out == {"mcore": True, "groups": [(2, 1.0), (2, 0.5)]}
