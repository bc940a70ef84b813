"""The interleaved (virtual pipeline) schedule and the schedule tables.

Every layout runs a stack of tanh(Linear) layers split into ``pp * v`` virtual stages (chunk c of
pipeline rank r holds virtual stage ``c * pp + r``) and must reproduce the serial model's losses
and gradients in float64. The order in which each rank runs its forwards and backwards is
recorded and compared with Megatron-core's definition (forward order ``get_schedule_table``,
backwards through the chunks in reverse, ``get_pp_rank_microbatches`` warm-up forwards)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext.pipeline_parallel import P2PCommunicator, get_forward_backward_func
from megatron_ext.pipeline_parallel import schedules as sch
from megatron_ext.process_groups_config import ProcessGroupCollection
from megatron_ext.transformer.transformer_block import layers_per_virtual_stage
from tests.conftest import EXACT
from tests.distributed import run_distributed
from tests.toy_pipeline import (
    B,
    H,
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

WORLD = 4


# Tables, by hand from Megatron-core's documented formulas -----------------------------------


def test_get_schedule_table_matches_megatron():
    # Megatron's docstring example: PP2, N3 (group of 3), M5, VP2.
    assert sch.get_schedule_table(5, 2, 3) == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    assert sch.get_schedule_table(4, 2, 2) == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert sch.get_schedule_table(6, 3, 4) == [
        (0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2), (2, 2),
        (3, 2), (4, 0), (5, 0), (4, 1), (5, 1), (4, 2), (5, 2)]
    assert sch.get_schedule_table(3, 2, 4) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert sch.get_schedule_table(3, 1, 3) == [(0, 0), (1, 0), (2, 0)]


def _communicator(pp: int, rank: int, vp: int | None) -> SimpleNamespace:
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


@pytest.mark.parametrize(
    "args, kwargs, pp, rank, vp, expected",
    [
        # (total, all in warm-up, warm-up, remaining); interleaved warm-up 2 (pp - r - 1) + (v - 1) g.
        ((8, 2, 4), {}, 4, 0, 2, (16, False, 10, 6)),
        ((8, 2, 4), {}, 4, 3, 2, (16, False, 4, 12)),
        ((4, 2, 4), {}, 4, 0, 2, (8, True, 8, 0)),
        ((4, 3, 2), {}, 2, 0, 3, (12, False, 6, 6)),
        ((4, 2, 2), {"overlap_moe_expert_parallel_comm": True}, 2, 0, 2, (8, False, 5, 3)),
        ((8, 2, 4), {"forward_only": True}, 4, 1, 2, (16, True, 16, 0)),
        # 1F1B: pp - r - 1; one stage: none.
        ((8, 1, 4), {}, 4, 1, None, (8, False, 2, 6)),
        ((1, 1, 4), {}, 4, 0, None, (1, True, 1, 0)),
        ((3, 1, 1), {}, 1, 0, None, (3, False, 0, 3)),
    ],
)
def test_get_pp_rank_microbatches_matches_megatron(args, kwargs, pp, rank, vp, expected):
    got = sch.get_pp_rank_microbatches(*args, **kwargs, p2p_communicator=_communicator(pp, rank, vp))
    assert got == expected


def _expected_order(m: int, v: int, g: int, pp: int, rank: int, forward_only: bool) -> list:
    """Megatron-core's order: warm-up forwards, then forward k + warm-up with backward k, then
    the remaining backwards; backward k runs the k-th table entry with its chunk reversed."""
    table = sch.get_schedule_table(m, v, g)
    _, _, warmup, remaining = sch.get_pp_rank_microbatches(
        m, v, g, forward_only=forward_only, p2p_communicator=_communicator(pp, rank, v if v > 1 else None))
    order = [("forward", mb, c) for mb, c in table[:warmup]]
    if forward_only:
        return order
    backward = [("backward", mb, v - 1 - c) for mb, c in table]
    for k in range(remaining):
        order += [("forward", *table[warmup + k]), backward[k]]
    return order + backward[remaining:]


@pytest.mark.parametrize("pp, v, m, g",
                         [(2, 2, 4, 2), (4, 2, 8, 4), (4, 3, 4, 4), (2, 3, 5, 3), (4, 2, 9, 5)])
def test_interleaved_tables_follow_megatron_and_have_the_bubble(pp, v, m, g):
    tables = [sch.interleaved_table(m, v, g, pp, r) for r in range(pp)]
    for r in range(pp):
        assert tables[r] == _expected_order(m, v, g, pp, r, False)
    # Unit-time forwards and backwards: every rank finishes after 2 v m + 2 (pp - 1) ticks, i.e.
    # the bubble is (pp - 1) / (v m) of the ideal 2 v m (1F1B's is (pp - 1) / m).
    plan = sch.plan_schedule(tables, v)
    assert {len(p) for p in plan} == {2 * v * m + 2 * (pp - 1)}
    busy = [sum(e is not None for e in p) for p in plan]
    assert busy == [2 * v * m] * pp
    one_f_one_b = sch.plan_schedule([sch.one_f_one_b_table(m, pp, r) for r in range(pp)])
    assert len(one_f_one_b[0]) == 2 * m + 2 * (pp - 1)


def test_plan_schedule_refuses_bad_tables():
    good = [sch.one_f_one_b_table(2, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="wait for each other forever"):
        sch.plan_schedule([good[0], list(reversed(good[1]))])
    with pytest.raises(ValueError, match="appears twice"):
        sch.plan_schedule([good[0] + [good[0][0]], good[1]])
    with pytest.raises(ValueError, match="do not match the forward entries"):
        sch.plan_schedule([good[0][:-1], good[1]])
    with pytest.raises(ValueError, match="is not \\(FORWARD"):
        sch.plan_schedule([good[0], good[1] + [("sideways", 0, 0)]])


@pytest.mark.parametrize(
    "fields, pp, vp, counts",
    [
        # Middle stages share what the first and last leave: 8 - 1 - 1 over 2 stages.
        (dict(num_layers=8, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1), 4, 1,
         [1, 3, 3, 1]),
        # Per chunk: first stage 2 / 2, middle 8 / 2, last 4 / 2; virtual stage c * pp + r.
        (dict(num_layers=14, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4), 3, 2,
         [1, 4, 2, 1, 4, 2]),
        (dict(num_layers=10, num_layers_in_first_pipeline_stage=4), 4, 2, [2, 1, 1, 1, 2, 1, 1, 1]),
        # The embedding and the loss count as one layer each of the first / last virtual stage.
        (dict(num_layers=6, account_for_embedding_in_pipeline_split=True,
              account_for_loss_in_pipeline_split=True), 2, 2, [1, 2, 2, 1]),
        (dict(num_layers=12), 2, 3, [2] * 6),
    ],
)
def test_layer_split_matches_megatron(fields, pp, vp, counts):
    config = SimpleNamespace(**fields)
    assert layers_per_virtual_stage(config, pp, vp) == counts


def test_layer_offsets_match_megatron_formula():
    # Megatron's get_transformer_layer_offset with first/last given and a virtual pipeline:
    # vp_stage * (first + middle + last) / vp + first / vp + (rank - 1) * middle / vp / middle_stages.
    from megatron_ext.transformer import transformer_block as tb

    config = SimpleNamespace(num_layers=14, num_layers_in_first_pipeline_stage=2,
                             num_layers_in_last_pipeline_stage=4, virtual_pipeline_model_parallel_size=2)
    counts = layers_per_virtual_stage(config, 3, 2)
    offsets = {(c, r): sum(counts[:c * 3 + r]) for c in range(2) for r in range(3)}
    assert offsets == {(0, 0): 0, (0, 1): 1, (0, 2): 5, (1, 0): 7, (1, 1): 8, (1, 2): 12}
    with pytest.raises(ValueError, match="not divisible by pipeline_model_parallel_size x virtual"):
        layers_per_virtual_stage(SimpleNamespace(num_layers=7), 2, 1)
    with pytest.raises(ValueError, match="not divisible by the virtual pipeline size 2"):
        layers_per_virtual_stage(SimpleNamespace(num_layers=9, num_layers_in_first_pipeline_stage=3), 2, 2)
    with pytest.raises(ValueError, match="cannot be split equally over the 2 other pipeline stages"):
        layers_per_virtual_stage(SimpleNamespace(num_layers=9, num_layers_in_first_pipeline_stage=2), 3, 1)
    with pytest.raises(ValueError, match="vp_stage must be a model chunk index in \\[0, 2\\)"):
        tb._virtual_stage(None, 0, 2, 2)


# Distributed runs ---------------------------------------------------------------------------


def build_chunks(layers, pp: int, rank: int, v: int, config, recorder: Recorder,
                 counts: list[int] | None = None) -> list[ToyChunk]:
    """Chunk c holds virtual stage c * pp + rank: ``counts[s]`` layers (default: equal shares)."""
    counts = counts or [L // (pp * v)] * (pp * v)
    chunks = []
    for c in range(v):
        stage = c * pp + rank
        lo = sum(counts[:stage])
        chunks.append(ToyChunk(layers[lo:lo + counts[stage]], config, c, stage == 0, recorder))
    return chunks


def _run_layout(layers, pp: int, v: int, m: int, g: int | None, *, forward_only: bool = False,
                deallocate: bool = False, comm: P2PCommunicator | None = None,
                pgs: ProcessGroupCollection | None = None, counts: list[int] | None = None,
                sync_funcs: bool = False, decoder_seq_length: int | None = None) -> None:
    pp_group = comm.pp_group if comm is not None else ps.get_pipeline_model_parallel_group()
    rank = pp_group.rank()
    where = f"pp={pp} v={v} m={m} g={g} rank={rank} forward_only={forward_only}"
    recorder, finalized, finalize_kwargs, sync_flags = Recorder(), [], [], []
    active = []

    class NoSync:
        def __enter__(self):
            active.append(True)

        def __exit__(self, *exc):
            active.pop()

    config = make_config(
        microbatch_group_size_per_vp_stage=g, virtual_pipeline_model_parallel_size=v,
        finalize_model_grads_func=lambda chunks, **kw: (finalized.append(chunks), finalize_kwargs.append(kw)),
        no_sync_func=NoSync,
        deallocate_pipeline_outputs=deallocate,
    )
    if comm is not None:
        comm.config = config
    events = []
    if sync_funcs:  # record where in the order of forwards and backwards each call happens
        config.grad_sync_func = [lambda params, c=c: events.append(("grad", c, len(recorder.order)))
                                 for c in range(v)]
        config.param_sync_func = lambda params: events.append(("param", len(recorder.order)))
    chunks = build_chunks(layers, pp, rank, v, config, recorder, counts)
    for chunk in chunks:
        chunk.layers[0].weight.register_hook(lambda grad, c=chunk.chunk: sync_flags.append((c, bool(active))))
    batches = make_batches(m)
    func = sch.forward_backward_pipelining_with_interleaving
    store = func(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in range(v)], model=chunks,
        num_microbatches=m, seq_length=S, micro_batch_size=B, forward_only=forward_only,
        p2p_communicator=comm, pg_collection=pgs, decoder_seq_length=decoder_seq_length,
    )
    ref_losses, ref_grads = serial_reference(layers, batches)
    if rank == pp - 1:
        assert [d["mb"] for d in store] == list(range(m)), where
        for got, want in zip(store, ref_losses):
            assert_close(got["loss"], want, **EXACT, msg=where)
    else:
        assert store == [], where
    group = g if g is not None else pp
    assert recorder.order == _expected_order(m, v, group, pp, rank, forward_only), where
    if forward_only:
        assert finalized == [] and all(p.grad is None for c in chunks for p in c.parameters()), where
        return
    # Activations held at once: Megatron's warm-up plus one (never more than all of them).
    _, _, warmup, _ = sch.get_pp_rank_microbatches(m, v, group, p2p_communicator=_communicator(pp, rank, v))
    assert recorder.peak == min(warmup + 1, v * m) and recorder.live == 0, (where, recorder.peak)
    counts = counts or [L // (pp * v)] * (pp * v)
    for c, chunk in enumerate(chunks):
        stage = c * pp + rank
        assert len(chunk.layers) == counts[stage], where
        for j, layer in enumerate(chunk.layers):
            ref_w, ref_b = ref_grads[sum(counts[:stage]) + j]
            assert_close(layer.weight.grad, ref_w, **EXACT, msg=where)
            assert_close(layer.bias.grad, ref_b, **EXACT, msg=where)
        # Each chunk's last backward runs outside no_sync (its gradients are reduced once).
        flags = [f for cc, f in sync_flags if cc == c]
        assert flags == [True] * (m - (not sync_funcs)) + [False] * (not sync_funcs), (where, c, flags)
    if sync_funcs:
        order = recorder.order
        assert sorted(e for e in events if e[0] == "grad") == [
            ("grad", c, order.index(("backward", m - 1, c)) + 1) for c in range(v)], (where, events)
        assert sorted(e for e in events if e[0] == "param") == sorted(
            ("param", order.index(("forward", 0, c))) for c in range(v)), (where, events)
    assert len(finalized) == 1 and finalized[0] == chunks, where
    # Megatron-core hands the custom groups on to the finalizer.
    assert finalize_kwargs == [{} if pgs is None else {"pg_collection": pgs}], where
    freed = [out.numel() == 1 for c in chunks for out in c.outputs]
    last_chunk_outputs = len(chunks[-1].outputs) if rank == pp - 1 else 0
    assert sum(freed) == (v * m - last_chunk_outputs if deallocate else 0), where


def _interleaved_worker() -> None:
    layers = full_layers()
    two = [(2, 2, None), (2, 4, None), (2, 3, 3), (2, 5, 3), (2, 4, 4), (3, 4, None), (3, 3, 3)]
    for pp, cases in ((2, two),
                      (4, [(2, 4, None), (2, 8, None), (2, 5, 5), (2, 9, 5), (3, 4, None)])):
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2)
        assert get_forward_backward_func() is sch.forward_backward_pipelining_with_interleaving
        for v, m, g in cases:
            _run_layout(layers, pp, v, m, g)
        _run_layout(layers, pp, 2, 4, None, forward_only=True)
        # Uneven splits (Megatron's num_layers_in_first/last_pipeline_stage): the first stage
        # holds half the layers of the last one.
        split = SimpleNamespace(num_layers=L, num_layers_in_first_pipeline_stage={2: 8, 4: 4}[pp],
                                num_layers_in_last_pipeline_stage={2: 16, 4: 8}[pp])
        counts = layers_per_virtual_stage(split, pp, 2)
        assert len(set(counts)) > 1 and sum(counts) == L
        _run_layout(layers, pp, 2, 2 * pp, None, counts=counts)
        _run_layout(layers, pp, 2, 2 * pp, None, deallocate=True)
        _run_layout(layers, pp, 3, pp, None, sync_funcs=True)
        # As in Megatron-core, the interleaved schedule sends seq_length positions whatever
        # decoder_seq_length says (the 1F1B schedule sends decoder_seq_length).
        _run_layout(layers, pp, 2, pp, None, decoder_seq_length=S + 3)
        ps.destroy_model_parallel()

    # Custom process groups: parallel_state has pipelines of 2, the schedule runs all 4 ranks
    # as one pipeline through the given communicator and collection.
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    everyone = dist.new_group(list(range(WORLD)))
    comm = P2PCommunicator(everyone, make_config(virtual_pipeline_model_parallel_size=2))
    assert comm.next_rank == (dist.get_rank() + 1) % WORLD and comm.prev_rank == (dist.get_rank() - 1) % WORLD
    assert comm.virtual_pipeline_model_parallel_size == 2
    pgs = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(), cp=ps.get_context_parallel_group(),
                                 embd=None, pos_embd=None, pp=everyone, dp_cp=None)
    _check_communicator(comm)
    _run_layout(layers, WORLD, 2, 4, None, comm=comm, pgs=pgs)
    _check_errors(layers, comm, pgs)
    ps.destroy_model_parallel()


def _check_communicator(comm: P2PCommunicator) -> None:
    """Megatron-core's methods on a ring of 4: what each rank gets is its neighbour's value."""
    rank, shape = dist.get_rank(), (S, B, H)

    def value(r: int, tag: float) -> torch.Tensor:
        return torch.full(shape, 10.0 * r + tag, dtype=torch.float64)

    prev, nxt = (rank - 1) % WORLD, (rank + 1) % WORLD
    got_prev, got_next = comm.send_forward_backward_recv_forward_backward(value(rank, 1), value(rank, 2),
                                                                          True, True, shape)
    assert_close(got_prev.detach(), value(prev, 1), **EXACT)
    assert_close(got_next, value(nxt, 2), **EXACT)
    got = comm.send_forward_recv_forward(value(rank, 3), True, shape, overlap_p2p_comm=True)
    tensor, reqs = got
    assert set(reqs) == {"send_next", "recv_prev"}
    for req in reqs.values():
        req.wait()
    assert_close(tensor.detach(), value(prev, 3), **EXACT)
    if rank % 2 == 0:
        comm.send_forward([value(rank, 4), value(rank, 5)], False)
        grads = comm.recv_backward([shape, shape], False)
        assert [g[0, 0, 0].item() for g in grads] == [10.0 * nxt + 6, 10.0 * nxt + 7]
    else:
        received = comm.recv_forward([shape, shape], False)
        assert [t[0, 0, 0].item() for t in received] == [10.0 * prev + 4, 10.0 * prev + 5]
        comm.send_backward([value(rank, 6), value(rank, 7)], False)
    # A list of shapes gives a list; the end of the pipeline receives nothing.
    assert comm.recv_forward(shape, True) is None and comm.recv_backward([shape], True) == [None]


def _check_errors(layers, comm, pgs) -> None:
    rank = ps.get_pipeline_model_parallel_rank()
    config = make_config(virtual_pipeline_model_parallel_size=2)
    chunks = build_chunks(layers, 2, rank, 2, config, Recorder())
    kwargs = dict(forward_step_func=forward_step, data_iterator=[iter(make_batches(4))] * 2,
                  model=chunks, num_microbatches=4, seq_length=S, micro_batch_size=B)
    func = sch.forward_backward_pipelining_with_interleaving
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage 5 must lie in"):
        wide = make_config(microbatch_group_size_per_vp_stage=5)
        func(**{**kwargs, "model": build_chunks(layers, 2, rank, 2, wide, Recorder())})
    with pytest.raises(RuntimeError, match="leaves a last group of 1"):
        func(**{**kwargs, "num_microbatches": 5})
    with pytest.raises(ValueError, match="needs data_iterator as a list"):
        func(**{**kwargs, "data_iterator": iter(make_batches(4))})
    with pytest.raises(ValueError, match="needs model as a list"):
        func(**{**kwargs, "model": chunks[0]})
    with pytest.raises(ValueError, match="one data iterator per model chunk: got 1 for 2"):
        func(**{**kwargs, "data_iterator": [iter(make_batches(4))]})
    # Megatron-core's order: the micro-batch groups are refused before the iterators are counted
    with pytest.raises(RuntimeError, match="leaves a last group of 1"):
        func(**{**kwargs, "data_iterator": [iter(make_batches(4))], "num_microbatches": 5})
    with pytest.raises(ValueError, match="Invalid combination of p2p_communicator, pg_collection"):
        func(**{**kwargs, "p2p_communicator": comm})
    with pytest.raises(ValueError, match=r"the pipeline schedule: pg_collection lacks \['dp_cp'\]"):
        func(**{**kwargs, "p2p_communicator": comm, "pg_collection": ProcessGroupCollection(
            tp=pgs.tp, cp=pgs.cp, embd=None, pos_embd=None, pp=pgs.pp)})
    # Nothing was sent by the refused calls: a valid run afterwards pairs up correctly.
    _run_layout(layers, 2, 2, 4, None)


@pytest.mark.slow
def test_interleaved_matches_serial_and_megatron_order():
    run_distributed(WORLD, _interleaved_worker, timeout=600)


def test_process_group_collection():
    pgs = ProcessGroupCollection(tp=None, pp=None)
    assert hasattr(pgs, "tp") and not hasattr(pgs, "dp")
    with pytest.raises(ValueError, match="Unknown attribute: tensor"):
        ProcessGroupCollection(tensor=None)
    with pytest.raises(ValueError, match="Invalid process groups requested: \\['nope'\\]"):
        ProcessGroupCollection.use_mpu_process_groups(["nope"])
    assert "tp(None)" in repr(pgs)


def _mpu_groups_worker() -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    pgs = ProcessGroupCollection.use_mpu_process_groups(["tp", "pp", "dp", "dp_cp", "cp", "embd", "pos_embd"])
    assert pgs.tp is ps.get_tensor_model_parallel_group()
    assert pgs.pp is ps.get_pipeline_model_parallel_group()
    assert pgs.dp is ps.get_data_parallel_group()
    assert pgs.dp_cp is ps.get_data_parallel_group(with_context_parallel=True)
    assert pgs.embd is ps.get_embedding_group()
    assert not hasattr(pgs, "ep")
    ps.destroy_model_parallel()


def test_use_mpu_process_groups():
    run_distributed(WORLD, _mpu_groups_worker)


def _gpt_chunks_worker() -> dict:
    from megatron_ext.models import GPTModel
    from megatron_ext.transformer import TransformerConfig

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = TransformerConfig(num_layers=6, hidden_size=8, num_attention_heads=2, params_dtype=torch.float64,
                               use_cpu_initialization=True, virtual_pipeline_model_parallel_size=2)
    # Megatron's uneven split: the first stage holds 2 layers (1 per chunk), the last 4 (2 per chunk).
    config.num_layers_in_first_pipeline_stage = 2
    chunks = [
        GPTModel(config, vocab_size=16, max_sequence_length=4, init_seed=5, vp_stage=c) for c in range(2)
    ]
    out = {
        "layers": [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks],
        "pre": [chunk.pre_process for chunk in chunks],
        "post": [chunk.post_process for chunk in chunks],
        "shared": [chunk.shared_embedding_or_output_weight() is not None for chunk in chunks],
    }
    # The last stage's copy of the tied embedding equals the first stage's.
    weight = (chunks[0] if ps.is_pipeline_first_stage() else chunks[-1]).shared_embedding_or_output_weight()
    copies = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(copies, weight.detach(), group=ps.get_embedding_group())
    out["tied_equal"] = torch.equal(copies[0], copies[1])
    ps.destroy_model_parallel()
    return out


def test_gpt_model_chunks_take_megatron_layers():
    first, last = run_distributed(2, _gpt_chunks_worker)
    assert first["layers"] == [[1], [4]] and last["layers"] == [[2, 3], [5, 6]]
    assert first["pre"] == [True, False] and last["pre"] == [False, False]
    assert first["post"] == [False, False] and last["post"] == [False, True]
    assert first["shared"] == [True, False] and last["shared"] == [False, True]
    assert first["tied_equal"] and last["tied_equal"]
