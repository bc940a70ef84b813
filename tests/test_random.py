"""The model-parallel RNG tracker and activation checkpointing (world 4, tensor-parallel size 2:
TP groups [0, 1] [2, 3], DP groups [0, 2] [1, 3])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import ModelParallelConfig
from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from tests.distributed import run_distributed

SEED = 42
WEIGHT_SEED = 17


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _dropout_mask() -> torch.Tensor:
    return torch.nn.functional.dropout(torch.ones(256, dtype=torch.float64), p=0.5) != 0


def _check_streams() -> None:
    tracker = tp_.get_cuda_rng_tracker()
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(SEED)
    cpu_state = torch.get_rng_state()
    tp_.model_parallel_cuda_manual_seed(SEED + 1)
    # Like torch.cuda.manual_seed in Megatron-core, seeding the streams leaves the CPU generator alone.
    assert torch.equal(torch.get_rng_state(), cpu_state)
    tp_.model_parallel_cuda_manual_seed(SEED)
    assert tracker.is_initialized()
    assert set(tracker.get_states()) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}

    # Megatron-core's seeds: the data stream gets SEED, the model stream SEED + 2718 + tp_rank, the
    # expert stream SEED + 1024 + 100 ep_rank + etp_rank (ep 1, etp = tp here).
    with tracker.fork("expert-parallel-rng"):
        expert_draw = torch.rand(5, dtype=torch.float64)
    g = torch.Generator().manual_seed(SEED + 1024 + tp_rank)
    assert torch.equal(expert_draw, torch.rand(5, dtype=torch.float64, generator=g))
    with tracker.fork():
        first = torch.rand(5, dtype=torch.float64)
    expected = torch.rand(
        5, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + 2718 + tp_rank)
    )
    assert torch.equal(first, expected)
    with tracker.fork("data-parallel-rng"):
        data_draw = torch.rand(5, dtype=torch.float64)
    assert torch.equal(
        data_draw, torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED))
    )

    # Dropout inside the model-parallel stream differs across TP ranks, agrees across DP ranks.
    with tracker.fork():
        masks = _gather(_dropout_mask())
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])
    assert not torch.equal(masks[0], masks[1])
    # The default generator agrees everywhere.
    masks = _gather(_dropout_mask())
    assert all(torch.equal(masks[0], m) for m in masks[1:])

    # fork restores the outer state and continues the tracked stream where it stopped.
    outer = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)
    g = torch.Generator().manual_seed(SEED + 2718 + tp_rank)
    torch.rand(5, dtype=torch.float64, generator=g)  # ``first``
    torch.rand(256, dtype=torch.float64, generator=g)  # the dropout mask
    assert torch.equal(torch.cat([a, b]), torch.rand(6, generator=g))
    # ... even when the block raises.
    with pytest.raises(KeyError):
        with tracker.fork():
            torch.rand(3)
            raise KeyError("inside")
    assert torch.equal(torch.get_rng_state(), outer)

    # get_states / set_states round trip.
    saved = tracker.get_states()
    with tracker.fork():
        c = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), c)

    with pytest.raises(RuntimeError, match="rng state 'model-parallel-rng' already exists"):
        tracker.add("model-parallel-rng", 7)
    with pytest.raises(RuntimeError, match=f"seed {SEED} already exists"):
        tracker.add("another", SEED)
    with pytest.raises(RuntimeError, match="rng state 'missing' is not added"):
        with tracker.fork("missing"):
            pass
    with pytest.raises(TypeError, match="seed must be an int"):
        tp_.model_parallel_cuda_manual_seed(1.5)

    fresh = tp_.CudaRNGStatesTracker()
    assert not fresh.is_initialized()
    fresh.add("x", 5)
    assert fresh.is_initialized()
    fresh.reset()
    assert not fresh.is_initialized() and fresh.get_states() == {}
    fresh.add("x", 5)  # the seed is free again after reset


def _check_nested_forks() -> None:
    """fork("a") inside fork("b") inside fork("a") continues stream "a": no mask repeats."""
    tracker = tp_.get_cuda_rng_tracker()
    tp_.model_parallel_cuda_manual_seed(SEED)
    masks = []
    with tracker.fork("model-parallel-rng"):
        masks.append(_dropout_mask())
        with tracker.fork("data-parallel-rng"):
            masks.append(_dropout_mask())
            with tracker.fork("model-parallel-rng"):
                masks.append(_dropout_mask())
                with tracker.fork("data-parallel-rng"):
                    masks.append(_dropout_mask())
            masks.append(_dropout_mask())
        masks.append(_dropout_mask())
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)
    # Each stream is one continuous sequence: model draws 0, 2, 5; data draws 1, 3, 4.
    tp_rank = ps.get_tensor_model_parallel_rank()
    model = torch.Generator().manual_seed(SEED + 2718 + tp_rank)
    data = torch.Generator().manual_seed(SEED)
    reference = _reference_masks(model, data)
    for got, want in zip(masks, reference):
        assert torch.equal(got, want)


def _reference_masks(model: torch.Generator, data: torch.Generator) -> list[torch.Tensor]:
    # The same draws as dropout makes, from explicit generators: dropout keeps where bernoulli(1-p).
    state = torch.get_rng_state()
    out = []
    for gen in (model, data, model, data, data, model):
        torch.set_rng_state(gen.get_state())
        out.append(_dropout_mask())
        gen.set_state(torch.get_rng_state())
    torch.set_rng_state(state)
    return out


def _check_tracker_variants() -> None:
    tp_rank = ps.get_tensor_model_parallel_rank()
    # Megatron's keyword order: (seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
    # tp_rank, ep_rank, etp_rank, force_reset_rng).
    tp_.model_parallel_cuda_manual_seed(SEED, False, False, False, 5, 0, 0, False)
    with tp_.get_cuda_rng_tracker().fork():
        draw = torch.rand(3, dtype=torch.float64)
    assert torch.equal(
        draw, torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + 2718 + 5))
    )
    assert tp_.random.get_all_rng_states() is tp_.get_cuda_rng_tracker().states_
    assert not tp_.is_graph_safe_cuda_rng_tracker(tp_.get_cuda_rng_tracker())

    # An inference tracker ignores seeds and forks in place.
    tp_.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True, force_reset_rng=True)
    tracker = tp_.get_cuda_rng_tracker()
    assert tracker.is_inference_rng_tracker and tracker.get_states() == {}
    before = torch.get_rng_state()
    with tracker.fork():
        torch.rand(2)
    assert not torch.equal(torch.get_rng_state(), before)  # drew from the current generator
    tp_.model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)
    assert not tp_.get_cuda_rng_tracker().is_inference_rng_tracker
    assert tp_rank in (0, 1)

    if not torch.cuda.is_available():
        # Without CUDA a graph-safe tracker keeps CPU generators and draws the plain tracker's numbers.
        draws = []
        for graph_safe in (False, True):
            tracker = tp_.CudaRNGStatesTracker(use_cudagraphable_rng=graph_safe)
            tracker.add("a", 5)
            tracker.add("b", 6)
            before = torch.get_rng_state()
            with tracker.fork("a"):
                draw = [torch.rand(2, dtype=torch.float64)]
                with tracker.fork("b"):
                    draw.append(torch.rand(2, dtype=torch.float64))
                draw.append(torch.rand(2, dtype=torch.float64))
            assert torch.equal(torch.get_rng_state(), before)
            assert isinstance(tracker.get_states()["a"], torch.Generator) == graph_safe
            draws.append(torch.cat(draw))
        assert torch.equal(draws[0], draws[1])
        a = torch.Generator().manual_seed(5)
        expected = torch.cat([torch.rand(2, dtype=torch.float64, generator=a) for _ in range(2)])
        assert torch.equal(draws[1][[0, 1, 4, 5]], expected)
        # The graph-safe form of a CPU state is a Generator holding it, and back.
        state = torch.Generator().manual_seed(11).get_state()
        gen = tp_.convert_cuda_rng_state(state, to_graphable=True)
        assert isinstance(gen, torch.Generator) and tp_.convert_cuda_rng_state(gen, to_graphable=True) is gen
        assert torch.equal(tp_.convert_cuda_rng_state(gen), state)
        assert tp_.convert_cuda_rng_state(state) is state
    with pytest.raises(ValueError, match="Invalid state type"):
        tp_.convert_cuda_rng_state([1, 2])


def _check_cpu_init_ignores_seed() -> None:
    """use_cpu_initialization weights depend on the global CPU seed only, not on the stream seed."""
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float64)
    weights = []
    for seed in (1, 2):
        torch.manual_seed(WEIGHT_SEED)
        tp_.model_parallel_cuda_manual_seed(seed)
        layer = tp_.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.normal_)
        weights.append(layer.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
    torch.manual_seed(WEIGHT_SEED + 1)
    tp_.model_parallel_cuda_manual_seed(1)
    other = tp_.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.normal_).weight
    assert not torch.equal(other.detach(), weights[0])


def _check_gpu_style_init() -> None:
    """Without use_cpu_initialization each rank initialises its shard on the model-parallel stream."""
    tp_.model_parallel_cuda_manual_seed(SEED)
    config = ModelParallelConfig(params_dtype=torch.float64)
    layer = tp_.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.normal_)
    assert layer.weight.device.type == "cpu"
    assert not hasattr(layer, "master_weight")
    weights = _gather(layer.weight.detach().contiguous())
    assert torch.equal(weights[0], weights[2]) and torch.equal(weights[1], weights[3])
    assert not torch.equal(weights[0], weights[1])
    tp_rank = ps.get_tensor_model_parallel_rank()
    expected = torch.randn(
        4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + 2718 + tp_rank)
    )
    assert torch.equal(layer.weight.detach(), expected)


def _block(config: ModelParallelConfig):
    torch.manual_seed(7)
    column = tp_.ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.xavier_normal_)
    row = tp_.RowParallelLinear(
        16,
        8,
        config=config,
        init_method=torch.nn.init.xavier_normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )

    def run(x: torch.Tensor, scale: float) -> torch.Tensor:
        h, _ = column(x)
        with tp_.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(torch.tanh(h), p=0.3)  # differs across TP ranks
        out, _ = row(h)
        return torch.nn.functional.dropout(out, p=0.2) * scale  # agrees across TP ranks

    return run, [column.weight, column.bias, row.weight, row.bias]


def _check_checkpoint() -> None:
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float64)
    run, params = _block(config)
    x0 = torch.randn(4, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(4, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    results = {}
    for mode in ("plain", "checkpoint", "distributed"):
        torch.manual_seed(SEED)
        tp_.model_parallel_cuda_manual_seed(SEED)
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(True)
        if mode == "plain":
            out = run(x, 2.0)
        else:
            out = tp_.checkpoint(run, mode == "distributed", x, 2.0)
            if mode == "distributed":
                assert x.shape == (x0.numel() // 2,)  # only this rank's chunk is kept
        # Randomness drawn between forward and backward must not leak into the recomputation.
        torch.rand(10)
        with tp_.get_cuda_rng_tracker().fork():
            torch.rand(10)
        state_before_backward = (torch.get_rng_state(), tp_.get_cuda_rng_tracker().get_states())
        out.backward(grad)
        assert torch.equal(torch.get_rng_state(), state_before_backward[0])
        for name, state in state_before_backward[1].items():
            assert torch.equal(tp_.get_cuda_rng_tracker().get_states()[name], state)
        assert x.shape == x0.shape
        results[mode] = (out.detach(), x.grad.clone(), [p.grad.clone() for p in params])

    plain_out, plain_dx, plain_dp = results["plain"]
    assert (plain_out == 0).any()  # dropout is active
    for mode in ("checkpoint", "distributed"):
        out, dx, dp = results[mode]
        assert torch.equal(out, plain_out)
        assert_close(dx, plain_dx, rtol=1e-12, atol=1e-14)
        for a, b in zip(dp, plain_dp):
            assert_close(a, b, rtol=1e-12, atol=1e-14)


def _check_checkpoint_without_output() -> None:
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float64)
    run, params = _block(config)
    x0 = torch.randn(4, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(4, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    results = []
    for discard in (False, True):
        torch.manual_seed(SEED)
        tp_.model_parallel_cuda_manual_seed(SEED)
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(True)
        if discard:
            ckpt = tp_.CheckpointWithoutOutput()
            inner = ckpt.checkpoint(run, x, 2.0)
            out = torch.tanh(inner)  # saves ``inner`` for its backward
            ckpt.discard_output_and_register_recompute(out)
            assert inner.untyped_storage().size() == 0
            torch.rand(10)  # randomness between forward and backward must not leak into recomputation
        else:
            out = torch.tanh(run(x, 2.0))
        out.backward(grad)
        results.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in params]))
    (out0, dx0, dp0), (out1, dx1, dp1) = results
    assert torch.equal(out0, out1)
    assert_close(dx1, dx0, rtol=1e-12, atol=1e-14)
    for a, b in zip(dp1, dp0):
        assert_close(a, b, rtol=1e-12, atol=1e-14)
    seen = []
    tp_.checkpoint(lambda t: seen.append(tp_.random.is_checkpointing()) or t * 2, False, x0)
    assert seen == [True] and not tp_.random.is_checkpointing()


def _random_worker() -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    _check_streams()
    _check_nested_forks()
    _check_tracker_variants()
    _check_cpu_init_ignores_seed()
    _check_gpu_style_init()
    _check_checkpoint()
    _check_checkpoint_without_output()


@pytest.mark.slow
def test_rng_tracker_and_checkpoint():
    run_distributed(4, _random_worker)
