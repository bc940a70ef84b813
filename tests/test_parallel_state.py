"""Process-group layout of parallel_state against Megatron-core's documented layout."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from tests.distributed import run_distributed

SIZES = {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2}


def test_generate_groups_world8_tp2_pp2():
    order = "tp-cp-ep-dp-pp"
    assert ps.generate_groups(SIZES, order, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ps.generate_groups(SIZES, order, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ps.generate_groups(SIZES, order, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ps.generate_groups(SIZES, order, "tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert ps.generate_groups(SIZES, order, "tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_generate_groups_other_order():
    # "tp-pp-dp": pipeline stages are adjacent tensor groups.
    assert ps.generate_groups(SIZES, "tp-cp-ep-pp-dp", "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ps.generate_groups(SIZES, "tp-cp-ep-pp-dp", "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_getters_before_initialization_raise():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_pipeline_model_parallel_rank()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_data_parallel_world_size()
    assert not ps.model_parallel_is_initialized()


def _expected(world: int, tp: int, pp: int, rank: int) -> dict:
    """The layout written out by hand from the rule: tp fastest, then dp, then pp."""
    dp = world // (tp * pp)
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    tp_group = [pp_rank * tp * dp + dp_rank * tp + t for t in range(tp)]
    dp_group = [pp_rank * tp * dp + d * tp + tp_rank for d in range(dp)]
    pp_group = [p * tp * dp + dp_rank * tp + tp_rank for p in range(pp)]
    mp_group = sorted(p * tp * dp + dp_rank * tp + t for p in range(pp) for t in range(tp))
    embd = pp_group if pp == 1 else [pp_group[0], pp_group[-1]]
    return dict(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, tp_group=tp_group,
                dp_group=dp_group, pp_group=pp_group, mp_group=mp_group, embd=embd, dp=dp)


def _layouts_worker(layouts):
    rank, world = dist.get_rank(), dist.get_world_size()
    for tp, pp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        e = _expected(world, tp, pp, rank)
        assert ps.model_parallel_is_initialized()
        assert ps.get_tensor_model_parallel_world_size() == tp
        assert ps.get_tensor_model_parallel_rank() == e["tp_rank"]
        assert ps.get_pipeline_model_parallel_world_size() == pp
        assert ps.get_pipeline_model_parallel_rank() == e["pp_rank"]
        assert ps.get_data_parallel_world_size() == e["dp"]
        assert ps.get_data_parallel_rank() == e["dp_rank"]
        assert dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()) == e["tp_group"]
        assert dist.get_process_group_ranks(ps.get_data_parallel_group()) == e["dp_group"]
        assert dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) == e["pp_group"]
        assert sorted(dist.get_process_group_ranks(ps.get_model_parallel_group())) == e["mp_group"]
        if rank in e["embd"]:
            assert dist.get_process_group_ranks(ps.get_embedding_group()) == e["embd"]
        else:
            with pytest.raises(RuntimeError, match=f"rank {rank} is not a member of any embedding group"):
                ps.get_embedding_group()
        assert ps.is_rank_in_position_embedding_group() == (rank == e["pp_group"][0])
        if rank == e["pp_group"][0]:
            assert dist.get_process_group_ranks(ps.get_position_embedding_group()) == [rank]
        assert ps.get_tensor_model_parallel_src_rank() == e["tp_group"][0]
        assert ps.get_data_parallel_src_rank() == e["dp_group"][0]
        assert ps.get_pipeline_model_parallel_first_rank() == e["pp_group"][0]
        assert ps.get_pipeline_model_parallel_last_rank() == e["pp_group"][-1]
        assert ps.get_pipeline_model_parallel_next_rank() == e["pp_group"][(e["pp_rank"] + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == e["pp_group"][(e["pp_rank"] - 1) % pp]
        assert ps.is_pipeline_first_stage() == (e["pp_rank"] == 0)
        assert ps.is_pipeline_last_stage() == (e["pp_rank"] == pp - 1)
        assert ps.is_rank_in_embedding_group() == (rank in e["embd"])
        # The groups really connect the ranks listed: a sum over each gives the rank sum.
        for group, ranks in ((ps.get_tensor_model_parallel_group(), e["tp_group"]),
                             (ps.get_data_parallel_group(), e["dp_group"]),
                             (ps.get_pipeline_model_parallel_group(), e["pp_group"])):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            assert t.item() == sum(ranks)
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
    return True


def _virtual_and_errors_worker():
    world = dist.get_world_size()
    ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=3)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 3
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    first = ps.get_pipeline_model_parallel_rank() == 0
    assert ps.is_pipeline_first_stage() == first
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert not ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    assert ps.is_pipeline_first_stage(ignore_virtual=True) == first
    ps.set_virtual_pipeline_model_parallel_rank(2)
    assert ps.is_pipeline_last_stage() == (not first)
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(1, 1)
    ps.destroy_model_parallel()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None

    with pytest.raises(RuntimeError, match=rf"world size {world} is not divisible .* = 3"):
        ps.initialize_model_parallel(3, 1)
    with pytest.raises(RuntimeError, match="tensor_model_parallel_size must be an integer >= 1, got 0"):
        ps.initialize_model_parallel(0, 1)
    with pytest.raises(RuntimeError, match="pipeline_model_parallel_size must be an integer >= 1, got -1"):
        ps.initialize_model_parallel(1, -1)
    with pytest.raises(RuntimeError, match="needs pipeline_model_parallel_size > 1"):
        ps.initialize_model_parallel(2, 1, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="context_parallel_size=2 is not supported"):
        ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    with pytest.raises(RuntimeError, match="expert_model_parallel_size=2 is not supported"):
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    assert not ps.model_parallel_is_initialized()
    return True


LAYOUTS = {
    1: [(1, 1)],
    2: [(1, 1), (2, 1), (1, 2)],
    4: [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)],
    8: [(2, 2), (2, 4), (4, 2), (8, 1), (1, 8), (1, 2)],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts(world):
    assert run_distributed(world, _layouts_worker, LAYOUTS[world]) == [True] * world


def test_virtual_pipeline_and_errors():
    assert run_distributed(2, _virtual_and_errors_worker) == [True, True]
