"""HyperCommGrid: the rank enumeration of Megatron-core's grid (first dimension fastest) and process
groups equal to parallel_state's for the same layout."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.hyper_comm_grid import HyperCommGrid
from tests.distributed import run_distributed


def test_rank_enumeration(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    grid = HyperCommGrid([2, 2, 2], ["a", "b", "c"], rank_offset=8)
    assert grid.get_rank_enum("a") == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.get_rank_enum("b") == [[8, 10], [9, 11], [12, 14], [13, 15]]
    assert (
        grid.get_rank_enum(["b", "a"]) == grid.get_rank_enum(["a", "b"]) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    )
    assert grid.get_rank_enum(["a", "c"]) == [[8, 9, 12, 13], [10, 11, 14, 15]]
    with pytest.raises(ValueError, match=r"len\(shape\)"):
        HyperCommGrid([2, 2], ["a"])
    with pytest.raises(RuntimeError, match="over sized"):
        HyperCommGrid([4, 4], ["a", "b"], rank_offset=1)
    with pytest.raises(ValueError, match=r"unknown dimensions \['x'\]"):
        grid.get_rank_enum("x")


def _groups_worker() -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # tp 2 x dp 2
    grid = HyperCommGrid([2, 1, 2], ["tp", "pp", "dp"])
    ranks = dist.get_process_group_ranks
    tp, dp = grid.create_pg("tp"), grid.create_pg(["dp"])
    assert grid.get_pg("tp") is tp
    with pytest.raises(KeyError, match="already been created"):
        grid.create_pg("tp")
    with pytest.raises(KeyError, match="hasn't been created"):
        grid.get_pg("pp")
    return {
        "tp": ranks(tp) == ranks(ps.get_tensor_model_parallel_group()),
        "dp": ranks(dp) == ranks(ps.get_data_parallel_group()),
    }


@pytest.mark.slow
def test_groups_equal_parallel_state():
    for out in run_distributed(4, _groups_worker):
        assert out == {"tp": True, "dp": True}
