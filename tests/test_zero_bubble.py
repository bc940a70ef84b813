"""Zero-bubble schedules: typed actions, the split backward, ZB-H1 and ZB-V, and the simulator.

The schedules must compute exactly the serial model's losses and gradients (float64) with every
weight gradient made in a ``W`` (never in an ``I``) and gradients reduced only after a chunk's
last ``W``; the simulator must reproduce the closed-form bubbles."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.model_parallel_config import ModelParallelConfig
from megatron_ext.pipeline_parallel import get_forward_backward_func
from megatron_ext.pipeline_parallel import runner
from megatron_ext.pipeline_parallel import schedules as sch
from megatron_ext import split_backward
from megatron_ext.pipeline_parallel.schedule_simulator import simulate_schedule
from megatron_ext.pipeline_parallel.schedule_tables import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    ActionKind,
    check_tables,
    format_pipeline_order,
    plan_schedule,
    virtual_stage,
)
from tests.distributed import run_distributed
from tests.conftest import EXACT
from tests.toy_pipeline import (
    B,
    L,
    Recorder,
    S,
    ToyChunk,
    forward_step,
    full_layers,
    make_batches,
    make_config,
    serial_reference,
)

# Tables and the clock -----------------------------------------------------------------------


def test_actions_are_typed_and_print_as_chart_cells():
    action = Action(BACKWARD_WEIGHT, 3, 1)
    assert (action.kind, action.microbatch, action.chunk) == (ActionKind.W, 3, 1)
    assert str(action) == "1W3" and str(Action(FORWARD, 0)) == "0F0"
    # The long names compare equal, so tables written as plain tuples keep working.
    assert Action(FORWARD, 2, 0) == ("forward", 2, 0)
    assert check_tables([[("F", 0, 0), ("backward_input", 0, 0), (ActionKind.W, 0, 0)]]) == [
        [Action(FORWARD, 0, 0), Action(BACKWARD_INPUT, 0, 0), Action(BACKWARD_WEIGHT, 0, 0)]]


def test_bad_tables_are_refused():
    table = sch.zero_bubble_h1_table(2, 2, 1)
    other = sch.zero_bubble_h1_table(2, 2, 0)
    w0 = table.index(Action(BACKWARD_WEIGHT, 0, 0))
    i0 = table.index(Action(BACKWARD_INPUT, 0, 0))
    early = list(table)
    early[w0], early[i0] = early[i0], early[w0]
    message = "BACKWARD_WEIGHT of microbatch 0, chunk 0 comes before its BACKWARD_INPUT"
    with pytest.raises(ValueError, match=message):
        plan_schedule([other, early])
    with pytest.raises(ValueError, match="every BACKWARD_INPUT needs its BACKWARD_WEIGHT"):
        plan_schedule([other, [a for a in table if a != Action(BACKWARD_WEIGHT, 1, 0)]])
    with pytest.raises(ValueError, match="both a whole backward and backward halves"):
        plan_schedule([other, table + [Action(ActionKind.B, 0, 0)]])
    with pytest.raises(ValueError, match="is not \\(FORWARD"):
        plan_schedule([other, table + [("X", 0, 0)]])
    with pytest.raises(ValueError, match="num_microbatches >= 2 \\* pipeline size - 1 = 7, got 6"):
        sch.zbv_table(6, 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        plan_schedule([other, table], layout="w")


def test_zero_bubble_h1_plan_chart():
    plan = plan_schedule([sch.zero_bubble_h1_table(3, 2, r) for r in range(2)])
    chart = format_pipeline_order(plan)
    # Rank 1 holds back one weight half, rank 0 none.
    assert chart.splitlines() == [
        "       rank 0 rank 1",
        "tick 0 0F0",
        "tick 1 0F1    0F0",
        "tick 2        0I0",
        "tick 3 0I0    0F1",
        "tick 4 0W0    0I1",
        "tick 5 0F2    0W0",
        "tick 6 0I1    0F2",
        "tick 7 0W1    0I2",
        "tick 8 0I2    0W1",
        "tick 9 0W2    0W2",
    ]
    assert format_pipeline_order(plan, ranks=[1]).splitlines()[1] == "tick 0"


def test_zbv_tables_are_a_v():
    p, m = 4, 8
    tables = [sch.zbv_table(m, p, r) for r in range(p)]
    assert [virtual_stage(r, c, p, "v") for r in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    plan = plan_schedule(tables, 2, "v")
    # Unit-time actions: rank r starts at tick r and then never idles (the paper's zero bubble).
    for r, row in enumerate(plan):
        busy = [t for t, a in enumerate(row) if a is not None]
        assert busy == list(range(r, r + 6 * m)), r


# The simulator against the closed forms ---------------------------------------------------


@pytest.mark.parametrize("costs", [dict(F=1.0, I=1.0, W=1.0), dict(F=1.0, I=1.0, W=0.5)])
@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (16, 64)])
def test_simulated_bubbles_match_closed_forms(costs, p, m):
    F, I, W = costs["F"], costs["I"], costs["W"]  # noqa: E741
    runs = {
        "1f1b": (simulate_schedule([sch.one_f_one_b_table(m, p, r) for r in range(p)], costs), (p - 1) / m),
        "gpipe": (simulate_schedule([sch.gpipe_table(m)] * p, costs), (p - 1) / m),
        "interleaved": (simulate_schedule([sch.interleaved_table(m, 2, p, p, r) for r in range(p)], costs, 2),
                        (p - 1) / (2 * m)),
        # ZB-H1: (p - 1)(F + I - W) of idle per rank over m (F + I + W) of work.
        "zb-h1": (simulate_schedule([sch.zero_bubble_h1_table(m, p, r) for r in range(p)], costs),
                  (p - 1) * (F + I - W) / (m * (F + I + W))),
    }
    for name, (sim, bubble) in runs.items():
        assert sim.bubble_fraction == pytest.approx(bubble, rel=0.01), name
    zbv = simulate_schedule([sch.zbv_table(m, p, r) for r in range(p)], costs, 2, "v")
    # ZB-V: inside each rank's span (p - 1)(F + I - 2 W) of idle over 2 m (F + I + W) of work,
    # zero when the three cost the same; the step, with the start-up, (p - 1) F longer.
    assert zbv.idle_fraction == pytest.approx((p - 1) * (F + I - 2 * W) / (2 * m * (F + I + W)), abs=1e-9)
    assert zbv.bubble_fraction == pytest.approx((p - 1) * F / (2 * m * (F + I + W)), rel=0.01)
    # Peak activations: 1F1B's p micro-batches on rank 0; ZB-H1 p on every rank; ZB-V 2 p chunks.
    assert runs["1f1b"][0].peak_activations == [p - r for r in range(p)]
    assert runs["zb-h1"][0].peak_activations == [p] * p
    assert zbv.peak_activations == [2 * p] * p
    assert runs["gpipe"][0].peak_activations == [m] * p
    # A transfer latency adds to every schedule's critical path.
    slow = simulate_schedule([sch.zero_bubble_h1_table(m, p, r) for r in range(p)], costs, p2p=0.5)
    assert slow.makespan > runs["zb-h1"][0].makespan


# The split backward, on one process --------------------------------------------------------


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 8)).double()


def test_split_backward_equals_the_whole_backward():
    torch.manual_seed(0)
    model, reference = _mlp(), None
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 8, dtype=torch.float64)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).backward(grad)
    # A middle stage: I gives the input gradient and touches no weight; W gives the rest.
    (gx,), deferred = split_backward.backward_input([model(x)], [grad], [x])
    assert_close(gx, x_ref.grad, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters()) and deferred
    split_backward.backward_weight(deferred)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert not deferred  # run once
    # The first stage (no input activation): I does nothing, W all of it.
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    (none,), deferred = split_backward.backward_input([model(x_ref.detach())], [grad], [None])
    assert none is None and all(p.grad is None for p in model.parameters())
    split_backward.backward_weight(deferred)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, rtol=0, atol=0)
    # A weight used twice in one stage: the whole backward runs in I, W has nothing left.
    shared = torch.nn.Linear(8, 8).double()
    twice = copy.deepcopy(shared)
    y = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    y_ref = y.detach().clone().requires_grad_()
    twice(torch.tanh(twice(y_ref))).backward(grad)
    (gy,), deferred = split_backward.backward_input([shared(torch.tanh(shared(y)))], [grad], [y])
    assert not deferred
    assert_close(gy, y_ref.grad, rtol=0, atol=0)
    assert_close(shared.weight.grad, twice.weight.grad, rtol=0, atol=0)


# Schedules on 4 processes ------------------------------------------------------------------


def build_chunks_for(layers, schedule: str, pp: int, rank: int, config, recorder) -> list[ToyChunk]:
    """ZB-H1: one chunk of L / pp layers; ZB-V: chunks 0 and 1 hold stages rank and 2 pp - 1 - rank."""
    layout, v = ("v", 2) if schedule == "zb-v" else ("interleaved", 1)
    per = L // (pp * v)
    chunks = []
    for c in range(v):
        stage = virtual_stage(rank, c, pp, layout)
        chunks.append(ToyChunk(layers[stage * per:(stage + 1) * per], config, c, stage == 0, recorder))
    return chunks


def _run_zero_bubble(layers, schedule: str, pp: int, m: int, *, deallocate: bool = False,
                     forward_only: bool = False) -> None:
    rank = ps.get_pipeline_model_parallel_rank()
    where = f"{schedule} pp={pp} m={m} rank={rank} deallocate={deallocate} forward_only={forward_only}"
    phase: list[str] = []
    active: list[bool] = []
    finalized: list = []

    class NoSync:
        def __enter__(self):
            active.append(True)

        def __exit__(self, *exc):
            active.pop()

    config = make_config(no_sync_func=NoSync, deallocate_pipeline_outputs=deallocate,
                         finalize_model_grads_func=lambda chunks, **kw: finalized.append(chunks))
    chunks = build_chunks_for(layers, schedule, pp, rank, config, Recorder())
    # Every weight gradient must be made in a W, each chunk's last one outside no_sync.
    weight_events = {c: [] for c in range(len(chunks))}
    for c, chunk in enumerate(chunks):
        for layer in chunk.layers:
            layer.weight.register_hook(
                lambda g, c=c: weight_events[c].append((phase[-1] if phase else "-", bool(active))))
    real_input, real_weight = runner.backward_input, runner.backward_weight

    def traced(name, fn):
        def run(*args):
            phase.append(name)
            try:
                return fn(*args)
            finally:
                phase.pop()
        return run

    # the runner (which runs every I and W) looks them up in its module
    runner.backward_input, runner.backward_weight = traced("I", real_input), traced("W", real_weight)
    try:
        batches = make_batches(m)
        func = get_forward_backward_func(schedule=schedule)
        store = func(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                     model=chunks, num_microbatches=m, seq_length=S, micro_batch_size=B,
                     forward_only=forward_only)
    finally:
        runner.backward_input, runner.backward_weight = real_input, real_weight
    ref_losses, ref_grads = serial_reference(layers, batches)
    last_rank = 0 if schedule == "zb-v" else pp - 1
    if rank == last_rank:
        assert [d["mb"] for d in store] == list(range(m)), where
        for got, want in zip(store, ref_losses):
            assert_close(got["loss"], want, **EXACT, msg=where)
    else:
        assert store == [], where
    if forward_only:
        assert finalized == [] and all(p.grad is None for c in chunks for p in c.parameters()), where
        return
    per = L // (pp * len(chunks))
    for c, chunk in enumerate(chunks):
        stage = virtual_stage(rank, c, pp, "v" if schedule == "zb-v" else "interleaved")
        for j, layer in enumerate(chunk.layers):
            ref_w, ref_b = ref_grads[stage * per + j]
            assert_close(layer.weight.grad, ref_w, **EXACT, msg=where)
            assert_close(layer.bias.grad, ref_b, **EXACT, msg=where)
        events = weight_events[c]
        assert len(events) == m * per and {ph for ph, _ in events} == {"W"}, (where, c, events)
        # Only the gradients of the chunk's last W are reduced (outside no_sync).
        assert [a for _, a in events] == [True] * (m - 1) * per + [False] * per, (where, c)
    assert finalized == [chunks], where
    # With deallocate_pipeline_outputs every activation sent to another rank is freed; the last
    # stage's outputs and ZB-V's turn from chunk 0 to chunk 1 on rank pp - 1 stay.
    layout = "v" if schedule == "zb-v" else "interleaved"
    for c, chunk in enumerate(chunks):
        stage = virtual_stage(rank, c, pp, layout)
        sent = stage < len(chunks) * pp - 1 and sch.stage_location(stage + 1, pp, layout)[0] != rank
        freed = [out.numel() == 1 for out in chunk.outputs]
        assert freed == [deallocate and sent] * m, (where, c, freed)


def _zero_bubble_worker() -> None:
    layers = full_layers()
    for pp in (2, 4):
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
        for schedule, m in (("zb-h1", 2 * pp), ("zb-h1", pp - 1), ("zb-v", 2 * pp - 1), ("zb-v", 2 * pp + 2)):
            if m >= 1:
                _run_zero_bubble(layers, schedule, pp, m)
        _run_zero_bubble(layers, "zb-h1", pp, pp, deallocate=True)
        _run_zero_bubble(layers, "zb-v", pp, 2 * pp, deallocate=True)
        _run_zero_bubble(layers, "zb-v", pp, 2 * pp, forward_only=True)
        _run_zero_bubble(layers, "zb-h1", pp, pp, forward_only=True)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = make_config()
    chunks = build_chunks_for(layers, "zb-h1", 2, ps.get_pipeline_model_parallel_rank(), config, Recorder())
    # The stages exchange decoder_seq_length positions when it is given (Megatron-core's rule).
    kwargs = dict(forward_step_func=forward_step, model=chunks, num_microbatches=2, micro_batch_size=B)
    store = sch.forward_backward_pipelining_zero_bubble_h1(
        data_iterator=iter(make_batches(2)), seq_length=S + 5, decoder_seq_length=S, **kwargs)
    assert len(store) == (2 if ps.get_pipeline_model_parallel_rank() == 1 else 0)
    with pytest.raises(ValueError, match="decoder_seq_length must be an integer >= 1, got 0"):
        sch.forward_backward_pipelining_zero_bubble_h1(
            data_iterator=iter(make_batches(2)), seq_length=S, decoder_seq_length=0, **kwargs)
    with pytest.raises(ValueError, match="the zb-v schedule runs 2 model chunks per rank"):
        sch.forward_backward_pipelining_zbv(
            forward_step_func=forward_step, data_iterator=[iter(make_batches(4))], model=chunks,
            num_microbatches=4, seq_length=S, micro_batch_size=B)
    ps.destroy_model_parallel()


@pytest.mark.slow
def test_zero_bubble_schedules_equal_serial():
    run_distributed(4, _zero_bubble_worker)


def _parallel_linear_worker() -> None:
    """The tensor-parallel linears split their backward too: I leaves weight.grad and main_grad
    alone (and runs the input-gradient all-reduce), W fills them (and runs the sequence-parallel
    all-gather), equal to the whole backward."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    for sequence_parallel in (False, True):
        for fusion in (False, True):
            config = ModelParallelConfig(
                tensor_model_parallel_size=2, params_dtype=torch.float64, use_cpu_initialization=True,
                sequence_parallel=sequence_parallel, gradient_accumulation_fusion=fusion)

            def make():
                torch.manual_seed(3)
                column = tensor_parallel.ColumnParallelLinear(
                    8, 16, config=config, init_method=torch.nn.init.normal_)
                row = tensor_parallel.RowParallelLinear(
                    16, 8, config=config, init_method=torch.nn.init.normal_, input_is_parallel=True,
                    bias=True, skip_bias_add=False)
                return [column, row]

            pair, twin = make(), make()
            if fusion:
                for p in [p for m in pair + twin for p in m.parameters()]:
                    p.main_grad = torch.zeros_like(p)
            g = torch.Generator().manual_seed(5)
            x = torch.randn(4, 2, 8, dtype=torch.float64, generator=g)
            grad = torch.randn(4, 2, 8, dtype=torch.float64, generator=g)
            if sequence_parallel:
                rank = ps.get_tensor_model_parallel_rank()
                x, grad = x.chunk(2)[rank].contiguous(), grad.chunk(2)[rank].contiguous()

            def run(modules, inp):
                h, _ = modules[0](inp)
                out, _ = modules[1](torch.tanh(h))
                return out

            x_ref = x.clone().requires_grad_()
            run(twin, x_ref).backward(grad)
            x_split = x.clone().requires_grad_()
            (gx,), deferred = split_backward.backward_input([run(pair, x_split)], [grad], [x_split])
            assert_close(gx, x_ref.grad, **EXACT)
            where = (sequence_parallel, fusion)
            for p in [p for m in pair for p in m.parameters()]:
                assert p.grad is None, where
                if fusion:
                    assert p.main_grad.abs().sum() == 0, where
            split_backward.backward_weight(deferred)
            for m_split, m_ref in zip(pair, twin):
                for (name, p), q in zip(m_split.named_parameters(), m_ref.parameters()):
                    got = p.main_grad if fusion and name == "weight" else p.grad
                    want = q.main_grad if fusion and name == "weight" else q.grad
                    assert_close(got, want, **EXACT, msg=str((where, name)))
    # The fused output layer + cross-entropy (one C++ node for the hidden and weight gradients).
    rank = ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(6, 2, 8, dtype=torch.float64, generator=g)
    weight = torch.randn(32, 8, dtype=torch.float64, generator=g).chunk(2)[rank].contiguous()
    target = torch.randint(0, 32, (6, 2), generator=g)

    def fused_loss(h, w):
        return tensor_parallel.vocab_parallel_linear_cross_entropy(torch.tanh(h), w, target, chunk_size=4)

    whole = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    fused_loss(*whole).sum().backward()
    split = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = fused_loss(*split)
    (gh,), deferred = split_backward.backward_input([loss.sum()], [None], [split[0]])
    assert split[1].grad is None
    assert_close(gh, whole[0].grad, **EXACT)
    split_backward.backward_weight(deferred)
    assert_close(split[1].grad, whole[1].grad, **EXACT)
    ps.destroy_model_parallel()


def test_parallel_linears_split_their_backward():
    run_distributed(2, _parallel_linear_worker)


def _recompute_worker() -> None:
    """A recomputed (checkpointed) region's weight gradients are deferred with the rest."""
    ps.initialize_model_parallel()
    torch.manual_seed(7)
    layers = torch.nn.ModuleList(torch.nn.Linear(6, 6).double() for _ in range(3))
    twin = copy.deepcopy(layers)

    def body(mods):
        return lambda h: torch.tanh(mods[1](torch.tanh(mods[0](h))))

    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 6, dtype=torch.float64)
    x_ref = x.detach().clone().requires_grad_()
    twin[2](tensor_parallel.checkpoint(body(twin), False, x_ref)).backward(grad)
    out = layers[2](tensor_parallel.checkpoint(body(layers), False, x))
    (gx,), deferred = split_backward.backward_input([out], [grad], [x])
    assert_close(gx, x_ref.grad, **EXACT)
    assert all(p.grad is None for p in layers.parameters())
    assert len(deferred.nested) == 1
    split_backward.backward_weight(deferred)
    for p, q in zip(layers.parameters(), twin.parameters()):
        assert_close(p.grad, q.grad, **EXACT)
    ps.destroy_model_parallel()
    dist.barrier()


def test_recomputed_regions_split_their_backward():
    run_distributed(1, _recompute_worker)
