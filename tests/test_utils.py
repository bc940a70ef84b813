"""tensor_parallel.utils: size arithmetic, splits and the vocabulary ranges."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.tensor_parallel import utils
from tests.distributed import run_distributed


def test_divide_and_ensure_divisibility():
    assert utils.divide(12, 4) == 3
    utils.ensure_divisibility(12, 3)
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        utils.divide(10, 4)
    with pytest.raises(ValueError, match="7 is not divisible by 2"):
        utils.ensure_divisibility(7, 2)


def test_split_tensor_along_last_dim():
    x = torch.arange(24.0).reshape(2, 12)
    chunks = utils.split_tensor_along_last_dim(x, 3)
    assert [c.tolist() for c in chunks] == [x[:, 0:4].tolist(), x[:, 4:8].tolist(), x[:, 8:12].tolist()]
    assert not chunks[1].is_contiguous()
    assert all(
        c.is_contiguous() for c in utils.split_tensor_along_last_dim(x, 3, contiguous_split_chunks=True)
    )
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        utils.split_tensor_along_last_dim(x, 5)


def test_vocab_utility():
    assert utils.VocabUtility.vocab_range_from_global_vocab_size(12, 2, 4) == (6, 9)
    assert utils.VocabUtility.vocab_range_from_per_partition_vocab_size(5, 3, 4) == (15, 20)
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        utils.VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)


def test_exported_from_tensor_parallel():
    for name in ("split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
                 "VocabUtility", "divide"):
        assert getattr(tensor_parallel, name) is getattr(utils, name)


def _split_gather_worker() -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    n = ps.get_tensor_model_parallel_world_size()
    x = torch.arange(6.0 * n, dtype=torch.float64).reshape(2, 3 * n)
    part = utils.split_tensor_into_1d_equal_chunks(x)
    copy = utils.split_tensor_into_1d_equal_chunks(x, new_buffer=True)
    got = {
        "rank": ps.get_tensor_model_parallel_rank(),
        "part": part.tolist(),
        "copy": copy.tolist(),
        "copy_is_new": copy.data_ptr() != part.data_ptr(),
        "gathered": utils.gather_split_1d_tensor(part).tolist(),
    }
    with pytest.raises(ValueError, match=f"{6 * n + 1} is not divisible by {n}"):
        utils.split_tensor_into_1d_equal_chunks(torch.ones(6 * n + 1))
    return got


def test_split_and_gather_1d():
    flat = [float(i) for i in range(12)]  # x = arange(6 n) at n = 2, flattened
    for rank, got in enumerate(run_distributed(2, _split_gather_worker)):
        assert got["rank"] == rank
        assert got["part"] == flat[6 * rank : 6 * (rank + 1)]
        assert got["copy_is_new"] and got["copy"] == got["part"]
        assert got["gathered"] == flat
