"""Megatron-core 0.16.1's own GPTModel (local layer spec), trained by Megatron-core's loop pieces
(its DDP wrapper on every chunk, get_megatron_optimizer, finalize_model_grads, the schedules of
get_forward_backward_func), once on Megatron-core alone and once with megatron.core's
parallel_state, tensor_parallel, pipeline_parallel, distributed and optimizer resolved to
megatron_ext's modules: the per-step losses and the trained parameters agree; with Megatron-core's
own MoE layers too (its router, both token dispatchers and SequentialMLP over megatron_ext's
linears and expert groups). The CUDA calls
Megatron-core makes on a CPU are patched as ``benchmarks/megatron_core_gpt.py`` lists. Skipped
when megatron-core is not installed.

Tolerances: Megatron-core's vocab_parallel_cross_entropy returns a float32 loss for float64
logits (its target-logit buffer is float32) and its gradient is float32-accurate, megatron_ext's
are float64, so the float64 runs' losses agree to float32 rounding; they train with SGD, whose
update is proportional to the gradient, so the trained parameters agree to that rounding times
the learning rate. The float32 runs with the distributed optimizer use Adam, which divides by the
gradient's running magnitude: a rounding difference in a gradient near zero becomes an update
difference of up to the learning rate's order (a flipped sign), and the runs then part by more
than rounding at every later step, by an amount that depends on which elements happened to be near
zero (so on the CPU's kernels). They are held to what rounding alone allows where rounding alone
acts, and to what Adam's update size allows after (``_assert_float32_adam_runs_agree``)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

# Not importorskip: the workers resolve megatron.core's packages to megatron_ext before
# megatron.core is first imported, and they import this module first.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from benchmarks.megatron_core_gpt import (  # noqa: E402
    MEGATRON_CORE_FALLBACKS,
    Run,
    cpu_patches,
    setup,
    train,
    train_step,
    use_megatron_ext,
)
from tests.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow  # two 4-rank training runs of fourteen configurations each

# name -> (run, largest difference of a step's loss, of a trained parameter); None: the float32
# Adam runs' bounds (_assert_float32_adam_runs_agree)
RUNS = {
    "gpt tp2 pp2": (Run(tp=2, pp=2, optimizer="sgd"), 1e-6, 1e-9),
    "llama tp2 pp2 sequence-parallel": (
        Run(arch="llama", tp=2, pp=2, sequence_parallel=True, optimizer="sgd"), 1e-6, 1e-9),
    "gpt pp4 interleaved vp2": (Run(pp=4, vp=2, layers=8, optimizer="sgd"), 1e-6, 1e-9),
    # Interleaved at pp 4: Megatron-core's own interleaved schedule at pp 2 over gloo posts its
    # sends and receives to the one peer in an order the peer does not match, and stage 1 gets
    # the wrong inputs for some micro-batches.
    "llama pp4 interleaved vp2": (Run(arch="llama", pp=4, vp=2, layers=8, optimizer="sgd"), 1e-6, 1e-9),
    # Megatron-core's distributed optimizer takes float16/bfloat16/float32 parameters only.
    "llama tp2 dp2 distributed optimizer float32": (
        Run(arch="llama", tp=2, distributed_optimizer=True, dtype=torch.float32), None, None),
    "gpt dp4 distributed optimizer float32": (
        Run(distributed_optimizer=True, dtype=torch.float32), None, None),
    # Megatron-core's MoE layer (get_gpt_layer_local_spec(num_experts=4): its TopKRouter, token
    # dispatcher and SequentialMLP of ColumnParallelLinear / RowParallelLinear experts) on
    # megatron_ext's linears, mappings and groups: ep 2 with expert-data-parallel size 2, and
    # ep 2 x expert-tensor-parallel 2 (Megatron-core needs sequence parallelism with experts at
    # tp > 1, and no bias at etp > 1: llama).
    "moe gpt ep2 dp4 allgather": (Run(num_experts=4, ep=2, layers=2, optimizer="sgd"), 1e-6, 1e-9),
    "moe gpt ep2 dp4 alltoall": (
        Run(num_experts=4, ep=2, dispatcher="alltoall", layers=2, optimizer="sgd"), 1e-6, 1e-9),
    "moe llama tp2 ep2 sequence-parallel allgather": (
        Run(arch="llama", tp=2, sequence_parallel=True, num_experts=4, ep=2, layers=2, optimizer="sgd"),
        1e-6, 1e-9),
    "moe llama tp2 ep2 sequence-parallel alltoall": (
        Run(arch="llama", tp=2, sequence_parallel=True, num_experts=4, ep=2, dispatcher="alltoall",
            layers=2, optimizer="sgd"), 1e-6, 1e-9),
}
# Each MoE run again with the router's balance and z losses on: their gradients go through
# Megatron-core's own MoEAuxLossAutoScaler (its router's), whose scale megatron_ext's schedules set.
RUNS.update({
    f"{name} aux z": (dataclasses.replace(run, aux_loss_coeff=0.01, z_loss_coeff=1e-3), losses, params)
    for name, (run, losses, params) in list(RUNS.items()) if run.num_experts is not None
})

# The run Megatron-core alone gives the reference with, where it cannot run the run itself: its
# alltoall dispatcher at expert-tensor-parallel size 2 all-gathers tokens of uneven counts with
# torch.distributed.all_gather, which gloo refuses ("invalid tensor size"). Dropless, both
# dispatchers route every token to the same experts with the same weights.
MEGATRON_CORE_REFERENCE = {
    name: dataclasses.replace(RUNS[name][0], dispatcher="allgather")
    for name in ("moe llama tp2 ep2 sequence-parallel alltoall",
                 "moe llama tp2 ep2 sequence-parallel alltoall aux z")
}

# Submodules of the aliased packages that megatron_ext does not have, so Megatron-core's own ran.
# (dist_checkpointing.utils: Megatron-core's prefix helpers for sharded state dicts, run over
# megatron_ext's ShardedTensor.)
EXPECTED_FALLBACKS = [
    "megatron.core.dist_checkpointing.utils",
    "megatron.core.pipeline_parallel.fine_grained_activation_offload",
]


def _train_on_megatron_core() -> dict:
    cpu_patches(full=True)
    return {name: train(MEGATRON_CORE_REFERENCE.get(name, run)) for name, (run, _, _) in RUNS.items()}


def _train_on_megatron_ext() -> dict:
    """RUNS, then the context-parallel runs and their cp 1 twins, in one process per rank (a
    process that resolved megatron.core to megatron_ext is not used for another test)."""
    use_megatron_ext()
    cpu_patches(full=False)
    out = {name: train(run) for name, (run, _, _) in RUNS.items()}
    out["fallbacks"] = list(MEGATRON_CORE_FALLBACKS)
    # the scheduler setup() built: megatron_ext's, through the alias
    out["scheduler"] = importlib.import_module("megatron.core.optimizer_param_scheduler").__name__
    at_cp1 = {name + " at cp 1": dataclasses.replace(run, cp=1) for name, run in CP_RUNS.items()}
    cp_runs = {**CP_RUNS, **at_cp1}
    out["context parallel"] = {name: train(run) for name, run in cp_runs.items()}
    out["mla"] = {name: _train_mla_pair(run) for name, run in MLA_RUNS.items()}
    return out


@pytest.fixture(scope="module")
def on_megatron_ext() -> list[dict]:
    return run_distributed(4, _train_on_megatron_ext, timeout=900)


def _max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_megatron_core_gpt_model_trains_on_megatron_ext_as_on_megatron_core(on_megatron_ext):
    reference = run_distributed(4, _train_on_megatron_core, timeout=900)
    ours = on_megatron_ext
    assert [r["fallbacks"] for r in ours] == [EXPECTED_FALLBACKS] * 4
    assert [r["scheduler"] for r in ours] == ["megatron_ext.optimizer_param_scheduler"] * 4
    for name, (run, loss_tolerance, param_tolerance) in RUNS.items():
        if loss_tolerance is None:
            _assert_float32_adam_runs_agree(name, run, reference, ours)
            continue
        last_stages = 0
        for rank, (expected, got) in enumerate(zip(reference, ours)):
            expected, got = expected[name], got[name]
            assert (expected["losses"] is None) == (got["losses"] is None), (name, rank)
            if expected["losses"] is not None:
                last_stages += 1
                assert len(got["losses"]) == run.steps, name
                assert _max_difference(expected["losses"], got["losses"]) <= loss_tolerance, (
                    name, expected["losses"], got["losses"])
                # The model trains: the loss of the last step is below the first.
                assert expected["losses"][-1] < expected["losses"][0], (name, expected["losses"])
            # The norm step() returns, clipping on (float32 runs) or off (float64: Megatron-core's
            # ChainedOptimizer computes it regardless), to the losses' relative precision.
            assert all(n > 0 for n in expected["grad_norms"]), (name, expected["grad_norms"])
            torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(expected["grad_norms"]),
                                       rtol=loss_tolerance, atol=0, msg=lambda m: f"{name} rank {rank}: {m}")
            assert sorted(got["params"]) == sorted(expected["params"]), (name, rank)
            diffs = {p: _max_difference(v, got["params"][p]) for p, v in expected["params"].items()}
            for param, diff in diffs.items():
                assert diff <= param_tolerance, (name, rank, param, diff)
        assert last_stages == 4 // run.pp, name


# float32's unit roundoff. One step's forward and backward from the same weights, summed in other
# orders by the two libraries, agree to a few dozen of them (the losses, the gradient norm: sums of
# O(1) terms over a few thousand products each); 32 of them is the bound.
FLOAT32_EPS = torch.finfo(torch.float32).eps
FIRST_STEP_RTOL = 32 * FLOAT32_EPS


def _assert_float32_adam_runs_agree(name: str, run: Run, reference: list[dict], ours: list[dict]) -> None:
    """The float32 Adam runs. Step 1 starts from the same weights: its loss and gradient norm agree
    to float32 rounding (FIRST_STEP_RTOL). Adam's update of an element is at most the learning rate
    in size (bias-corrected, its first step is lr times the gradient's sign), so after ``steps``
    updates no weight can differ by more than 2 lr per step, whatever the rounding: every weight is
    within that. A wrong update (a shard stepped twice or not at all, wrong moments or bias
    correction) moves the bulk of the weights by the order of lr, where rounding moves only the
    elements whose gradient was near zero: 99% of each run's weights agree to 1% of lr, and the
    later steps' losses and norms, which such an error moves by the order of lr times the gradient
    (1e-2 relative here), agree to 1e-3 relative."""
    adam_bound = 2 * run.lr * run.steps
    for rank, (expected, got) in enumerate(zip(reference, ours)):
        expected, got = expected[name], got[name]
        where = f"{name} rank {rank}"
        assert (expected["losses"] is None) == (got["losses"] is None), where
        pairs = [("grad norm", expected["grad_norms"], got["grad_norms"])]
        if expected["losses"] is not None:
            assert expected["losses"][-1] < expected["losses"][0], (where, expected["losses"])
            pairs.append(("loss", expected["losses"], got["losses"]))
        for what, want, have in pairs:
            assert len(have) == len(want) == run.steps, (where, what)
            want, have = torch.tensor(want, dtype=torch.float64), torch.tensor(have, dtype=torch.float64)
            torch.testing.assert_close(have[:1], want[:1], rtol=FIRST_STEP_RTOL, atol=0,
                                       msg=lambda m: f"{where}: first step's {what}: {m}")
            torch.testing.assert_close(have[1:], want[1:], rtol=1e-3, atol=0,
                                       msg=lambda m: f"{where}: later steps' {what}: {m}")
        assert sorted(got["params"]) == sorted(expected["params"]), where
        as64 = lambda values: torch.tensor(values, dtype=torch.float64).flatten()  # noqa: E731
        diff = torch.cat([(as64(value) - as64(got["params"][param])).abs()
                          for param, value in expected["params"].items()])
        assert diff.max() <= adam_bound, (where, diff.max().item(), adam_bound)
        assert diff.quantile(0.99) <= 1e-2 * run.lr, (where, diff.quantile(0.99).item(), run.lr)


# Context parallelism on megatron_ext: Megatron-core's local spec with its core_attention swapped
# for megatron_ext's ContextParallelDotProductAttention, against the unchanged local spec at cp 1
# and otherwise the same layout (Megatron-core's initialisation depends on the pipeline layout).
# SGD: its update is proportional to the gradient, so a wrongly scaled gradient shows in the
# losses (Adam's first steps are nearly the gradient's sign, and would hide a factor of cp).
CP_RUNS = {
    "gpt cp2 dp2 p2p": Run(cp=2, cp_comm_type="p2p", optimizer="sgd"),
    "gpt cp4 all_gather": Run(cp=4, cp_comm_type="all_gather", optimizer="sgd"),
    "llama tp2 cp2 p2p": Run(arch="llama", tp=2, cp=2, cp_comm_type="p2p", optimizer="sgd"),
    "llama cp2 pp2 a2a": Run(arch="llama", cp=2, pp=2, cp_comm_type="a2a", optimizer="sgd"),
    # Megatron-core's MoE layer with its router's losses: each cp rank's share of them carries the
    # main loss's scale times cp (Megatron-core's autoscaler, set by megatron_ext's schedules).
    "moe gpt cp2 ep2 p2p aux z": Run(cp=2, num_experts=4, ep=2, layers=2, optimizer="sgd",
                                     aux_loss_coeff=0.01, z_loss_coeff=1e-3),
}


def test_megatron_core_gpt_model_trains_with_context_parallelism_on_megatron_ext(on_megatron_ext):
    # Rank r has the same tensor- and pipeline-parallel ranks at cp 1 (dp x cp ranks there), so
    # its parameters compare with the cp 1 run's rank r.
    results = [r["context parallel"] for r in on_megatron_ext]
    for name, run in CP_RUNS.items():
        last_stages = 0
        for rank, result in enumerate(results):
            got, expected = result[name], result[name + " at cp 1"]
            assert (got["losses"] is None) == (expected["losses"] is None), (name, rank)
            if got["losses"] is not None:  # float64: the cp 1 run's losses
                last_stages += 1
                torch.testing.assert_close(
                    torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-9, atol=0,
                    msg=lambda m: f"{name} rank {rank}: {m}",
                )
                assert expected["losses"][-1] < expected["losses"][0], (name, expected["losses"])
            assert sorted(got["params"]) == sorted(expected["params"]), (name, rank)
            for param, value in expected["params"].items():
                torch.testing.assert_close(
                    torch.tensor(got["params"][param]), torch.tensor(value), rtol=1e-9, atol=1e-12,
                    msg=lambda m: f"{name} rank {rank} {param}: {m}",
                )
        assert last_stages == 4 // run.pp, name


# Multi-latent attention: Megatron-core's own GPTModel with get_gpt_layer_local_spec(
# multi_latent_attention=True) (its MLASelfAttention, YarnRotaryEmbedding, column-parallel down
# projections) and megatron_ext's ContextParallelDotProductAttention as its core_attention (its local
# DotProductAttention takes no k_channels / v_channels: it does not build), trained on megatron_ext,
# against megatron_ext's own GPTModel with MLA from the same weights, step by step in one process.
MLA_RUNS = {
    "mla dp4": Run(arch="mla", layers=2, optimizer="sgd"),
    "mla cp2 p2p dp2": Run(arch="mla", layers=2, cp=2, cp_comm_type="p2p", optimizer="sgd"),
    "mla cp2 a2a dp2": Run(arch="mla", layers=2, cp=2, cp_comm_type="a2a", optimizer="sgd"),
}


def _train_mla_pair(run: Run) -> dict:
    from megatron.core import parallel_state as ps

    mcore = setup(run)
    ours = setup(run, "megatron_ext", weights_from=mcore[0])
    out: dict = {"megatron-core": [], "megatron_ext": []}
    try:
        for step in range(run.steps):
            out["megatron-core"].append(train_step(run, *mcore, step))
            out["megatron_ext"].append(train_step(run, *ours, step, "megatron_ext"))
    finally:
        ps.destroy_model_parallel()
    return out


def test_megatron_core_mla_model_trains_on_megatron_ext_as_its_own_mla(on_megatron_ext):
    for name in MLA_RUNS:
        last_stages = 0
        for rank, result in enumerate(r["mla"][name] for r in on_megatron_ext):
            theirs, ours = result["megatron-core"], result["megatron_ext"]
            assert len(theirs) == len(ours) == 3, (name, rank)
            norms = torch.tensor([[t[1] for t in theirs], [o[1] for o in ours]])
            torch.testing.assert_close(norms[1], norms[0], rtol=1e-9, atol=0, msg=lambda m: f"{name}: {m}")
            if theirs[0][0] is not None:
                last_stages += 1
                losses = torch.tensor([[t[0] for t in theirs], [o[0] for o in ours]])
                torch.testing.assert_close(losses[1], losses[0], rtol=1e-9, atol=0,
                                           msg=lambda m: f"{name}: {m}")
                assert losses[0, -1] < losses[0, 0], (name, losses)
        assert last_stages == 4, name
