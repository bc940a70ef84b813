"""broadcast_data from tensor-parallel rank 0 (world 4, TP 2: groups [0, 1] and [2, 3])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from tests.distributed import run_distributed


def _batch(source_rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + source_rank)
    return {
        "text": torch.randint(0, 1000, (2, 5), generator=g),
        "labels": torch.randint(0, 1000, (3, 1, 4), generator=g).transpose(0, 2),  # non-contiguous
        "count": torch.tensor(7 + source_rank),  # 0-d
        "empty": torch.zeros(0, 3, dtype=torch.long),
    }


def _data_worker() -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    is_source = ps.get_tensor_model_parallel_rank() == 0
    source = ps.get_tensor_model_parallel_src_rank()
    assert source == rank - rank % 2
    keys = ["text", "labels", "count", "empty"]
    expected = _batch(source)

    for group in (None, ps.get_tensor_model_parallel_group()):
        got = tp_.broadcast_data(keys, _batch(rank) if is_source else None, torch.int64, tp_group=group)
        assert list(got) == keys
        for key in keys:
            assert got[key].dtype == torch.int64 and got[key].device.type == "cpu"
            assert torch.equal(got[key], expected[key]), key

    # A subset of keys, in another order; float data.
    floats = {"a": torch.full((2, 2), float(source)), "b": torch.arange(3.0)}
    got = tp_.broadcast_data(["b", "a"], floats if is_source else None, torch.float32)
    assert torch.equal(got["a"], torch.full((2, 2), float(source))) and torch.equal(
        got["b"], torch.arange(3.0)
    )

    # Bad data on the source raises on every rank of the group instead of hanging the others.
    bad = {"text": torch.zeros(2, 2, dtype=torch.int32)}
    with pytest.raises(
        ValueError,
        match=r"data\['text'\] has dtype torch.int32, expected torch.int64"
        if is_source
        else "rank 0 \\(the source\\) rejected its data",
    ):
        tp_.broadcast_data(["text"], bad if is_source else None, torch.int64)
    with pytest.raises(ValueError, match="key 'labels' is missing" if is_source else "rejected its data"):
        tp_.broadcast_data(
            ["text", "labels"], {"text": torch.zeros(1, dtype=torch.long)} if is_source else None, torch.int64
        )
    with pytest.raises(
        ValueError, match="data is None on tensor-parallel rank 0" if is_source else "rejected"
    ):
        tp_.broadcast_data(["text"], None, torch.int64)

    # The group still works after the errors.
    got = tp_.broadcast_data(["text"], _batch(rank) if is_source else None, torch.int64)
    assert torch.equal(got["text"], expected["text"])


@pytest.mark.slow
def test_broadcast_data():
    run_distributed(4, _data_worker)
