"""The gradient buffers behind DistributedDataParallel, as Megatron-core lays them out and reduces
them: bucket boundaries and padding, parameter order, the shared embedding's own bucket,
grad_reduce_in_fp32, readiness (nothing starts in the first step), average_in_collective,
force_all_reduce, several distributed-optimizer instances and the reduce-scatter that accumulates
bf16 in float32; Megatron's constructor (config, ddp_config, module, disable_bucketing,
pg_collection) by position and keyword."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_ext.distributed.param_and_grad_buffer import (
    GradSyncError,
    partition_buckets,
    reduce_scatter_with_fp32_accumulation,
    shard_buffer,
)
from megatron_ext.process_groups_config import ProcessGroupCollection
from tests.distributed import run_distributed


class Layers(torch.nn.Module):
    """Three Linear(10, 10) layers: parameters l0.weight (100), l0.bias (10), ..., l2.bias."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, shared_embedding: bool = False) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = (torch.nn.Linear(10, 10, dtype=dtype) for _ in range(3))
        if shared_embedding:
            self.l0.weight.shared_embedding = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


def _layout(ddp: DistributedDataParallel) -> list[tuple[list[str], int, int, list[int]]]:
    """Per bucket: its parameter names, numel_unpadded, padded size and parameter offsets."""
    (buffer,) = ddp.buffers
    return [(b.names, b.numel_unpadded, b.grad_data.numel(), b.offsets) for b in buffer.buckets]


REVERSED = ["l2.bias", "l2.weight", "l1.bias", "l1.weight", "l0.bias", "l0.weight"]


def _layout_worker() -> dict:
    ps.initialize_model_parallel()  # dp 2
    config = SimpleNamespace(calculate_per_token_loss=False)  # any config object with the fields read
    out = {}
    for distributed in (False, True):
        for bucket_size in (None, 150):
            for shared in (False, True):
                ddp_config = DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,
                    overlap_grad_reduce=True,
                    use_distributed_optimizer=distributed,
                    bucket_size=bucket_size,
                )
                ddp = DistributedDataParallel(config, ddp_config, Layers(shared_embedding=shared))
                out[(distributed, bucket_size, shared)] = _layout(ddp)
                (buffer,) = ddp.buffers
                assert buffer.grad_data.dtype == torch.float32 and buffer.param_dtype == torch.bfloat16
                for p in ddp.module.parameters():  # main_grad: a float32 view into the one buffer
                    assert p.main_grad.dtype == torch.float32
                    assert (
                        p.main_grad.untyped_storage().data_ptr()
                        == buffer.grad_data.untyped_storage().data_ptr()
                    )
    # Without grad_reduce_in_fp32 gradients stay bf16; a float64 parameter gets its own buffer.
    model = Layers()
    model.l1.double()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    out["dtypes"] = [
        (b.param_dtype, b.grad_dtype, [n for bk in b.buckets for n in bk.names]) for b in ddp.buffers
    ]
    return out


def test_bucket_layout_padding_and_order():
    out = run_distributed(2, _layout_worker)[0]
    # All-reduce: parameters packed in reverse order; a bucket closes at >= bucket_size elements.
    assert out[(False, None, False)] == [(REVERSED, 330, 330, [0, 10, 110, 120, 220, 230])]
    assert out[(False, 150, False)] == [
        (REVERSED[:4], 220, 220, [0, 10, 110, 120]),
        (REVERSED[4:], 110, 110, [0, 10]),
    ]
    # Without the distributed optimizer the shared embedding shares its bucket.
    assert out[(False, 150, True)] == out[(False, 150, False)]
    # Reduce-scatter: parameters start at multiples of 64, buckets end at multiples of lcm(2, 128).
    assert out[(True, None, False)] == [(REVERSED, 548, 640, [0, 64, 192, 256, 384, 448])]
    assert out[(True, 150, False)] == [
        (REVERSED[:2], 164, 256, [0, 64]),
        (REVERSED[2:4], 164, 256, [0, 64]),
        (REVERSED[4:], 164, 256, [0, 64]),
    ]
    # ... and the shared embedding gets a bucket of its own.
    # (It closes the bucket before it at its own, aligned, start: the alignment counts as unpadded.)
    assert out[(True, None, True)] == [
        (REVERSED[:5], 448, 512, [0, 64, 192, 256, 384]),
        (["l0.weight"], 100, 128, [0]),
    ]
    assert out[(True, 150, True)] == [
        (REVERSED[:2], 164, 256, [0, 64]),
        (REVERSED[2:4], 164, 256, [0, 64]),
        (["l0.bias"], 64, 128, [0]),
        (["l0.weight"], 100, 128, [0]),
    ]
    assert out["dtypes"] == [
        (torch.bfloat16, torch.bfloat16, ["l2.bias", "l2.weight", "l0.bias", "l0.weight"]),
        (torch.float64, torch.float64, ["l1.bias", "l1.weight"]),
    ]


# --- reductions ------------------------------------------------------------------------------------


def _fill(ddp: DistributedDataParallel, rank: int) -> None:
    """main_grad = rank + 1 + 0.01 * index within the buffer (distinct per rank and element)."""
    for buffer in ddp.buffers:
        index = torch.arange(buffer.grad_data.numel(), dtype=torch.float64)
        buffer.grad_data.copy_(rank + 1 + 0.01 * index)


def _expected(
    ddp: DistributedDataParallel, world: int, group_rank: int, sliced: bool, average: bool = False
) -> list[torch.Tensor]:
    """Per buffer: the average over the ranks where this rank receives it; elsewhere (outside the
    reduce-scattered slice) its own values, scaled by 1 / world unless the collective averages."""
    out = []
    for buffer in ddp.buffers:
        index = torch.arange(buffer.grad_data.numel(), dtype=torch.float64)
        mean = sum(r + 1 for r in range(world)) / world + 0.01 * index
        if not sliced:
            out.append(mean)
            continue
        own = (dist.get_rank() + 1 + 0.01 * index) / (1 if average else world)
        for bucket in buffer.buckets:
            lo = bucket.offset + bucket.grad_data.numel() // world * group_rank
            hi = lo + bucket.grad_data.numel() // world
            own[lo:hi] = mean[lo:hi]
        out.append(own)
    return out


def _check(ddp: DistributedDataParallel, expected: list[torch.Tensor], what: str) -> None:
    for buffer, e in zip(ddp.buffers, expected):
        torch.testing.assert_close(
            buffer.grad_data.double(), e, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}"
        )


def _reduction_worker() -> dict:
    ps.initialize_model_parallel()  # dp 4
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for distributed in (False, True):
        for average in (False, True):
            ddp_config = DistributedDataParallelConfig(
                overlap_grad_reduce=True, use_distributed_optimizer=distributed, average_in_collective=average
            )
            ddp = DistributedDataParallel(None, ddp_config, Layers(torch.float64))
            (group,) = ddp.bucket_groups
            params = list(ddp.module.parameters())
            # First step: registering every gradient starts nothing; finish starts and waits.
            _fill(ddp, rank)
            for p in params:
                group.register_grad_ready(p)
            assert not group.grad_reduce_dispatched
            group.finish_grad_sync()
            expected = _expected(ddp, world, rank, distributed, average)
            _check(ddp, expected, f"first step distributed={distributed} average={average}")
            group.reset()
            # From the second step: it starts with the last gradient, not before.
            _fill(ddp, rank)
            for p in params[:-1]:
                group.register_grad_ready(p)
                with pytest.raises(GradSyncError, match=r"has not been issued for this bucket \(\d/6 params"):
                    group.finish_grad_sync()
            group.register_grad_ready(params[-1])
            out[(distributed, average)] = group.grad_reduce_dispatched
            group.finish_grad_sync()
            _check(ddp, expected, f"second step distributed={distributed} average={average}")
            with pytest.raises(AssertionError):  # GradSyncError is an AssertionError too
                group.finish_grad_sync()
            group.reset()

    # Without overlap_grad_reduce: register_grad_ready is refused, finish reduces synchronously;
    # force_all_reduce all-reduces a distributed optimizer's bucket.
    ddp = DistributedDataParallel(
        None, DistributedDataParallelConfig(use_distributed_optimizer=True), Layers(torch.float64)
    )
    with pytest.raises(GradSyncError, match="only be called when overlap_grad_reduce is True"):
        ddp.bucket_groups[0].register_grad_ready(next(ddp.module.parameters()))
    _fill(ddp, rank)
    ddp.finish_grad_sync(force_all_reduce=True)
    _check(ddp, _expected(ddp, world, rank, False), "force_all_reduce")
    _fill(ddp, rank)
    ddp.finish_grad_sync()
    _check(ddp, _expected(ddp, world, rank, True), "reduce-scatter")
    ps.destroy_model_parallel()

    # Two distributed-optimizer instances of two ranks: reduce-scatter within, all-reduce across.
    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    intra_rank = ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True)
    for average in (False, True):
        ddp = DistributedDataParallel(
            None,
            DistributedDataParallelConfig(
                use_distributed_optimizer=True,
                num_distributed_optimizer_instances=2,
                average_in_collective=average,
            ),
            Layers(torch.float64),
        )
        assert ddp.buffers[0].data_parallel_world_size == 2
        _fill(ddp, rank)
        ddp.finish_grad_sync()
        (buffer,) = ddp.buffers
        mean = (
            sum(r + 1 for r in range(world)) / world + 0.01 * torch.arange(buffer.grad_data.numel()).double()
        )
        for bucket in buffer.buckets:
            lo, hi = ddp.shard_range(bucket)
            assert hi - lo == bucket.grad_data.numel() // 2 and lo == intra_rank * (hi - lo)
            torch.testing.assert_close(
                bucket.grad_data[lo:hi], mean[bucket.offset + lo : bucket.offset + hi], rtol=1e-12, atol=1e-12
            )
    return out


@pytest.mark.slow
def test_reductions_readiness_and_instances():
    for out in run_distributed(4, _reduction_worker):
        assert all(out.values())  # started by the last gradient's registration


# --- fp32 accumulation of the bf16 reduce-scatter ----------------------------------------------------


def _fp32_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.rand(4096, generator=gen).bfloat16() * 3 for _ in range(world)
    ]  # every rank's, on every rank
    reference = torch.stack([x.float() for x in inputs]).sum(0).bfloat16()  # summed in float32, rounded once
    size = 4096 // world
    out = {}
    for async_op in (False, True):
        x = inputs[rank].clone()
        handle = reduce_scatter_with_fp32_accumulation(
            shard_buffer(x, world)[rank], x, group=None, async_op=async_op
        )
        if async_op:
            handle.wait()
        assert torch.equal(x[rank * size : (rank + 1) * size], reference[rank * size : (rank + 1) * size])
        out[async_op] = True
    # A plain bf16 reduce-scatter rounds at every partial sum: it differs somewhere.
    plain = torch.empty(size, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(plain, inputs[rank].clone())
    out["plain_differs"] = not torch.equal(plain, reference[rank * size : (rank + 1) * size])
    with pytest.raises(ValueError, match="ReduceOp.SUM only"):
        reduce_scatter_with_fp32_accumulation(plain, inputs[rank].clone(), op=dist.ReduceOp.MAX)

    # In DistributedDataParallel: the bf16 buckets' slices are the float32-accumulated sums / dp.
    ps.initialize_model_parallel()
    model = Layers()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            reduce_scatter_with_fp32_accumulation=True,
            average_in_collective=True,
        ),
        model,
    )
    (buffer,) = ddp.buffers
    all_grads = [torch.rand(buffer.grad_data.numel(), generator=gen).bfloat16() for _ in range(world)]
    buffer.grad_data.copy_(all_grads[rank])
    ddp.finish_grad_sync()
    summed = torch.stack([g.float() for g in all_grads]).sum(0).bfloat16()
    (bucket,) = buffer.buckets
    lo, hi = ddp.shard_range(bucket)
    assert torch.equal(bucket.grad_data[lo:hi], (summed[lo:hi].float() / world).bfloat16())
    return out


@pytest.mark.slow
def test_reduce_scatter_with_fp32_accumulation():
    for out in run_distributed(4, _fp32_worker):
        assert out == {False: True, True: True, "plain_differs": True}


# --- Megatron's constructor, bucketing switches, pg_collection, per-token sums --------------------------


def _constructor_worker() -> dict:
    rank = dist.get_rank()
    out = {}
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)  # pp 2 x dp 2
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=150)
    config = SimpleNamespace(calculate_per_token_loss=False)
    by_position = DistributedDataParallel(config, ddp_config, Layers())
    by_keyword = DistributedDataParallel(
        module=Layers(), ddp_config=ddp_config, config=config, disable_bucketing=False, pg_collection=None
    )
    # Stages after the first put everything into one bucket, as Megatron-core does.
    out["buckets"] = (len(by_position.grad_buckets), len(by_keyword.grad_buckets))
    single = DistributedDataParallel(config, ddp_config, Layers(), disable_bucketing=True)
    out["disabled"] = (len(single.bucket_groups), len(single.grad_buckets))
    assert by_position.config is config and by_position.ddp_config is ddp_config
    two = Layers()
    two.l1.double()
    grouped = partition_buckets(
        DistributedDataParallel(config, ddp_config, two).buffers, force_single_bucket_group=True
    )
    assert len(grouped) == 1 and len(grouped[0].buckets) == 2
    with pytest.raises(TypeError, match="ddp_config must be a DistributedDataParallelConfig"):
        DistributedDataParallel(config, 5, Layers())
    with pytest.raises(TypeError, match="config must be a configuration object"):
        DistributedDataParallel("gpt", ddp_config, Layers())
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        DistributedDataParallel(config, ddp_config, None)
    ps.destroy_model_parallel()

    # A pg_collection's data-parallel group (pairs {0, 1} and {2, 3}) replaces parallel_state's.
    ps.initialize_model_parallel()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    pgs = ProcessGroupCollection(
        dp=mine,
        dp_cp=mine,
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        ep=None,
        expt_dp=None,
    )
    with pytest.raises(
        ValueError, match=r"tp, pp and ep process groups are required but pg_collection lacks \['ep'\]"
    ):
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(),
            Layers(torch.float64),
            pg_collection=ProcessGroupCollection(dp=mine, tp=mine, pp=mine),
        )
    model = Layers(torch.float64)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=pgs)
    assert dist.get_process_group_ranks(ddp.dp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    _fill(ddp, rank)
    ddp.finish_grad_sync()
    pair_mean = (rank // 2 * 2 + 1 + rank // 2 * 2 + 2) / 2
    index = torch.arange(ddp.buffers[0].grad_data.numel(), dtype=torch.float64)
    torch.testing.assert_close(ddp.buffers[0].grad_data, pair_mean + 0.01 * index, rtol=1e-12, atol=1e-12)

    # calculate_per_token_loss: the buckets are summed, and finalize_model_grads divides by the
    # global token count; scale_gradients and broadcast_params.
    summing = DistributedDataParallel(
        SimpleNamespace(calculate_per_token_loss=True), DistributedDataParallelConfig(), Layers(torch.float64)
    )
    _fill(summing, rank)
    tokens = torch.tensor(float(rank + 1))
    finalize_model_grads([summing], num_tokens=tokens)
    total = sum(r + 1 for r in range(4))
    index = torch.arange(summing.buffers[0].grad_data.numel(), dtype=torch.float64)
    torch.testing.assert_close(
        summing.buffers[0].grad_data, (total + 4 * 0.01 * index) / total, rtol=1e-12, atol=1e-12
    )
    summing.scale_gradients(2.0)
    torch.testing.assert_close(
        summing.buffers[0].grad_data, 2 * (total + 4 * 0.01 * index) / total, rtol=1e-12, atol=1e-12
    )
    with torch.no_grad():
        for p in summing.module.parameters():
            p.fill_(rank)
    summing.broadcast_params()
    assert all(bool((p == 0).all()) for p in summing.module.parameters())
    return out


@pytest.mark.slow
def test_megatron_constructor_and_groups():
    results = run_distributed(4, _constructor_worker)
    for rank, out in enumerate(results):
        # Ranks 0, 1: first pipeline stage (3 buckets of >= 150 elements); 2, 3: one bucket.
        assert out["buckets"] == ((2, 2) if rank < 2 else (1, 1)), (rank, out)
        assert out["disabled"] == (1, 1)
