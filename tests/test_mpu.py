"""The older ``mpu`` names map onto tensor parallelism (world 4: tp 2, pp 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import mpu, parallel_state, tensor_parallel
from tests.distributed import run_distributed


def _mpu_worker() -> bool:
    assert not mpu.model_parallel_is_initialized()
    mpu.initialize_model_parallel(tensor_model_parallel_size_=2, pipeline_model_parallel_size_=2)
    assert mpu.model_parallel_is_initialized()
    rank = dist.get_rank()
    # Megatron's layout at world 4, tp 2, pp 2: TP [0,1] [2,3], PP [0,2] [1,3], DP of one rank.
    assert mpu.get_model_parallel_world_size() == 2 and mpu.get_model_parallel_rank() == rank % 2
    assert mpu.get_model_parallel_src_rank() == rank - rank % 2
    assert mpu.get_model_parallel_group() is parallel_state.get_tensor_model_parallel_group()
    assert mpu.get_pipeline_model_parallel_world_size() == 2
    assert mpu.get_pipeline_model_parallel_rank() == rank // 2
    assert mpu.get_data_parallel_world_size() == 1 and mpu.get_data_parallel_rank() == 0
    assert mpu.get_data_parallel_src_rank() == rank
    assert mpu.get_data_parallel_group() is parallel_state.get_data_parallel_group()

    tp_rank = rank % 2
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) + 10 * tp_rank
    x.requires_grad_(True)
    out = mpu.reduce_from_model_parallel_region(x)
    assert_close(out, 2 * torch.arange(8, dtype=torch.float64).reshape(2, 4) + 10, rtol=0, atol=0)
    out = mpu.copy_to_model_parallel_region(x)
    out.backward(torch.ones(2, 4, dtype=torch.float64))
    assert_close(x.grad, torch.full((2, 4), 2.0, dtype=torch.float64), rtol=0, atol=0)
    full = torch.arange(8, dtype=torch.float64).reshape(2, 4)
    local = mpu.scatter_to_model_parallel_region(full)
    assert_close(local, full.chunk(2, -1)[tp_rank], rtol=0, atol=0)
    assert_close(mpu.gather_from_model_parallel_region(local), full, rtol=0, atol=0)

    assert mpu.ColumnParallelLinear is tensor_parallel.ColumnParallelLinear
    assert mpu.RowParallelLinear is tensor_parallel.RowParallelLinear
    assert mpu.VocabParallelEmbedding is tensor_parallel.VocabParallelEmbedding
    assert mpu.checkpoint is tensor_parallel.checkpoint
    assert mpu.get_cuda_rng_tracker() is tensor_parallel.get_cuda_rng_tracker()
    mpu.model_parallel_cuda_manual_seed(5)
    assert "model-parallel-rng" in mpu.get_cuda_rng_tracker().get_states()
    assert mpu.vocab_parallel_cross_entropy is tensor_parallel.vocab_parallel_cross_entropy

    mpu.destroy_model_parallel()
    assert not mpu.model_parallel_is_initialized()

    # fairscale / Megatron-LM v1 name the tensor-parallel size model_parallel_size_; apex passes
    # backend keywords.
    mpu.initialize_model_parallel(model_parallel_size_=4, default_backend="gloo", p2p_backend="gloo")
    assert mpu.get_model_parallel_world_size() == 4 and mpu.get_model_parallel_rank() == rank
    mpu.destroy_model_parallel()
    with pytest.raises(ValueError, match="model_parallel_size_=2 and tensor_model_parallel_size_=4 disagree"):
        mpu.initialize_model_parallel(4, model_parallel_size_=2)
    return True


def test_mpu_names():
    assert run_distributed(4, _mpu_worker) == [True] * 4
