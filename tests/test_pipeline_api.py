"""Megatron-core 0.16.1's public names of ``pipeline_parallel.schedules`` and
``pipeline_parallel.p2p_communication``, with their parameters in order, all present here.

The lists are the names each Megatron-core module defines (functions, classes, type aliases),
plus the classes its schedules take as arguments (``P2PCommunicator``,
``ProcessGroupCollection``) and the model helpers user code imports from ``schedules``."""

from __future__ import annotations

import inspect

import pytest

from megatron_ext.pipeline_parallel import p2p_communication, schedules
from megatron_ext.process_groups_config import ProcessGroupCollection

SCHEDULE_KWARGS = [
    "forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
    "decoder_seq_length", "forward_only", "collect_non_loss_data", "first_val_step",
    "adjust_tensor_shapes_fn", "p2p_communicator", "pg_collection", "force_all_reduce",
]

# name -> (positional-or-keyword parameters in order, keyword-only parameters in order)
SCHEDULES_API: dict[str, tuple[list[str], list[str]] | None] = {
    "Shape": None,
    "P2PCommunicator": None,
    "ProcessGroupCollection": None,
    "parallel_state": None,
    "get_attr_wrapped_model": None,
    "get_model_config": None,
    "get_forward_backward_func": (["pp_size", "vp_size"], []),
    "deallocate_output_tensor": (["out", "deallocate_pipeline_outputs"], []),
    "custom_backward": (["output", "grad_output"], []),
    "set_current_microbatch": (["model", "microbatch_id"], []),
    "forward_step_calc_loss": (
        ["model", "output_tensor", "loss_func", "config", "vp_stage", "collect_non_loss_data",
         "num_microbatches", "forward_data_store", "cp_group_size", "is_last_stage"], []),
    "forward_step": (
        ["forward_step_func", "data_iterator", "model", "num_microbatches", "input_tensor",
         "forward_data_store", "config", "cp_group_size", "collect_non_loss_data",
         "checkpoint_activations_microbatch", "is_first_microbatch", "current_microbatch", "vp_stage",
         "is_last_stage"], []),
    "backward_step": (
        ["input_tensor", "output_tensor", "output_tensor_grad", "model_type", "config"], []),
    "check_first_val_step": (["first_val_step", "forward_only", "cond"], []),
    "forward_backward_no_pipelining": ([], SCHEDULE_KWARGS),
    "clear_embedding_activation_buffer": (["config", "model", "is_last_stage"], []),
    "finish_embedding_wgrad_compute": (["config", "embedding_module", "is_last_stage", "tp_group"], []),
    "get_pp_rank_microbatches": (
        ["num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage", "forward_only",
         "overlap_moe_expert_parallel_comm", "p2p_communicator"], []),
    "get_schedule_table": (
        ["num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage"], []),
    "forward_backward_pipelining_with_interleaving": ([], SCHEDULE_KWARGS),
    "get_tensor_shapes": ([], ["seq_length", "micro_batch_size", "decoder_seq_length", "config", "tp_group",
                               "cp_group"]),
    "forward_backward_pipelining_without_interleaving": ([], SCHEDULE_KWARGS),
}

P2P_API: dict[str, tuple[list[str], list[str]] | None] = {
    "Shape": None,
    "is_single_shape": (["x"], []),
    "P2PCommunicator": None,
    "P2PCommunicator.__init__": (["self", "pp_group", "config"], []),
    "P2PCommunicator._communicate_shapes": (["self", "tensor_send_next", "tensor_send_prev", "recv_prev",
                                             "recv_next"], []),
    "P2PCommunicator._communicate": (
        ["self"], ["tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next", "tensor_shape",
                   "wait_on_reqs"]),
    "P2PCommunicator.recv_forward": (["self", "tensor_shapes", "is_first_stage"], []),
    "P2PCommunicator.recv_backward": (["self", "tensor_shapes", "is_last_stage"], []),
    "P2PCommunicator.send_forward": (["self", "output_tensors", "is_last_stage"], []),
    "P2PCommunicator.send_backward": (["self", "input_tensor_grads", "is_first_stage"], []),
    "P2PCommunicator.send_forward_recv_backward": (
        ["self", "output_tensors", "tensor_shapes", "is_last_stage"], []),
    "P2PCommunicator.send_backward_recv_forward": (["self", "input_tensor_grads", "tensor_shapes",
                                                    "is_first_stage"], []),
    "P2PCommunicator.send_forward_recv_forward": (["self", "output_tensor", "recv_prev", "tensor_shape",
                                                   "overlap_p2p_comm"], []),
    "P2PCommunicator.send_backward_recv_backward": (["self", "input_tensor_grad", "recv_next", "tensor_shape",
                                                     "overlap_p2p_comm"], []),
    "P2PCommunicator.send_forward_backward_recv_forward_backward": (
        ["self", "output_tensor", "input_tensor_grad", "recv_prev", "recv_next", "tensor_shape"], []),
}

PROCESS_GROUP_FIELDS = [
    "tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "hcp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
    "tp_dp_cp", "dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt",
]


def _lookup(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check(module, api) -> None:
    missing = [name for name in api if not _has(module, name)]
    assert not missing, f"{module.__name__} lacks {missing}"
    for name, expected in api.items():
        if expected is None:
            continue
        params = inspect.signature(_lookup(module, name)).parameters.values()
        positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        keyword = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        want_positional, want_keyword = expected
        # Megatron's parameters come first and in its order; any extra one is keyword-only.
        assert positional == want_positional, (name, positional)
        assert keyword[:len(want_keyword)] == want_keyword, (name, keyword)


def _has(module, dotted: str) -> bool:
    try:
        _lookup(module, dotted)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("module, api", [(schedules, SCHEDULES_API), (p2p_communication, P2P_API)],
                         ids=["schedules", "p2p_communication"])
def test_megatron_names_and_signatures(module, api):
    _check(module, api)


def test_process_group_collection_fields():
    assert list(ProcessGroupCollection.FIELDS) == PROCESS_GROUP_FIELDS
    params = inspect.signature(ProcessGroupCollection.use_mpu_process_groups).parameters
    assert list(params) == ["required_pgs"]


def _stage_helpers() -> dict:

    from megatron_ext import parallel_state as ps
    from megatron_ext.pipeline_parallel import utils

    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    group = ps.get_pipeline_model_parallel_group()
    return {
        "first_last": (utils.is_pp_first_stage(group), utils.is_pp_last_stage(group)),
        "ranks": (utils.get_pp_first_rank(group), utils.get_pp_last_rank(group),
                  utils.get_pp_prev_rank(group), utils.get_pp_next_rank(group)),
    }


@pytest.mark.slow
def test_pipeline_parallel_utils():
    from megatron_ext.pipeline_parallel import utils
    from tests.distributed import run_distributed

    got = run_distributed(4, _stage_helpers)
    assert [g["first_last"] for g in got] == [(True, False), (False, False), (False, False), (False, True)]
    assert [g["ranks"] for g in got] == [(0, 3, None, 1), (0, 3, 0, 2), (0, 3, 1, 3), (0, 3, 2, None)]
    # Without a group: one stage. Virtual stages: the first and last chunk.
    assert utils.is_pp_first_stage(None) and utils.is_pp_last_stage(None)
    assert utils.is_vp_first_stage(None, None) and utils.is_vp_last_stage(0, 1)
    assert [utils.is_vp_first_stage(i, 3) for i in range(3)] == [True, False, False]
    assert [utils.is_vp_last_stage(i, 3) for i in range(3)] == [False, False, True]
    with pytest.raises(
        ValueError, match="vp_stage must be None or 0 without virtual stages \\(vp_size 1\\), got 1"
    ):
        utils.is_vp_first_stage(1, 1)
