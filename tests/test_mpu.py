"""The older ``mpu`` names map onto tensor parallelism (world 4: tp 2, pp 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import mpu, parallel_state, tensor_parallel
from tests.conftest import float64
from tests.distributed import run_distributed


def _mpu_worker() -> dict:
    """What the mpu names report on this rank, as plain values (compared in the test)."""
    out = {"initialized": [mpu.model_parallel_is_initialized()]}
    mpu.initialize_model_parallel(tensor_model_parallel_size_=2, pipeline_model_parallel_size_=2)
    out["initialized"].append(mpu.model_parallel_is_initialized())
    out["model_parallel"] = (
        mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank(), mpu.get_model_parallel_src_rank()
    )
    out["pipeline"] = (mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank())
    out["data"] = (
        mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(), mpu.get_data_parallel_src_rank()
    )
    out["same_groups"] = [
        mpu.get_model_parallel_group() is parallel_state.get_tensor_model_parallel_group(),
        mpu.get_data_parallel_group() is parallel_state.get_data_parallel_group(),
    ]

    tp_rank = dist.get_rank() % 2
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) + 10 * tp_rank
    x.requires_grad_(True)
    out["reduced"] = mpu.reduce_from_model_parallel_region(x).tolist()
    mpu.copy_to_model_parallel_region(x).backward(torch.ones(2, 4, dtype=torch.float64))
    out["copy_grad"] = x.grad.tolist()
    full = torch.arange(8, dtype=torch.float64).reshape(2, 4)
    local = mpu.scatter_to_model_parallel_region(full)
    out["scattered"] = local.tolist()
    out["gathered"] = mpu.gather_from_model_parallel_region(local).tolist()

    out["same_objects"] = [
        mpu.ColumnParallelLinear is tensor_parallel.ColumnParallelLinear,
        mpu.RowParallelLinear is tensor_parallel.RowParallelLinear,
        mpu.VocabParallelEmbedding is tensor_parallel.VocabParallelEmbedding,
        mpu.checkpoint is tensor_parallel.checkpoint,
        mpu.get_cuda_rng_tracker() is tensor_parallel.get_cuda_rng_tracker(),
        mpu.vocab_parallel_cross_entropy is tensor_parallel.vocab_parallel_cross_entropy,
    ]
    mpu.model_parallel_cuda_manual_seed(5)
    out["rng_states"] = sorted(mpu.get_cuda_rng_tracker().get_states())

    mpu.destroy_model_parallel()
    out["initialized"].append(mpu.model_parallel_is_initialized())

    # fairscale / Megatron-LM v1 name the tensor-parallel size model_parallel_size_; apex passes
    # backend keywords.
    mpu.initialize_model_parallel(model_parallel_size_=4, default_backend="gloo", p2p_backend="gloo")
    out["fairscale"] = (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank())
    mpu.destroy_model_parallel()
    with pytest.raises(ValueError) as refused:
        mpu.initialize_model_parallel(4, model_parallel_size_=2)
    out["refused"] = str(refused.value)
    return out


@pytest.mark.slow
def test_mpu_names():
    for rank, got in enumerate(run_distributed(4, _mpu_worker)):
        assert got["initialized"] == [False, True, False]
        # Megatron's layout at world 4, tp 2, pp 2: TP [0,1] [2,3], PP [0,2] [1,3], DP of one rank.
        assert got["model_parallel"] == (2, rank % 2, rank - rank % 2)
        assert got["pipeline"] == (2, rank // 2)
        assert got["data"] == (1, 0, rank)
        assert got["same_groups"] == [True, True]
        full = torch.arange(8, dtype=torch.float64).reshape(2, 4)
        assert_close(float64(got["reduced"]), 2 * full + 10, rtol=0, atol=0)
        assert_close(float64(got["copy_grad"]), torch.full((2, 4), 2.0, dtype=torch.float64),
                     rtol=0, atol=0)
        assert_close(float64(got["scattered"]), full.chunk(2, -1)[rank % 2],
                     rtol=0, atol=0)
        assert_close(float64(got["gathered"]), full, rtol=0, atol=0)
        assert got["same_objects"] == [True] * 6
        assert "model-parallel-rng" in got["rng_states"]
        assert got["fairscale"] == (4, rank)
        assert "model_parallel_size_=2 and tensor_model_parallel_size_=4 disagree" in got["refused"]
