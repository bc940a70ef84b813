"""Process-group layout of parallel_state against Megatron-core's documented layout."""

import re

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


def _layouts_worker(layouts) -> list[dict]:
    """What parallel_state reports on this rank at each (tp, pp) layout (compared in the test)."""
    rank = dist.get_rank()
    out = []
    for tp, pp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        got = dict(
            initialized=ps.model_parallel_is_initialized(),
            tp=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            tp_group=dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            dp_group=dist.get_process_group_ranks(ps.get_data_parallel_group()),
            pp_group=dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
            mp_group=sorted(dist.get_process_group_ranks(ps.get_model_parallel_group())),
            in_embd=ps.is_rank_in_embedding_group(),
            in_pos_embd=ps.is_rank_in_position_embedding_group(),
            tp_src=ps.get_tensor_model_parallel_src_rank(),
            dp_src=ps.get_data_parallel_src_rank(),
            pp_first=ps.get_pipeline_model_parallel_first_rank(),
            pp_last=ps.get_pipeline_model_parallel_last_rank(),
            pp_next=ps.get_pipeline_model_parallel_next_rank(),
            pp_prev=ps.get_pipeline_model_parallel_prev_rank(),
            first_stage=ps.is_pipeline_first_stage(),
            last_stage=ps.is_pipeline_last_stage(),
        )
        if got["in_embd"]:
            got["embd"] = dist.get_process_group_ranks(ps.get_embedding_group())
        else:
            with pytest.raises(RuntimeError) as refused:
                ps.get_embedding_group()
            got["embd_refused"] = str(refused.value)
        if got["in_pos_embd"]:
            got["pos_embd"] = dist.get_process_group_ranks(ps.get_position_embedding_group())
        # The groups really connect the ranks listed: a sum over each gives the rank sum.
        for name, group in (
            ("tp_sum", ps.get_tensor_model_parallel_group()),
            ("dp_sum", ps.get_data_parallel_group()),
            ("pp_sum", ps.get_pipeline_model_parallel_group()),
        ):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            got[name] = t.item()
        # Megatron-core's module globals name the same groups (None once destroyed).
        got["globals"] = (
            ps._MODEL_PARALLEL_GROUP is ps.get_model_parallel_group(),
            ps._TENSOR_MODEL_PARALLEL_GROUP is ps.get_tensor_model_parallel_group(),
            ps._DATA_PARALLEL_GROUP_GLOO is ps.get_data_parallel_group_gloo(),
            ps._PIPELINE_GLOBAL_RANKS == dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        )
        ps.destroy_model_parallel()
        got["globals_after_destroy"] = (ps._MODEL_PARALLEL_GROUP, ps._PIPELINE_GLOBAL_RANKS)
        got["initialized_after_destroy"] = ps.model_parallel_is_initialized()
        out.append(got)
    return out


def _check_layout(got: dict, world: int, tp: int, pp: int, rank: int) -> None:
    e = _expected(world, tp, pp, rank)
    assert got["initialized"] and not got["initialized_after_destroy"]
    assert got["globals"] == (True, True, True, True) and got["globals_after_destroy"] == (None, None)
    assert (got["tp"], got["tp_rank"]) == (tp, e["tp_rank"])
    assert (got["pp"], got["pp_rank"]) == (pp, e["pp_rank"])
    assert (got["dp"], got["dp_rank"]) == (e["dp"], e["dp_rank"])
    for name in ("tp_group", "dp_group", "pp_group", "mp_group"):
        assert got[name] == e[name], name
    assert got["in_embd"] == (rank in e["embd"])
    if rank in e["embd"]:
        assert got["embd"] == e["embd"]
    else:
        assert f"rank {rank} is not a member of any embedding group" in got["embd_refused"]
    assert got["in_pos_embd"] == (rank == e["pp_group"][0])
    if rank == e["pp_group"][0]:
        assert got["pos_embd"] == [rank]
    assert got["tp_src"] == e["tp_group"][0] and got["dp_src"] == e["dp_group"][0]
    assert (got["pp_first"], got["pp_last"]) == (e["pp_group"][0], e["pp_group"][-1])
    assert got["pp_next"] == e["pp_group"][(e["pp_rank"] + 1) % pp]
    assert got["pp_prev"] == e["pp_group"][(e["pp_rank"] - 1) % pp]
    assert got["first_stage"] == (e["pp_rank"] == 0) and got["last_stage"] == (e["pp_rank"] == pp - 1)
    assert got["tp_sum"] == sum(e["tp_group"])
    assert got["dp_sum"] == sum(e["dp_group"])
    assert got["pp_sum"] == sum(e["pp_group"])


def _refusal(error: type, fn, *args, **kwargs) -> str:
    """The message of the ``error`` that ``fn(*args, **kwargs)`` raises."""
    with pytest.raises(error) as refused:
        fn(*args, **kwargs)
    return str(refused.value)


def _virtual_and_errors_worker() -> dict:
    """Stage queries under a virtual pipeline and the messages of refused calls (compared in the
    test)."""
    ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=3)
    got = {
        "vp": (
            ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_rank()
        ),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        # Megatron-core 0.16: the stage queries ignore the virtual pipeline unless asked, and then
        # need the chunk (vp_stage).
        "first_last": (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
        "first_by_chunk": [ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v) for v in range(3)],
        "last_by_chunk": [ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v) for v in range(3)],
        "in_embd": ps.is_rank_in_embedding_group(),
        "in_embd_by_chunk": [
            ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=v) for v in range(3)
        ],
        "refused": [
            _refusal(AssertionError, ps.is_pipeline_first_stage, ignore_virtual=False),
            _refusal(AssertionError, ps.is_rank_in_embedding_group, ignore_virtual=False),
        ],
    }
    with pytest.warns(DeprecationWarning):
        ps.set_virtual_pipeline_model_parallel_rank(1)
    got["vp_rank_set"] = ps.get_virtual_pipeline_model_parallel_rank()
    got["again"] = [_refusal(RuntimeError, ps.initialize_model_parallel, 1, 1),
                    _refusal(AssertionError, ps.initialize_model_parallel, 1, 1)]
    ps.destroy_model_parallel()
    got["vp_after_destroy"] = ps.get_virtual_pipeline_model_parallel_world_size()

    init = ps.initialize_model_parallel
    got["bad_input"] = [
        _refusal(RuntimeError, init, 3, 1),
        _refusal(RuntimeError, init, 0, 1),
        _refusal(RuntimeError, init, 1, -1),
        _refusal(RuntimeError, init, 2, 1, virtual_pipeline_model_parallel_size=2),
        _refusal(RuntimeError, init, 1, 1, expert_model_parallel_size=3),
        _refusal(RuntimeError, init, 1, 1, use_sharp=True),
        _refusal(RuntimeError, init, 1, 1, high_priority_stream_groups=["dp"]),
        _refusal(RuntimeError, init, 1, 1, context_parallel_size=2, order="tp-dp-pp"),
    ]
    got["initialized_after_refusals"] = ps.model_parallel_is_initialized()

    # Megatron's positional order: (tp, pp, vpp, pp_comm_backend, use_sharp, cp, hcp, hybrid_cp, ep, ...).
    ps.initialize_model_parallel(1, 1, None, None, False, 2, None, False, 2)
    got["positional"] = (ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
    ps.destroy_model_parallel()
    return got


def _check_virtual_and_errors(got: dict, world: int) -> None:
    first = got["pp_rank"] == 0
    assert got["vp"] == (3, 0)
    assert got["first_last"] == (first, not first)
    assert got["first_by_chunk"][0] == first and not got["first_by_chunk"][1]
    assert not got["last_by_chunk"][1] and got["last_by_chunk"][2] == (not first)
    assert got["in_embd"]
    assert got["in_embd_by_chunk"] == [first, False, not first]
    assert len(got["refused"]) == 2
    assert all("vp_stage must be passed" in message for message in got["refused"])
    assert got["vp_rank_set"] == 1
    assert all("already initialized" in message for message in got["again"])
    assert got["vp_after_destroy"] is None
    patterns = [
        rf"world size {world} is not divisible .* = 3",
        "tensor_model_parallel_size must be an integer >= 1, got 0",
        "pipeline_model_parallel_size must be an integer >= 1, got -1",
        "needs pipeline_model_parallel_size > 1",
        "expert_model_parallel_size.*= 3",
        "use_sharp=True is not supported",
        "need the nccl backend",
        "the size of cp is 2, but order 'tp-dp-pp' does not place it",
    ]
    assert len(got["bad_input"]) == len(patterns)
    for pattern, message in zip(patterns, got["bad_input"]):
        assert re.search(pattern, message), (pattern, message)
    assert not got["initialized_after_refusals"]
    assert got["positional"] == (2, 2)


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


def _cp_ep_worker() -> dict:
    """What parallel_state reports on this rank with context and expert parallelism, the
    distributed-optimizer instances and another order (compared in the test)."""
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
    groups = {
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
    got = {"groups": {k: ranks(g) for k, g in groups.items()}}
    got["dp_cp_all_gather"] = ranks(ps.get_data_parallel_group(True, independent_all_gather=True))
    got["separate_all_gather"] = ps.has_separate_all_gather_group()
    got["partial_dp_cp"] = ranks(ps.get_data_parallel_group(True, partial_data_parallel=True))
    got["partial_edp"] = ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True))
    # On gloo the gloo data-parallel groups are the groups themselves.
    got["same_objects"] = [
        ps.get_data_parallel_group_gloo() is groups["dp"],
        ps.get_data_parallel_group_gloo(with_context_parallel=True) is groups["dp_cp"],
        ps.get_expert_data_parallel_group_gloo() is groups["edp"],
        ps.get_amax_reduction_group() is groups["tp_dp"],
        ps.get_amax_reduction_group(True, True) is groups["tp_cp"],
    ]
    got["cp_global_ranks"] = ps.get_context_parallel_global_ranks()
    got["hcp"] = [ranks(g) for g in ps.get_hierarchical_context_parallel_groups()]
    got["sizes_and_ranks"] = dict(
        cp=(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()),
        tp_cp=(ps.get_tensor_and_context_parallel_world_size(), ps.get_tensor_and_context_parallel_rank()),
        dp=(ps.get_data_parallel_world_size(), ps.get_data_parallel_world_size(True)),
        dp_cp=(ps.get_data_parallel_rank(with_context_parallel=True),
               ps.get_data_parallel_src_rank(with_context_parallel=True)),
        ep=(ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_src_rank()),
        etp=(ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()),
        etp_ep=ps.get_expert_tensor_and_model_parallel_world_size(),
        edp=(ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()),
        mp_src=ps.get_model_parallel_src_rank(),
    )
    with pytest.warns(DeprecationWarning):
        got["same_objects"].append(ps.get_data_modulo_expert_parallel_group() is groups["edp"])
    got["all_ranks"] = ps.get_all_ranks()
    with pytest.raises(AssertionError) as refused:
        ps.get_inter_distributed_optimizer_instance_group()
    got["inter_refused"] = str(refused.value)
    ps.set_expert_model_parallel_world_size(7)
    got["ep_size_override"] = ps.get_expert_model_parallel_world_size()
    buf = ps.get_global_memory_buffer().get_tensor((2, 3), torch.float64, "x")
    got["buffer"] = (tuple(buf.shape), str(buf.dtype))
    # The groups really connect the ranks listed.
    got["sums"] = {}
    for k in ("cp", "dp_cp", "tp_cp", "edp", "ep"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=groups[k])
        got["sums"][k] = t.item()
    ps.destroy_model_parallel()
    with pytest.raises(AssertionError) as refused:
        ps.get_expert_model_parallel_world_size()  # the override went with destroy_model_parallel
    got["ep_refused_after_destroy"] = str(refused.value)

    ps.initialize_model_parallel(
        2, 1, None, None, False, 2, None, True, 2, 2, 1, create_gloo_process_groups=False
    )
    got["instances"] = dict(
        intra_dp_cp=ranks(ps.get_data_parallel_group(True, partial_data_parallel=True)),
        intra_edp=ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
        inter_edp=ranks(ps.get_inter_distributed_optimizer_instance_group()),
        intra_dist_opt=ranks(ps.get_intra_distributed_optimizer_instance_group()),
    )
    # hybrid_context_parallel: power-of-two groups of consecutive data x context ranks.
    got["hybrid_pair"] = ranks(ps.get_hybrid_data_context_parallel_groups(group_size=2))
    got["hybrid_4_is_dp_cp"] = (
        ps.get_hybrid_data_context_parallel_groups(group_size=4) is ps.get_data_parallel_group(True)
    )
    with pytest.raises(AssertionError) as refused:
        ps.get_data_parallel_group_gloo()
    got["gloo_refused"] = str(refused.value)
    ps.destroy_model_parallel()

    # Order without pp last and omitted size-1 dims: "tp-ep-dp-pp" (cp appended).
    ps.initialize_model_parallel(2, 2, order="tp-ep-dp-pp", expert_model_parallel_size=2)
    got["ordered"] = (
        ranks(ps.get_pipeline_model_parallel_group()), ranks(ps.get_expert_model_parallel_group())
    )
    ps.destroy_model_parallel()
    return got


@pytest.mark.slow  # 8 ranks
def test_context_and_expert_groups_world8():
    for rank, got in enumerate(run_distributed(8, _cp_ep_worker)):
        e = {k: _mine(v, rank) for k, v in CP_EP_EXPECTED.items()}
        for k, group in got["groups"].items():
            assert group == e[k], (rank, k, group, e[k])
        assert got["dp_cp_all_gather"] == e["dp_cp"] and got["separate_all_gather"]
        assert got["partial_dp_cp"] == e["dp_cp"] and got["partial_edp"] == e["edp"]
        assert got["same_objects"] == [True] * 6
        assert got["cp_global_ranks"] == e["cp"]
        assert got["hcp"] == [e["cp"], [rank]]
        assert got["sizes_and_ranks"] == dict(
            cp=(2, e["cp"].index(rank)),
            tp_cp=(4, e["tp_cp"].index(rank)),
            dp=(2, 4),
            dp_cp=(e["dp_cp"].index(rank), e["dp_cp"][0]),
            ep=(2, e["ep"].index(rank), e["ep"][0]),
            etp=(1, 0),
            etp_ep=2,
            edp=(4, e["edp"].index(rank)),
            mp_src=e["mp"][0],
        )
        assert got["all_ranks"] == "_".join(
            str(x)
            for x in (e["tp"].index(rank), e["dp"].index(rank), e["cp"].index(rank), 0, e["ep"].index(rank))
        )
        assert "inter distributed optimizer instance" in got["inter_refused"]
        assert got["ep_size_override"] == 7
        assert got["buffer"] == ((2, 3), "torch.float64")
        assert got["sums"] == {k: float(sum(e[k])) for k in ("cp", "dp_cp", "tp_cp", "edp", "ep")}
        assert "expert model parallel group is not initialized" in got["ep_refused_after_destroy"]

        assert got["instances"] == {k: _mine(v, rank) for k, v in INSTANCES_EXPECTED.items()}
        dp_cp = e["dp_cp"]
        assert got["hybrid_pair"] == (dp_cp[:2] if rank in dp_cp[:2] else dp_cp[2:])
        assert got["hybrid_4_is_dp_cp"]
        assert "data parallel gloo" in got["gloo_refused"]

        assert got["ordered"] == (
            [rank % 4, rank % 4 + 4], [rank - rank % 4 + rank % 2, rank - rank % 4 + rank % 2 + 2]
        )


LAYOUTS = {
    1: [(1, 1)],
    2: [(1, 1), (2, 1), (1, 2)],
    4: [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)],
    8: [(2, 2), (2, 4), (4, 2), (8, 1), (1, 8), (1, 2)],
}


@pytest.mark.parametrize(
    "world", [pytest.param(w, marks=pytest.mark.slow) if w == 8 else w for w in sorted(LAYOUTS)]
)  # 8 ranks: slow
@pytest.mark.slow
def test_layouts(world):
    for rank, per_layout in enumerate(run_distributed(world, _layouts_worker, LAYOUTS[world])):
        assert len(per_layout) == len(LAYOUTS[world])
        for (tp, pp), got in zip(LAYOUTS[world], per_layout):
            _check_layout(got, world, tp, pp, rank)


def test_virtual_pipeline_and_errors():
    results = run_distributed(2, _virtual_and_errors_worker)
    assert sorted(got["pp_rank"] for got in results) == [0, 1]
    for got in results:
        _check_virtual_and_errors(got, 2)
