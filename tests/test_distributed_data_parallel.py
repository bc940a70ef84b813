"""DistributedDataParallel averages gradients exactly as a post-hoc all-reduce would, starts its
bucket all-reduces during the backward (from the second step on, as Megatron-core) in one order on
every rank, and keeps ranks in step when some gradients are missing. The GPT example with small
buckets still matches the serial losses."""

from __future__ import annotations

import copy
import gc
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import DistributedDataParallel, finalize_model_grads
from tests.conftest import SMALL_GPT, load_train_gpt
from tests.distributed import run_distributed

DIMS = [3, 5, 4, 6, 2]
ATOL = 1e-12


class Toy(torch.nn.Module):
    """Four Linear layers l0..l3 (all weights and biases of distinct sizes). ``reverse`` builds
    them so the forward runs l3 first: then backward produces l0's gradients first, the opposite
    of the reverse-registration order the buckets assume."""

    def __init__(self, reverse: bool = False, extra: bool = False) -> None:
        super().__init__()
        self.reverse = reverse
        for i in range(4):
            shape = (DIMS[i + 1], DIMS[i]) if reverse else (DIMS[i], DIMS[i + 1])
            self.add_module(f"l{i}", torch.nn.Linear(*shape, dtype=torch.float64))
        if extra:  # in a submodule registered last, so its bucket is bucket 0
            self.extra = torch.nn.ParameterList([torch.randn(7, dtype=torch.float64)])

    def layers(self) -> list[torch.nn.Linear]:
        layers = [getattr(self, f"l{i}") for i in range(4)]
        return layers[::-1] if self.reverse else layers

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        for layer in self.layers():
            x = torch.tanh(layer(x))
        if use_extra:
            x = x * self.extra[0].sum()
        return x

    def in_features(self) -> int:
        return DIMS[-1] if self.reverse else DIMS[0]


def _data(model: Toy, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, model.in_features(), dtype=torch.float64, generator=g) for _ in range(n)]


def _local_grads(
    model: torch.nn.Module, batches: list[torch.Tensor], use_extra: bool = False
) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for x in batches:
        model(x, use_extra).square().mean().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _average(grads: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """The mean over ``group`` of each rank's gradient, from all-gathered copies."""
    world = dist.get_world_size(group)
    out = []
    for g in grads:
        gathered = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(gathered, g, group=group)
        out.append(torch.stack(gathered).mean(0))
    return out


def _assert_grads(model: torch.nn.Module, expected: list[torch.Tensor], what: str) -> None:
    for (name, p), e in zip(model.named_parameters(), expected):
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(p.grad, e, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {name}: {m}")


class _LaunchRecorder:
    """Wraps torch.distributed.all_reduce to note each launch's size and how many of the model's
    parameters had a gradient at that moment."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.launches: list[tuple[int, int]] = []
        self._original = dist.all_reduce

    def __enter__(self) -> "_LaunchRecorder":
        def recording(tensor, *args, **kwargs):
            with_grad = sum(p.grad is not None for p in self.model.parameters())
            self.launches.append((tensor.numel(), with_grad))
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = recording
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original


def _first_step(ddp: DistributedDataParallel, model: torch.nn.Module, *args) -> int:
    """Runs the step in which the wrapper counts each parameter's gradients (Megatron-core's
    first batch): nothing starts during its backward. Returns how many buckets did."""
    ddp(*args).square().mean().backward()
    launched = ddp.launched_buckets
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    model.zero_grad(set_to_none=True)
    return launched


def _bucket_numels(ddp: DistributedDataParallel) -> list[int]:
    params = dict(ddp.module.named_parameters())
    return [sum(params[n].numel() for n in names) for names in ddp.buckets]


def _check_single_backward(rank: int, reverse: bool, bucket_size_bytes: int) -> dict:
    torch.manual_seed(0)  # same initial weights on every rank
    model = Toy(reverse=reverse)
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, dist.group.WORLD, bucket_size_bytes=bucket_size_bytes)
    (x,) = _data(model, 1, seed=100 + rank)  # different data per rank
    expected = _average(_local_grads(reference, [x]))
    first_step = _first_step(ddp, model, x)
    with _LaunchRecorder(model) as rec:
        ddp(x).square().mean().backward()
        launched_in_backward = ddp.launched_buckets
        ddp.finish_grad_sync()
    assert ddp.launched_buckets == 0  # reset for the next step
    _assert_grads(model, expected, f"single backward reverse={reverse} bucket={bucket_size_bytes}")
    # Every bucket starts exactly once, in bucket-index order.
    assert [n for n, _ in rec.launches] == _bucket_numels(ddp)
    return {"buckets": len(ddp.buckets), "in_backward": launched_in_backward, "launches": rec.launches,
            "first_step": first_step}


def _check_accumulation(rank: int, last_synced: bool) -> None:
    torch.manual_seed(1)
    model = Toy()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size_bytes=64)  # default group: WORLD
    batches = _data(model, 3, seed=200 + rank)
    expected = _average(_local_grads(reference, batches))
    _first_step(ddp, model, batches[0])
    with ddp.no_sync():
        for x in batches[:-1]:
            ddp(x).square().mean().backward()
        assert ddp.launched_buckets == 0  # nothing starts under no_sync
        if not last_synced:
            ddp(batches[-1]).square().mean().backward()
    if last_synced:
        ddp(batches[-1]).square().mean().backward()
        assert ddp.launched_buckets == len(ddp.buckets)  # all gradients were complete
    else:
        assert ddp.launched_buckets == 0
    ddp.finish_grad_sync()
    _assert_grads(model, expected, f"accumulation last_synced={last_synced}")

    # The next step starts clean: the optimizer's zero_grad is enough after finish_grad_sync.
    model.zero_grad(set_to_none=False)
    (x,) = _data(model, 1, seed=300 + rank)
    expected = _average(_local_grads(copy.deepcopy(model), [x]))
    ddp(x).square().mean().backward()
    ddp.finish_grad_sync()
    _assert_grads(model, expected, "second step")


def _check_missing_grads(rank: int) -> dict:
    world = dist.get_world_size()
    out = {}
    # (a) A parameter no rank uses: its bucket (bucket 0) holds back every later bucket until
    # finish_grad_sync, which reduces zeros for it on all ranks.
    torch.manual_seed(2)
    model = Toy(extra=True)
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size_bytes=1)
    assert ddp.buckets[0] == ("extra.0",)
    (x,) = _data(model, 1, seed=400 + rank)
    expected = _average(_local_grads(reference, [x]))
    _first_step(ddp, model, x)
    ddp(x).square().mean().backward()
    out["unused_in_backward"] = ddp.launched_buckets
    ddp.finish_grad_sync()
    _assert_grads(model, expected, "unused parameter")
    assert torch.equal(model.extra[0].grad, torch.zeros_like(model.extra[0]))

    # (b) A parameter only rank 0 uses: rank 0 starts every bucket during the backward, the
    # others at finish_grad_sync; the collectives still pair up and average to g0 / world.
    model = Toy(extra=True)
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size_bytes=1)
    (x,) = _data(model, 1, seed=500 + rank)
    use = rank == 0
    expected = _average(_local_grads(reference, [x], use_extra=use))
    _first_step(ddp, model, x, use)
    ddp(x, use_extra=use).square().mean().backward()
    out["rank0_only_in_backward"] = ddp.launched_buckets
    ddp.finish_grad_sync()
    _assert_grads(model, expected, "parameter used on rank 0 only")
    assert model.extra[0].grad.abs().sum() > 0  # rank 0's gradient reached every rank
    out["buckets"] = len(ddp.buckets)
    out["world"] = world
    return out


def _check_mixed_dtypes(rank: int) -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4, dtype=torch.float64), torch.nn.Linear(4, 2, dtype=torch.float32)
    )
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size_bytes=1 << 20)
    dtypes = [dict(model.named_parameters())[names[0]].dtype for names in ddp.buckets]
    assert sorted(map(str, dtypes)) == ["torch.float32", "torch.float64"]  # one bucket per dtype
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(600 + rank))

    def loss(m):
        return m[1](m[0](x).float()).square().mean()

    loss(reference).backward()
    expected = _average([p.grad for p in reference.parameters()])
    loss(model).backward()
    ddp.finish_grad_sync()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=ATOL if p.dtype == torch.float64 else 1e-6)


def _check_misuse(rank: int) -> None:
    torch.manual_seed(4)
    model = Toy()
    ddp = DistributedDataParallel(model, bucket_size_bytes=1)
    (x,) = _data(model, 1, seed=700)
    _first_step(ddp, model, x)
    ddp(x).square().mean().backward()
    # A second synced backward would add to gradients whose all-reduce already started.
    with pytest.raises(RuntimeError, match="after the collective of its bucket"):
        ddp(x).square().mean().backward()
    ddp.zero_grad_buffer()  # waits for the started all-reduces and forgets the step
    assert all(p.grad is None for p in model.parameters()) and ddp.launched_buckets == 0
    ddp(x).square().mean().backward()
    ddp.finish_grad_sync()
    assert all(p.grad is not None for p in model.parameters())


def _check_dropped_wrapper(rank: int) -> None:
    """A wrapper nobody holds is freed (its hooks on the parameters do not keep it, its module and
    its process groups alive); the module then trains locally, its gradients its own."""
    torch.manual_seed(5)
    model = Toy()
    ddp = DistributedDataParallel(model, bucket_size_bytes=1)
    (x,) = _data(model, 1, seed=800 + rank)
    _first_step(ddp, model, x)
    wrapper = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert wrapper() is None
    expected = _local_grads(copy.deepcopy(model), [x])
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    _assert_grads(model, expected, "after the wrapper was dropped")


def _ddp_worker() -> dict:
    rank = dist.get_rank()
    out = {}
    for reverse in (False, True):
        for bucket in (1, 200, 1 << 20):
            out[(reverse, bucket)] = _check_single_backward(rank, reverse, bucket)
    _check_accumulation(rank, last_synced=True)
    _check_accumulation(rank, last_synced=False)
    out["missing"] = _check_missing_grads(rank)
    _check_mixed_dtypes(rank)
    _check_misuse(rank)
    _check_dropped_wrapper(rank)
    return out


@pytest.mark.slow
def test_ddp_averages_and_overlaps_world4():
    results = run_distributed(4, _ddp_worker)
    for rank, out in enumerate(results):
        for reverse in (False, True):
            small, medium, large = (out[(reverse, b)] for b in (1, 200, 1 << 20))
            assert small["buckets"] == 8 and large["buckets"] == 1 and 1 < medium["buckets"] < 8
            for r in (small, medium, large):
                assert r["first_step"] == 0  # the first step only counts the gradients
                assert r["in_backward"] == r["buckets"]  # every bucket started before finish
        # Registration order matches backward order reversed: the first bucket starts while
        # most parameters still have no gradient, i.e. during the backward.
        first_numel, with_grad = out[(False, 1)]["launches"][0]
        assert with_grad <= 2, out[(False, 1)]["launches"]
        # Reversed use: l3's two gradients (buckets 0 and 1) are produced last, so buckets 2-7,
        # complete long before, wait for them: nothing starts before at least 7 of the 8
        # gradients exist.
        assert all(w >= 7 for _, w in out[(True, 1)]["launches"]), out[(True, 1)]["launches"]
        missing = out["missing"]
        assert missing["unused_in_backward"] == 0  # bucket 0 never became ready
        assert missing["rank0_only_in_backward"] == (missing["buckets"] if rank == 0 else 0)


def _group_worker() -> None:
    rank = dist.get_rank()
    # tp 2: data-parallel groups {0, 2} and {1, 3}; the default group is this rank's.
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(5)
    model = Toy()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size_bytes=100)
    ranks = dist.get_process_group_ranks
    assert ranks(ddp.data_parallel_group) == ranks(ps.get_data_parallel_group()) == [rank % 2, rank % 2 + 2]
    wrapper = torch.nn.Module()  # finalize_model_grads finds the DDP inside another wrapper
    wrapper.module = ddp
    batches = _data(model, 2, seed=800 + rank)
    expected = _average(_local_grads(reference, batches), group=ps.get_data_parallel_group())
    _first_step(ddp, model, batches[0])
    with ddp.no_sync():
        ddp(batches[0]).square().mean().backward()
    ddp(batches[1]).square().mean().backward()
    assert ddp.launched_buckets > 0
    finalize_model_grads([wrapper])
    _assert_grads(model, expected, "finalize_model_grads over the data-parallel subgroup")
    ps.destroy_model_parallel()

    # tp 4: a data-parallel group of one rank; nothing is registered or reduced.
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    model = Toy()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size_bytes=1)
    (x,) = _data(model, 1, seed=900 + rank)
    expected = _local_grads(reference, [x])
    with _LaunchRecorder(model) as rec:
        ddp(x).square().mean().backward()
        finalize_model_grads([ddp])
    assert rec.launches == [] and ddp.launched_buckets == 0
    _assert_grads(model, expected, "data-parallel size 1")
    ps.destroy_model_parallel()


@pytest.mark.slow
def test_ddp_in_parallel_state_groups():
    run_distributed(4, _group_worker)


def test_bad_input():
    with pytest.raises(ValueError, match="bucket_size_bytes must be an integer >= 1"):
        DistributedDataParallel(Toy(), bucket_size_bytes=0)
    with pytest.raises(ValueError, match="bucket_size_bytes must be an integer >= 1"):
        DistributedDataParallel(Toy(), bucket_size_bytes=True)
    frozen = Toy().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        DistributedDataParallel(frozen)
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        DistributedDataParallel(lambda x: x)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(Toy())


# The GPT example with buckets small enough that several start during each last backward ------


BUCKETED = SMALL_GPT + ["--steps", "4", "--dtype", "float64", "--grad-bucket-bytes", "4096"]


def _train_worker(runs):
    train_gpt = load_train_gpt()
    started_in_backward: list[tuple[int, int]] = []  # (buckets started, buckets) per step
    finish = DistributedDataParallel.finish_grad_sync

    def recording_finish(self):
        started_in_backward.append((self.launched_buckets, len(self.buckets)))
        finish(self)

    out = {}
    with mock.patch.object(DistributedDataParallel, "finish_grad_sync", recording_finish):
        for run in runs:
            started_in_backward.clear()
            losses = train_gpt.train(train_gpt.parse_args(BUCKETED + list(run)))["losses"]
            out[run] = (losses, list(started_in_backward))
    return out


@pytest.mark.slow  # trains the example GPT
def test_gpt_small_buckets_match_serial():
    (serial,) = run_distributed(1, _train_worker, [("--tp", "1", "--pp", "1")])
    runs = [
        ("--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "1f1b"),
        ("--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "gpipe", "--recompute"),
        ("--tp", "2", "--pp", "1", "--dp", "2"),
    ]
    results = run_distributed(4, _train_worker, runs)
    ref = torch.tensor(serial[("--tp", "1", "--pp", "1")][0], dtype=torch.float64)
    for run in runs:
        got = torch.tensor(results[0][run][0], dtype=torch.float64)
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=0, msg=lambda m: f"{run}: {m}")
        for rank_result in results:
            steps = rank_result[run][1]
            assert len(steps) == 4 and all(buckets > 1 for _, buckets in steps)
            # After the first step, which counts the gradients, every bucket got its gradients
            # in the last backward, so all started before finish_grad_sync was called.
            assert steps[0][0] == 0, (run, steps)
            assert all(started == buckets for started, buckets in steps[1:]), (run, steps)


# --- Megatron-core mode: DistributedDataParallelConfig, main_grad buffers, reduce-scatter ------------


def _ddp_config_worker() -> dict:
    from megatron_ext.distributed import DistributedDataParallelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for overlap in (False, True):
        for distributed in (False, True):
            torch.manual_seed(10)
            model = Toy()
            reference = copy.deepcopy(model)
            config = DistributedDataParallelConfig(
                overlap_grad_reduce=overlap, use_distributed_optimizer=distributed
            )
            ddp = DistributedDataParallel(model, bucket_size_bytes=200, ddp_config=config)
            batches = _data(model, 2, seed=1000 + rank)
            expected = _average(_local_grads(reference, batches))
            _first_step(ddp, model, batches[0])
            with ddp.no_sync():
                ddp(batches[0]).square().mean().backward()
            ddp(batches[1]).square().mean().backward()
            launched = ddp.launched_buckets
            ddp.finish_grad_sync()
            assert all(p.grad is None for p in model.parameters())  # gradients live in main_grad
            exp = dict(zip([n for n, _ in model.named_parameters()], expected))
            for bucket in ddp.grad_buckets:
                assert bucket.padded_numel % (world if distributed else 1) == 0
                lo, hi = ddp.shard_range(bucket)
                flat_expected = torch.zeros(bucket.padded_numel, dtype=torch.float64)
                for name, offset in zip(bucket.names, bucket.offsets):
                    flat_expected[offset : offset + exp[name].numel()] = exp[name].reshape(-1)
                # All-reduce: the whole bucket is averaged; reduce-scatter: this rank's slice.
                torch.testing.assert_close(bucket.grad_data[lo:hi], flat_expected[lo:hi], rtol=0, atol=ATOL)
                if distributed:
                    assert hi - lo == bucket.padded_numel // world
            out[(overlap, distributed)] = (launched, len(ddp.buckets))
            ddp.zero_grad_buffer()
            assert all(not bool(b.grad_data.any()) for b in ddp.grad_buckets)

    # 16-bit parameters with grad_reduce_in_fp32 accumulate in float32; Megatron's argument order.
    from megatron_ext.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    assert ddp.module is model and model.weight.main_grad.dtype == torch.float32
    with pytest.raises(ValueError, match="use_megatron_fsdp=True.* is for .*FullyShardedDataParallel"):
        DistributedDataParallel(config, DistributedDataParallelConfig(use_megatron_fsdp=True), model)
    with pytest.raises(ValueError, match="'optim_grads' needs use_megatron_fsdp=True"):
        DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads")
    return out


@pytest.mark.slow
def test_ddp_config_main_grads_and_reduce_scatter():
    for out in run_distributed(2, _ddp_config_worker):
        for (overlap, distributed), (launched, buckets) in out.items():
            assert buckets > 1
            # With overlap_grad_reduce the collectives start during the backward, else in finish.
            assert launched == (buckets if overlap else 0), (overlap, distributed, launched)


def _finalize_tokens_worker() -> None:
    from megatron_ext.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel()  # two data-parallel replicas
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    # Every rank draws every rank's gradients, so each can form the expected result itself.
    grads = [
        [torch.randn(p.shape, dtype=torch.float64, generator=gen) for p in model.parameters()]
        for _ in range(2)
    ]
    tokens = [5, 3]

    def check(expected_divisor: float | None, **kwargs) -> None:
        for p, g in zip(model.parameters(), grads[rank]):
            p.grad = g.clone()
        finalize_model_grads([model], **kwargs)
        for i, p in enumerate(model.parameters()):
            divisor = expected_divisor if expected_divisor is not None else 2.0
            torch.testing.assert_close(p.grad, (grads[0][i] + grads[1][i]) / divisor, rtol=1e-12, atol=0)

    check(None)  # the data-parallel average
    # Per-token loss: the data-parallel sum over the global token count.
    check(float(sum(tokens)), num_tokens=torch.tensor(tokens[rank]))
    # The same groups passed explicitly.
    check(
        float(sum(tokens)),
        num_tokens=torch.tensor(tokens[rank]),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    partial = ProcessGroupCollection(
        tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group()
    )
    with pytest.raises(AssertionError, match=r"pg_collection lacks \['embd', 'pos_embd', 'dp_cp'\]"):
        finalize_model_grads([model], pg_collection=partial)


@pytest.mark.slow
def test_finalize_per_token_scaling_and_pg_collection():
    run_distributed(2, _finalize_tokens_worker)


# --- gradient_accumulation_fusion under DistributedDataParallel ------------------------------------


class _FusedMlp(torch.nn.Module):
    def __init__(self, fusion: bool) -> None:
        from megatron_ext.model_parallel_config import ModelParallelConfig
        from megatron_ext.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        config = ModelParallelConfig(gradient_accumulation_fusion=fusion, params_dtype=torch.float64,
                                     use_cpu_initialization=True)
        self.fc1 = ColumnParallelLinear(6, 10, config=config, init_method=torch.nn.init.normal_)
        self.fc2 = RowParallelLinear(10, 4, config=config, init_method=torch.nn.init.normal_, bias=True,
                                     input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)[0]))[0]


def _fusion_worker() -> dict:
    from megatron_ext.distributed import DistributedDataParallelConfig

    ps.initialize_model_parallel()  # two data-parallel replicas
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(50 + rank)
    batches = [torch.randn(3, 6, dtype=torch.float64, generator=g) for _ in range(2)]
    out = {}
    for fusion in (False, True):
        torch.manual_seed(7)
        model = _FusedMlp(fusion)
        ddp = DistributedDataParallel(model, bucket_size_bytes=8,
                                      ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True))
        weights = [model.fc1.weight, model.fc2.weight]
        for step in range(2):
            with ddp.no_sync():
                ddp(batches[0]).square().mean().backward()
            ddp(batches[1]).square().mean().backward()
            # The fused weights' hooks fired (placeholder gradients), so every bucket started
            # during the backward, and the placeholders were not added into main_grad.
            launched = ddp.launched_buckets
            flags = [w.grad_added_to_main_grad for w in weights]
            ddp.finish_grad_sync()
            assert all(p.grad is None for p in model.parameters())
            out.setdefault(fusion, []).append(
                # Plain lists: tensors sent through the result queue need the worker alive to be read.
                (launched, len(ddp.grad_buckets), flags, [p.main_grad.tolist() for p in model.parameters()]))
            ddp.zero_grad_buffer()
            assert not any(w.grad_added_to_main_grad for w in weights)
    # Without a DistributedDataParallel (no flag on the weight) the fused weight gets no .grad.
    plain = _FusedMlp(True)
    for w in (plain.fc1.weight, plain.fc2.weight):
        w.main_grad = torch.zeros_like(w)
    plain(batches[0]).sum().backward()
    assert plain.fc1.weight.grad is None and plain.fc2.weight.grad is None
    assert bool(plain.fc1.weight.main_grad.any())
    return out


@pytest.mark.slow
def test_gradient_accumulation_fusion_keeps_overlap():
    for out in run_distributed(2, _fusion_worker):
        steps = list(zip(out[True], out[False]))
        assert out[True][0][0] == out[False][0][0] == 0  # the first step only counts the gradients
        for step, (fused, reference) in enumerate(steps):
            (launched, buckets, flags, grads), (ref_launched, _, ref_flags, ref_grads) = fused, reference
            assert buckets > 2 and (step == 0 or launched == buckets == ref_launched)
            assert flags == [True, True] and ref_flags == [False, False]
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=ATOL)
