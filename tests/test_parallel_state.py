"""Process-group layout of parallel_state against Megatron-core's documented layout."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from tests.distributed import run_distributed


def _gen(tp, cp, ep, dp, pp, order="tp-cp-ep-dp-pp"):
    return ps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)


def test_rank_generator_world8_tp2_pp2():
    g = _gen(2, 1, 1, 2, 2)
    assert g.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.get_ranks("tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_rank_generator_other_order_and_omitted_dims():
    # "tp-pp-dp": pipeline stages are adjacent tensor groups.
    g = _gen(2, 1, 1, 2, 2, order="tp-cp-ep-pp-dp")
    assert g.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Size-1 dimensions may be left out of the order; Megatron appends them.
    short = _gen(2, 1, 1, 2, 2, order="tp-pp-dp")
    assert short.order == "tp-pp-dp-ep-cp"
    assert short.get_ranks("dp") == g.get_ranks("dp") and short.get_ranks("cp") == g.get_ranks("cp")
    with pytest.raises(RuntimeError, match="the size of cp is 2, but order 'tp-dp-pp' does not place it"):
        _gen(2, 2, 1, 1, 2, order="tp-dp-pp")
    with pytest.raises(AssertionError, match="not both"):
        _gen(1, 2, 2, 1, 1)
    with pytest.raises(RuntimeError, match="must name each of tp, cp, ep, dp, pp"):
        _gen(1, 1, 1, 1, 1, order="tp-xx")


def test_masked_orthogonal_rank_groups_documented_example():
    # Megatron-core's docstring: sizes [tp, dp, pp] = [2, 3, 4], the dp groups are
    # tp_rank + range(3) * 2 + pp_rank * 6.
    groups = ps.generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]
    assert len(groups) == 8
    # Megatron-core's initialize_model_parallel docstring: 16 ranks, tp 2, pp 4.
    g = _gen(2, 1, 1, 2, 4)
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # Its context-parallel example: 8 ranks, tp 4, cp 2: [0,4] [1,5] [2,6] [3,7].
    assert _gen(4, 2, 1, 1, 1).get_ranks("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_getters_before_initialization_raise():
    for getter in (
        ps.get_tensor_model_parallel_group,
        ps.get_pipeline_model_parallel_rank,
        ps.get_expert_model_parallel_group,
        ps.get_context_parallel_group,
        ps.get_data_parallel_group_gloo,
        ps.get_global_memory_buffer,
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            getter()
        # Megatron-core asserts: user code catches AssertionError.
        with pytest.raises(AssertionError):
            getter()
    assert issubclass(ps.ParallelStateError, RuntimeError) and issubclass(
        ps.ParallelStateError, AssertionError
    )
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert ps.get_tensor_and_data_parallel_group(False, True) is None
    # Without torch.distributed these sizes are 0, as in Megatron-core.
    assert ps.get_data_parallel_world_size() == 0 and ps.get_context_parallel_rank() == 0
    with pytest.raises(AssertionError, match="torch.distributed is not initialized"):
        ps.initialize_model_parallel()
    assert not ps.model_parallel_is_initialized() and not ps.is_initialized()


def _expected(world: int, tp: int, pp: int, rank: int) -> dict:
    """The layout written out by hand from the rule: tp fastest, then dp, then pp."""
    dp = world // (tp * pp)
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    tp_group = [pp_rank * tp * dp + dp_rank * tp + t for t in range(tp)]
    dp_group = [pp_rank * tp * dp + d * tp + tp_rank for d in range(dp)]
    pp_group = [p * tp * dp + dp_rank * tp + tp_rank for p in range(pp)]
    mp_group = sorted(p * tp * dp + dp_rank * tp + t for p in range(pp) for t in range(tp))
    embd = pp_group if pp == 1 else [pp_group[0], pp_group[-1]]
    return dict(
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        tp_group=tp_group,
        dp_group=dp_group,
        pp_group=pp_group,
        mp_group=mp_group,
        embd=embd,
        dp=dp,
    )


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
        for group, ranks in (
            (ps.get_tensor_model_parallel_group(), e["tp_group"]),
            (ps.get_data_parallel_group(), e["dp_group"]),
            (ps.get_pipeline_model_parallel_group(), e["pp_group"]),
        ):
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
    # Megatron-core 0.16: the stage queries ignore the virtual pipeline unless asked, and then
    # need the chunk (vp_stage).
    assert ps.is_pipeline_first_stage() == first and ps.is_pipeline_last_stage() == (not first)
    assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == first
    assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
    assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=2) == (not first)
    assert ps.is_rank_in_embedding_group()
    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=0) == first
    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=2) == (not first)
    assert not ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=1)
    with pytest.raises(AssertionError, match="vp_stage must be passed"):
        ps.is_pipeline_first_stage(ignore_virtual=False)
    with pytest.raises(AssertionError, match="vp_stage must be passed"):
        ps.is_rank_in_embedding_group(ignore_virtual=False)
    with pytest.warns(DeprecationWarning):
        ps.set_virtual_pipeline_model_parallel_rank(1)
    assert ps.get_virtual_pipeline_model_parallel_rank() == 1
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(1, 1)
    with pytest.raises(AssertionError, match="already initialized"):
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
    with pytest.raises(RuntimeError, match="expert_model_parallel_size.*= 3"):
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=3)
    with pytest.raises(RuntimeError, match="use_sharp=True is not supported"):
        ps.initialize_model_parallel(1, 1, use_sharp=True)
    with pytest.raises(RuntimeError, match="need the nccl backend"):
        ps.initialize_model_parallel(1, 1, high_priority_stream_groups=["dp"])
    with pytest.raises(RuntimeError, match="the size of cp is 2, but order 'tp-dp-pp' does not place it"):
        ps.initialize_model_parallel(1, 1, context_parallel_size=2, order="tp-dp-pp")
    assert not ps.model_parallel_is_initialized()

    # Megatron's positional order: (tp, pp, vpp, pp_comm_backend, use_sharp, cp, hcp, hybrid_cp, ep, ...).
    ps.initialize_model_parallel(1, 1, None, None, False, 2, None, False, 2)
    assert ps.get_context_parallel_world_size() == 2 and ps.get_expert_model_parallel_world_size() == 2
    ps.destroy_model_parallel()
    return True


# Rank lists at world 8, written out from Megatron-core's rule (rank = tp + 2 cp + 4 dp for the
# dense layout tp 2, cp 2, dp 2; rank = ep + 2 edp for the expert layout etp 1, ep 2, edp 4), not
# from megatron_ext's output.
CP_EP_EXPECTED = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "tp_dp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "tp_dp_cp": [list(range(8))],
    "mp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "pp": [[r] for r in range(8)],
    "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "etp": [[r] for r in range(8)],
    "etp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "etp_ep_pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "intra_dist_opt": [list(range(8))],
}
# The same with num_distributed_optimizer_instances=2: each data x context group splits into two
# halves; the expert-data group [0,2,4,6] into intra [0,2][4,6] and inter [0,4][2,6]; an optimizer
# instance is two consecutive expert model-parallel groups.
INSTANCES_EXPECTED = {
    "intra_dp_cp": [[0, 2], [4, 6], [1, 3], [5, 7]],
    "intra_edp": [[0, 2], [4, 6], [1, 3], [5, 7]],
    "inter_edp": [[0, 4], [2, 6], [1, 5], [3, 7]],
    "intra_dist_opt": [[0, 1, 2, 3], [4, 5, 6, 7]],
}


def _mine(expected, rank):
    (group,) = [g for g in expected if rank in g]
    return group


def _cp_ep_worker():
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        create_all_gather_group=True,
        hierarchical_context_parallel_sizes=[2, 1],
    )
    e = {k: _mine(v, rank) for k, v in CP_EP_EXPECTED.items()}
    got = {
        "tp": ps.get_tensor_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tp_cp": ps.get_tensor_and_context_parallel_group(),
        "tp_dp": ps.get_tensor_and_data_parallel_group(),
        "tp_dp_cp": ps.get_tensor_and_data_parallel_group(True, True),
        "mp": ps.get_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "etp_ep": ps.get_expert_tensor_and_model_parallel_group(),
        "etp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group(),
    }
    for k, group in got.items():
        assert ranks(group) == e[k], (k, ranks(group), e[k])
    assert ranks(ps.get_data_parallel_group(True, independent_all_gather=True)) == e["dp_cp"]
    assert ps.has_separate_all_gather_group()
    assert ranks(ps.get_data_parallel_group(True, partial_data_parallel=True)) == e["dp_cp"]
    assert ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)) == e["edp"]
    # On gloo the gloo data-parallel groups are the groups themselves.
    assert ps.get_data_parallel_group_gloo() is ps.get_data_parallel_group()
    assert ps.get_data_parallel_group_gloo(with_context_parallel=True) is got["dp_cp"]
    assert ps.get_expert_data_parallel_group_gloo() is got["edp"]
    assert ps.get_amax_reduction_group() is got["tp_dp"]
    assert ps.get_amax_reduction_group(True, True) is got["tp_cp"]
    assert ps.get_context_parallel_global_ranks() == e["cp"]
    hcp = ps.get_hierarchical_context_parallel_groups()
    assert [ranks(g) for g in hcp] == [e["cp"], [rank]]
    assert ps.get_context_parallel_world_size() == 2 and ps.get_context_parallel_rank() == e["cp"].index(rank)
    assert ps.get_tensor_and_context_parallel_world_size() == 4
    assert ps.get_tensor_and_context_parallel_rank() == e["tp_cp"].index(rank)
    assert ps.get_data_parallel_world_size() == 2 and ps.get_data_parallel_world_size(True) == 4
    assert ps.get_data_parallel_rank(with_context_parallel=True) == e["dp_cp"].index(rank)
    assert ps.get_data_parallel_src_rank(with_context_parallel=True) == e["dp_cp"][0]
    assert ps.get_expert_model_parallel_world_size() == 2
    assert ps.get_expert_model_parallel_rank() == e["ep"].index(rank)
    assert ps.get_expert_model_parallel_src_rank() == e["ep"][0]
    assert ps.get_expert_tensor_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_rank() == 0
    assert ps.get_expert_tensor_and_model_parallel_world_size() == 2
    assert ps.get_expert_data_parallel_world_size() == 4
    assert ps.get_expert_data_parallel_rank() == e["edp"].index(rank)
    with pytest.warns(DeprecationWarning):
        assert ps.get_data_modulo_expert_parallel_group() is got["edp"]
    assert ps.get_model_parallel_src_rank() == e["mp"][0]
    assert ps.get_all_ranks() == "_".join(
        str(x)
        for x in (e["tp"].index(rank), e["dp"].index(rank), e["cp"].index(rank), 0, e["ep"].index(rank))
    )
    with pytest.raises(AssertionError, match="inter distributed optimizer instance"):
        ps.get_inter_distributed_optimizer_instance_group()
    ps.set_expert_model_parallel_world_size(7)
    assert ps.get_expert_model_parallel_world_size() == 7
    buf = ps.get_global_memory_buffer().get_tensor((2, 3), torch.float64, "x")
    assert buf.shape == (2, 3) and buf.dtype == torch.float64
    # The groups really connect the ranks listed.
    for k in ("cp", "dp_cp", "tp_cp", "edp", "ep"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=got[k])
        assert t.item() == sum(e[k])
    ps.destroy_model_parallel()
    with pytest.raises(AssertionError, match="expert model parallel group is not initialized"):
        ps.get_expert_model_parallel_world_size()  # the override went with destroy_model_parallel

    ps.initialize_model_parallel(
        2, 1, None, None, False, 2, None, True, 2, 2, 1, create_gloo_process_groups=False
    )
    e = {k: _mine(v, rank) for k, v in INSTANCES_EXPECTED.items()}
    assert ranks(ps.get_data_parallel_group(True, partial_data_parallel=True)) == e["intra_dp_cp"]
    assert ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)) == e["intra_edp"]
    assert ranks(ps.get_inter_distributed_optimizer_instance_group()) == e["inter_edp"]
    assert ranks(ps.get_intra_distributed_optimizer_instance_group()) == e["intra_dist_opt"]
    # hybrid_context_parallel: power-of-two groups of consecutive data x context ranks.
    dp_cp = _mine(CP_EP_EXPECTED["dp_cp"], rank)
    pair = dp_cp[:2] if rank in dp_cp[:2] else dp_cp[2:]
    assert ranks(ps.get_hybrid_data_context_parallel_groups(group_size=2)) == pair
    assert ps.get_hybrid_data_context_parallel_groups(group_size=4) is ps.get_data_parallel_group(True)
    with pytest.raises(AssertionError, match="data parallel gloo"):
        ps.get_data_parallel_group_gloo()
    ps.destroy_model_parallel()

    # Order without pp last and omitted size-1 dims: "tp-ep-dp-pp" (cp appended).
    ps.initialize_model_parallel(2, 2, order="tp-ep-dp-pp", expert_model_parallel_size=2)
    assert ranks(ps.get_pipeline_model_parallel_group()) == [rank % 4, rank % 4 + 4]
    assert ranks(ps.get_expert_model_parallel_group()) == [
        rank - rank % 4 + rank % 2,
        rank - rank % 4 + rank % 2 + 2,
    ]
    ps.destroy_model_parallel()
    return True


def test_context_and_expert_groups_world8():
    assert run_distributed(8, _cp_ep_worker) == [True] * 8


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
