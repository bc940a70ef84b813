"""FullyShardedDataParallel on its own: each strategy over a stack of units trains like one process
over the whole batch (float64, several micro-batches, the distributed optimizer), parameters and
gradients are held as shards between uses, gathers happen per unit as documented, mixed precision
keeps float32 shards, and bad input is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from megatron_ext.distributed import fully_sharded_data_parallel as fsdp_module
from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_ext.transformer import TransformerConfig
from tests.distributed import run_distributed

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MICRO = 3  # micro-batches per rank and step
STEPS = 3


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


def _batches(step: int, world: int) -> list[torch.Tensor]:
    """Every rank's micro-batches of ``step``: world x MICRO tensors of 4 rows."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(world * MICRO)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(next(model.parameters()).device)).pow(2).mean()


def _opt_config(**kw) -> OptimizerConfig:
    return OptimizerConfig(lr=5e-2, weight_decay=0.01, clip_grad=0.5, params_dtype=torch.float64, **kw)


def _serial(model: torch.nn.Module, world: int) -> tuple[list[float], list[float], dict]:
    """One process over every rank's micro-batches: the reference."""
    opt = get_megatron_optimizer(_opt_config(), [model])
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for x in _batches(step, world):
            loss = _loss(model, x) / (world * MICRO)
            loss.backward()
            total += float(loss.detach())
        _, norm, _ = opt.step()
        losses.append(total)
        norms.append(norm)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(model: torch.nn.Module, strategy: str, overlap: bool = False, **kw):
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, overlap_param_gather=overlap,
        overlap_grad_reduce=overlap, use_distributed_optimizer=overlap,
    )
    return FullyShardedDataParallel(_config(), ddp_config, model, fsdp_unit_modules=[Block], **kw)


def _train_sharded(fsdp: FullyShardedDataParallel, world: int, rank: int) -> tuple[list, list, dict]:
    distributed = fsdp.ddp_config.use_distributed_optimizer
    opt = get_megatron_optimizer(_opt_config(use_distributed_optimizer=distributed), [fsdp])
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        batches = _batches(step, world)[rank * MICRO : (rank + 1) * MICRO]
        for i, x in enumerate(batches):
            sync = fsdp.no_sync() if i < MICRO - 1 else torch.enable_grad()
            with sync:
                loss = _loss(fsdp, x) / MICRO
                loss.backward()
            total += loss.detach()
        finalize_model_grads([fsdp])
        _, norm, _ = opt.step()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        norms.append(norm)
    fsdp.gather_all_params()
    weights = {n: p.detach().clone() for n, p in fsdp.module.named_parameters()}
    fsdp.reshard_params()
    return losses, norms, weights


def _equal_serial_worker() -> dict:
    ps.initialize_model_parallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = Stack().double()
    ref = _serial(copy.deepcopy(reference), world)
    out = {}
    # Megatron-LM's overlap flags too: the parameter gathers of the unsharded strategies are left
    # in flight for the next forward's hooks; Megatron-LM turns the hooks off around evaluations.
    runs = [(s, r, False) for s in STRATEGIES for r in (True, False)]
    runs += [(s, True, True) for s in STRATEGIES]
    runs += [("optim_grads_params", "one unit", False)]  # disable_bucketing: the root alone
    for strategy, reshard, overlap in runs:
        if reshard == "one unit":
            config = DistributedDataParallelConfig(
                use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy
            )
            fsdp = FullyShardedDataParallel(
                _config(), config, copy.deepcopy(reference), disable_bucketing=True
            )
        else:
            fsdp = _sharded(copy.deepcopy(reference), strategy, overlap, reshard_after_forward=reshard)
        if overlap:
            fsdp.disable_forward_pre_hook()
            fsdp.enable_forward_pre_hook()
        got = _train_sharded(fsdp, world, rank)
        for what, a, b in (("losses", got[0], ref[0]), ("grad norms", got[1], ref[1])):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-12, atol=0,
                                       msg=lambda m: f"{strategy} {reshard} {what}: {m}")
        for name, value in ref[2].items():
            torch.testing.assert_close(got[2][name], value, rtol=1e-12, atol=1e-14,
                                       msg=lambda m: f"{strategy} {reshard} {name}: {m}")
        out[(strategy, reshard, overlap)] = got[0]
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])  # dp 1: each micro-batch counted once there too
def test_each_strategy_trains_like_one_process(world):
    results = run_distributed(world, _equal_serial_worker)
    assert len(results[0]) == 3 * len(STRATEGIES) + 1


def _gathers_worker() -> dict:
    """What is resident between uses, and how often a unit is gathered."""
    ps.initialize_model_parallel()
    world = dist.get_world_size()
    torch.manual_seed(0)
    out = {}
    for reshard in (True, False):
        fsdp = _sharded(Stack().double(), "optim_grads_params", reshard_after_forward=reshard)
        opt = get_megatron_optimizer(_opt_config(use_distributed_optimizer=True), [fsdp])
        units = [u for u in fsdp._units if u.module is not None]
        assert len(units) == 3 and all(isinstance(u.module, Block) for u in units)
        weight = fsdp.module.blocks[0].up.weight
        assert weight.untyped_storage().nbytes() == 0  # sharded from construction on
        calls, scatters = [], []
        gather, scatter = fsdp_module.dist_all_gather_func, fsdp_module.dist_reduce_scatter_func
        fsdp_module.dist_all_gather_func = lambda *a, **k: calls.append(1) or gather(*a, **k)
        fsdp_module.dist_reduce_scatter_func = lambda *a, **k: scatters.append(1) or scatter(*a, **k)
        try:
            for i, x in enumerate(_batches(0, world)[:MICRO]):
                with fsdp.no_sync() if i < MICRO - 1 else torch.enable_grad():
                    _loss(fsdp, x).backward()
                if reshard:  # freed after its backward, until the next forward
                    assert weight.untyped_storage().nbytes() == 0
            finalize_model_grads([fsdp])
            opt.step()
        finally:
            fsdp_module.dist_all_gather_func = gather
            fsdp_module.dist_reduce_scatter_func = scatter
        # Freed after the step: the next forward gathers the updated shards.
        assert weight.untyped_storage().nbytes() == 0
        assert fsdp.module.inp.weight.untyped_storage().nbytes() == 0  # the root's too
        # Megatron-LM's torch-format save: the whole parameters, gathered, then freed again.
        saved = fsdp.state_dict_for_save_checkpoint()
        assert set(saved) == set(fsdp.module.state_dict())
        assert weight.untyped_storage().nbytes() == 0 and saved["blocks.0.up.weight"].abs().sum() > 0
        fsdp.gather_all_params()
        torch.testing.assert_close(saved["blocks.0.up.weight"], weight, rtol=0, atol=0)
        fsdp.reshard_params()
        # The gradients live in the shards: main_grad is this rank's part, 1-D.
        shard = fsdp.module.blocks[0].up.weight.main_grad
        owned = torch.tensor(shard.numel())
        dist.all_reduce(owned)
        assert shard.dim() == 1 and int(owned) == weight.numel()
        out[reshard] = (len(calls), len(scatters))
    ps.destroy_model_parallel()
    return out


def _cuda_worker() -> None:
    """dp 1 on a GPU: the buffers' storage is freed and given back on the device."""
    ps.initialize_model_parallel()
    torch.manual_seed(0)
    reference = Stack().double().cuda()
    ref = _serial(copy.deepcopy(reference), 1)
    for strategy in STRATEGIES[1:]:
        fsdp = _sharded(copy.deepcopy(reference), strategy)
        assert fsdp.module.blocks[0].up.weight.is_cuda
        got = _train_sharded(fsdp, 1, 0)
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-12, atol=0)
        for name, value in ref[2].items():
            torch.testing.assert_close(got[2][name], value, rtol=1e-12, atol=1e-14)
        freed = fsdp.module.blocks[0].up.weight.untyped_storage().nbytes() == 0
        assert freed == (strategy == "optim_grads_params"), strategy
    ps.destroy_model_parallel()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_single_rank_on_cuda():
    run_distributed(1, _cuda_worker)


def _construction_worker() -> tuple[int, int, int]:
    """The bytes alive above the built model's while the wrapper is built (sampled as each unit's
    buffer is made) and once it is, against the largest unit's padded buffer."""
    from megatron_ext.distributed import param_and_grad_buffer as buffers
    from benchmarks.common import live_cpu_storages

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    model = Stack(width=64, depth=4).double()
    base = sum(live_cpu_storages().values())
    samples = []
    original = buffers._ParamAndGradBuffer.__init__

    def sampled(self, *args, **kwargs):
        original(self, *args, **kwargs)
        samples.append(sum(live_cpu_storages().values()) - base)

    buffers._ParamAndGradBuffer.__init__ = sampled
    try:
        config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
        )
        fsdp = FullyShardedDataParallel(_config(), config, model, [Block])
    finally:
        buffers._ParamAndGradBuffer.__init__ = original
    largest = max(sum(b.padded_numel for b in u.buckets) for u in fsdp._units) * 8
    after = sum(live_cpu_storages().values()) - base
    ps.destroy_model_parallel()
    return max(samples), after, largest


def test_construction_never_holds_every_gradient_buffer():
    """A unit's full gradient buffer is freed as soon as it is made: building the wrapper holds
    the model (moved into its buffers, padding added) plus one unit's gradients at most, not the
    whole model's gradients; afterwards the shards take the model's place."""
    for peak, after, largest in run_distributed(2, _construction_worker):
        assert 0 < peak <= 2 * largest, (peak, largest)
        assert abs(after) <= largest // 8, (after, largest)


def test_units_are_gathered_freed_and_regathered():
    for out in run_distributed(2, _gathers_worker):
        # One all-gather per bucket: the root (1 bucket) once a step; each of the 3 units before
        # every forward and every backward (but the last unit, kept for its backward once the
        # order is known: from the second micro-batch on), or once a step without resharding. One
        # reduce-scatter per unit and root in every backward (no_sync does not defer them, as in
        # Megatron-FSDP), or once a step without resharding, where no_sync defers them.
        assert out[True] == (1 + 3 * 2 * MICRO - (MICRO - 1), 4 * MICRO), out
        assert out[False] == (1 + 3, 4), out


def _mixed_precision_worker() -> dict:
    """bf16 parameters, float32 gradients (grad_reduce_in_fp32) and float32 main shards: the
    same float32 main parameters as the distributed optimizer's, to float32 rounding."""
    ps.initialize_model_parallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = Stack().to(torch.bfloat16)
    mains = {}
    for strategy in ("ddp", "optim_grads", "optim_grads_params"):
        model = copy.deepcopy(reference)
        if strategy == "ddp":
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True
            )
            wrapped = DistributedDataParallel(_config(), ddp_config, model)
        else:
            wrapped = FullyShardedDataParallel(
                _config(), DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy
                ), model, fsdp_unit_modules=[Block],
            )
            grads = [b.grad_shard for buffer in wrapped.buffers for b in buffer.buckets]
            assert all(g.dtype == torch.float32 for g in grads)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=True),
                                     [wrapped])
        for x in _batches(0, world)[rank * MICRO : (rank + 1) * MICRO]:
            (_loss(wrapped, x.to(torch.bfloat16)).float() / MICRO).backward()
        finalize_model_grads([wrapped])
        opt.step()
        assert all(s.main.dtype == torch.float32 for s in opt._slots)
        state = opt.param_state_by_name()  # the main parameters in model space
        mains[strategy] = torch.cat([state[name]["param"].reshape(-1) for name in sorted(state)])
        assert mains[strategy].dtype == torch.float32
    # The float32 gradients are sums of the same bf16 products in another order: their rounding
    # (2^-24 relative per addition) moves an Adam update of size lr by at most that much.
    for strategy in ("optim_grads", "optim_grads_params"):
        torch.testing.assert_close(mains[strategy], mains["ddp"], rtol=0, atol=1e-2 * 2**-16)
    ps.destroy_model_parallel()
    return {k: v.numel() for k, v in mains.items()}


def test_mixed_precision_keeps_float32_shards():
    run_distributed(2, _mixed_precision_worker)


def _bad_input_worker() -> list[str]:
    ps.initialize_model_parallel()
    messages = []

    def expect(error, match, fn):
        with pytest.raises(error, match=match) as info:
            fn()
        messages.append(str(info.value))

    cfg = DistributedDataParallelConfig
    expect(ValueError, "data_parallel_sharding_strategy must be one of .* got 'zero3'",
           lambda: cfg(use_megatron_fsdp=True, data_parallel_sharding_strategy="zero3"))
    expect(ValueError, "'optim' needs use_megatron_fsdp=True",
           lambda: cfg(data_parallel_sharding_strategy="optim"))
    expect(NotImplementedError, "outer_dp_sharding_strategy",
           lambda: cfg(use_megatron_fsdp=True, outer_dp_sharding_strategy="optim"))
    expect(NotImplementedError, "fsdp_double_buffer",
           lambda: cfg(use_megatron_fsdp=True, fsdp_double_buffer=True))
    expect(ValueError, "is for megatron_ext.distributed.FullyShardedDataParallel",
           lambda: DistributedDataParallel(_config(), cfg(use_megatron_fsdp=True), Stack()))
    fsdp_config = cfg(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    expect(ValueError, r"fsdp_unit_modules \['Conv1d'\] name no module of Stack",
           lambda: FullyShardedDataParallel(_config(), fsdp_config, Stack(), [torch.nn.Conv1d]))
    small = cfg(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads",
                suggested_communication_unit_size=100)
    expect(ValueError, "unit 'blocks.0' gathers 512 elements at once, more than "
           "suggested_communication_unit_size=100",
           lambda: FullyShardedDataParallel(_config(), small, Stack(), [Block]))
    fused = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    fused.gradient_accumulation_fusion = True
    expect(ValueError, "gradient_accumulation_fusion with data_parallel_sharding_strategy "
           "'optim_grads_params'",
           lambda: FullyShardedDataParallel(fused, fsdp_config, Stack(), [Block]))
    expect(ValueError, "device 'meta', but the module's parameters are on \\['cpu'\\]",
           lambda: FullyShardedDataParallel(_config(), fsdp_config, Stack(), [Block], device="meta"))
    expect(ValueError, "disable_bucketing=True makes the model one unit; it cannot be combined with "
           r"fsdp_unit_modules \['Block'\]",
           lambda: FullyShardedDataParallel(_config(), fsdp_config, Stack(), [Block], disable_bucketing=True))
    one = FullyShardedDataParallel(_config(), fsdp_config, Stack(), disable_bucketing=True)
    assert [u.module for u in one._units] == [None] and len(one.buckets) == 1
    hybrid = cfg(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads",
                 num_distributed_optimizer_instances=2)
    expect(NotImplementedError, "num_distributed_optimizer_instances > 1 \\(hybrid sharding\\)",
           lambda: FullyShardedDataParallel(_config(), hybrid, Stack(), [Block]))
    wrapped = FullyShardedDataParallel(_config(), fsdp_config, Stack(), [Block])
    expect(ValueError, "give OptimizerConfig\\(use_distributed_optimizer=True\\)",
           lambda: get_megatron_optimizer(OptimizerConfig(lr=1.0), [wrapped]))
    expect(NotImplementedError, "force_all_reduce", lambda: wrapped.finish_grad_sync(force_all_reduce=True))
    ps.destroy_model_parallel()
    return messages


def test_bad_input_is_refused_alike_on_every_rank():
    results = run_distributed(2, _bad_input_worker)
    assert results[0] == results[1] and len(results[0]) == 13
