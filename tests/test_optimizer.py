"""megatron_ext.optimizer: the distributed optimizer's steps equal the plain optimizer's (float64,
1e-12) at every (tp, pp, dp) layout tried; clipping by the global norm equals torch's serial
clip_grad_norm_; fp16 loss scaling skips steps with inf/NaN gradients on every rank; bf16 tracks
float32; optimizer state per rank falls as 1/dp; the by-name state round-trips across optimizers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_ext.optimizer import (
    DistributedOptimizer,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_ext.pipeline_parallel import get_forward_backward_func
from tests.conftest import SMALL_GPT, load_train_gpt
from tests.distributed import run_distributed


def _build(train_gpt, args, distributed: bool, clip_grad: float = 0.0, bucket_bytes: int | None = None):
    """A DDP-wrapped GPT and its optimizer at the current parallel_state layout."""
    sixteen = args.bf16 or args.fp16
    ddp = DistributedDataParallel(
        train_gpt.build_model(args)[0],
        bucket_size_bytes=bucket_bytes,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=sixteen, overlap_grad_reduce=True, use_distributed_optimizer=distributed
        ),
    )
    ddp.module.config.no_sync_func = ddp.no_sync
    config = OptimizerConfig(lr=args.lr, weight_decay=0.1, bf16=args.bf16, fp16=args.fp16,
                             clip_grad=clip_grad, use_distributed_optimizer=distributed)
    return ddp, get_megatron_optimizer(config, [ddp])


def _run_step(train_gpt, args, corpus, step, ddp, optimizer):
    optimizer.zero_grad()
    needs_data = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    get_forward_backward_func()(
        forward_step_func=train_gpt.forward_step,
        data_iterator=iter(train_gpt.step_microbatches(corpus, step, args)) if needs_data else None,
        model=ddp, num_microbatches=args.global_batch_size // (args.micro_batch_size * args.dp),
        seq_length=args.seq_len, micro_batch_size=args.micro_batch_size, forward_only=False,
    )
    return optimizer.step()


def _equivalence_worker(layouts, extra):
    """Plain vs distributed optimizer from the same weights and batches: parameters, gradient
    norms and by-name optimizer state after each step; then a by-name reload continues alike."""
    train_gpt = load_train_gpt()
    out = {}
    for tp, pp, dp in layouts:
        args = train_gpt.parse_args(SMALL_GPT + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
                                                 "--dtype", "float64"] + extra)
        train_gpt.check_args(args, dist.get_world_size())
        corpus = train_gpt.load_corpus(None, args.seq_len + 2)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        # Small buckets: parameters straddle the data-parallel slices.
        plain, plain_opt = _build(train_gpt, args, False, clip_grad=0.05)
        shard, shard_opt = _build(train_gpt, args, True, clip_grad=0.05, bucket_bytes=3000)
        assert isinstance(plain_opt, FP32Optimizer) and isinstance(shard_opt, DistributedOptimizer)
        worst, norms = 0.0, []
        for step in range(3):
            a = _run_step(train_gpt, args, corpus, step, plain, plain_opt)
            b = _run_step(train_gpt, args, corpus, step, shard, shard_opt)
            assert a[0] and b[0]
            norms.append((a[1], b[1]))
            for (name, p), q in zip(plain.named_parameters(), shard.parameters()):
                worst = max(worst, ((p - q).abs().max() / p.abs().max().clamp_min(1e-30)).item())
        state_a, state_b = plain_opt.param_state_by_name(), shard_opt.param_state_by_name()
        assert state_a.keys() == state_b.keys() == dict(plain.named_parameters()).keys()
        for name in state_a:
            for key in ("param", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state_b[name][key], state_a[name][key], rtol=1e-12, atol=1e-15)
        assert plain_opt.state_dict()["step"] == shard_opt.state_dict()["step"] == 3

        # A fresh distributed optimizer loaded by name (e.g. from another layout) continues alike.
        fresh, fresh_opt = _build(train_gpt, args, True, clip_grad=0.05, bucket_bytes=5000)
        fresh_opt.load_param_state_by_name(state_a)
        fresh_opt.load_state_dict({"step": 3})
        a = _run_step(train_gpt, args, corpus, 3, plain, plain_opt)
        b = _run_step(train_gpt, args, corpus, 3, fresh, fresh_opt)
        torch.testing.assert_close(torch.tensor(b[1]), torch.tensor(a[1]), rtol=1e-12, atol=0)
        for p, q in zip(plain.parameters(), fresh.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-15)
        out[(tp, pp, dp)] = {"worst": worst, "norms": norms}
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize(
    "world,layouts,extra",
    [
        (4, [(1, 1, 4), (2, 1, 2), (1, 2, 2)], []),
        (4, [(2, 1, 2)], ["--sequence-parallel"]),
        (8, [(2, 2, 2)], ["--sequence-parallel"]),
    ],
)
@pytest.mark.slow  # trains the example GPT
def test_distributed_optimizer_equals_plain(world, layouts, extra):
    results = run_distributed(world, _equivalence_worker, layouts, extra, timeout=600)
    for out in results:
        for layout, r in out.items():
            assert r["worst"] < 1e-12, (layout, r["worst"])
            for a, b in r["norms"]:
                assert a > 0.05  # clipping was active
                assert abs(a - b) <= 1e-12 * a, (layout, a, b)
    for layout in results[0]:  # every rank reports the same global norm
        assert all(out[layout]["norms"] == results[0][layout]["norms"] for out in results)


def _clip_worker(layouts, extra):
    """The gradient norm of step 0 and the per-step losses with clipping, through train_gpt."""
    train_gpt = load_train_gpt()
    out = {}
    for tp, pp, dp in layouts:
        args = train_gpt.parse_args(SMALL_GPT + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
                                                 "--dtype", "float64", "--steps", "3",
                                                 "--clip-grad", "0.05"] + extra)
        log = train_gpt.train(args)
        out[(tp, pp, dp)] = (log["losses"], log["grad_norms"])
    return out


def _serial_clip_reference():
    """Serial gradients of step 0 clipped with torch.nn.utils.clip_grad_norm_; and the same
    through FP32Optimizer."""
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL_GPT + ["--tp", "1", "--pp", "1", "--dp", "1", "--dtype", "float64"])
    corpus = train_gpt.load_corpus(None, args.seq_len + 2)
    ps.initialize_model_parallel()
    ddp, optimizer = _build(train_gpt, args, False, clip_grad=0.05)
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=train_gpt.forward_step,
        data_iterator=iter(train_gpt.step_microbatches(corpus, 0, args)),
        model=ddp, num_microbatches=4, seq_length=args.seq_len, micro_batch_size=2, forward_only=False)
    params = list(ddp.parameters())
    reference = [p.main_grad.clone() for p in params]
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in reference]
    for h, g in zip(holders, reference):
        h.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(holders, 0.05).item()
    optimizer.prepare_grads()
    our_norm = optimizer.clip_grad_norm(0.05)
    for p, h in zip(params, holders):
        torch.testing.assert_close(p.grad, h.grad, rtol=1e-13, atol=0)  # the clipped gradients
    return torch_norm, our_norm


@pytest.mark.slow  # trains the example GPT
def test_clipping_equals_serial_clip_grad_norm():
    ((torch_norm, our_norm),) = run_distributed(1, _serial_clip_reference)
    assert torch_norm > 0.05
    assert abs(our_norm - torch_norm) <= 1e-13 * torch_norm
    (serial,) = run_distributed(1, _clip_worker, [(1, 1, 1)], [])
    (losses, norms) = serial[(1, 1, 1)]
    assert abs(norms[0] - torch_norm) <= 1e-12 * torch_norm
    layouts = [(2, 2, 1), (2, 1, 2), (1, 1, 4)]
    results = run_distributed(4, _clip_worker, layouts, ["--use-distributed-optimizer"])
    for layout, (got_losses, got_norms) in results[0].items():
        torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=1e-10, atol=0,
                                   msg=lambda m: f"{layout}: {m}")
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-9, atol=0,
                                   msg=lambda m: f"{layout}: {m}")


# --- fp16 loss scaling -------------------------------------------------------------------------------


def test_dynamic_grad_scaler_backoff_hysteresis_growth():
    scaler = DynamicGradScaler(initial_scale=2.0**10, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale.item() == 2.0**10  # hysteresis: the first overflow keeps the scale
    scaler.update(True)
    assert scaler.scale.item() == 2.0**9
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale.item() == 2.0**10
    state = scaler.state_dict()
    other = DynamicGradScaler(4.0, 1.0, 2.0, 0.5, 3, 2)
    other.load_state_dict(state)
    assert other.scale.item() == 2.0**10 and other.state_dict()["growth_tracker"] == 0
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        DynamicGradScaler(4.0, 1.0, 2.0, 1.5, 3, 2)


def _fp16_worker(distributed: bool):
    rank = dist.get_rank()
    ps.initialize_model_parallel()  # dp = world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).half()
    ddp = DistributedDataParallel(model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=distributed))
    config = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=2.0**12, hysteresis=1, clip_grad=0.0,
                             use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(config, [ddp])
    assert isinstance(optimizer, DistributedOptimizer if distributed else Float16OptimizerWithFloat16Params)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).half()
    results = []
    for poison in (True, False):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss = ddp(x).float().square().mean()
        if poison and rank == 0:  # an overflow on one rank only
            loss = loss * 1e30
        optimizer.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        scale = optimizer.get_loss_scale().item()
        ok, grad_norm, zeros = optimizer.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        results.append((ok, grad_norm, changed, scale, optimizer.get_loss_scale().item()))
    return results


@pytest.mark.parametrize("distributed", [False, True])
def test_fp16_scaler_skips_overflow_on_every_rank(distributed):
    for (skip, good) in run_distributed(2, _fp16_worker, distributed):
        assert skip[0] is False and skip[1] is None and not skip[2]  # skipped, nothing changed
        assert skip[4] == skip[3] / 2  # scale backed off
        assert good[0] is True and good[2]  # the next step updates


def _bf16_worker(extra):
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL_GPT + ["--steps", "8"] + extra)
    return train_gpt.train(args)["losses"]


@pytest.mark.slow  # trains the example GPT
def test_bf16_run_tracks_float32_run():
    (fp32,) = run_distributed(1, _bf16_worker, ["--tp", "1", "--pp", "1"])
    extra = ["--tp", "2", "--pp", "1", "--bf16", "--use-distributed-optimizer", "--sequence-parallel"]
    bf16 = run_distributed(4, _bf16_worker, extra)[0]
    fp32, bf16 = torch.tensor(fp32), torch.tensor(bf16)
    assert fp32[-1] < fp32[0] - 0.5 and bf16[-1] < bf16[0] - 0.5  # both train
    torch.testing.assert_close(bf16, fp32, rtol=3e-2, atol=0)
    assert not torch.equal(bf16, fp32)  # it did run in bf16


# --- memory -----------------------------------------------------------------------------------------


def _state_bytes(optimizer) -> int:
    """Bytes of optimizer state on this rank: the main parameters that are copies and every
    tensor of the torch optimizer's per-parameter state."""
    total = sum(s.main.nbytes for s in optimizer._slots if s.main is not s.model_param)
    for state in optimizer.optimizer.state.values():
        total += sum(t.nbytes for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def _memory_worker(dp_sizes):
    train_gpt = load_train_gpt()
    out = {}
    for dp in dp_sizes:
        args = train_gpt.parse_args(SMALL_GPT + ["--tp", "1", "--pp", "1", "--dp", str(dp), "--bf16"])
        corpus = train_gpt.load_corpus(None, args.seq_len + 2)
        ps.initialize_model_parallel()
        for distributed in (False, True):
            ddp, optimizer = _build(train_gpt, args, distributed)
            _run_step(train_gpt, args, corpus, 0, ddp, optimizer)
            numel = sum(p.numel() for p in ddp.parameters())
            out[(dp, distributed)] = (_state_bytes(optimizer), numel)
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.slow  # trains the example GPT
def test_optimizer_memory_falls_as_one_over_dp(dp):
    results = run_distributed(dp, _memory_worker, [dp])
    for out in results:
        plain, numel = out[(dp, False)]
        sharded, _ = out[(dp, True)]
        assert plain == 12 * numel  # float32 main copy + exp_avg + exp_avg_sq of bf16 parameters
        # Each rank holds about 1/dp of every bucket (parameters aligned to 64 elements, buckets padded).
        assert abs(sharded * dp / plain - 1) < 0.01, (sharded, plain)
    print(f"dp {dp}: optimizer state per rank {plain} B plain, {results[0][(dp, True)][0]} B distributed")


# --- API -------------------------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="fp16 and bf16 cannot both be True"):
        OptimizerConfig(lr=1.0, fp16=True, bf16=True)
    with pytest.raises(ValueError, match="optimizer must be 'adam' or 'sgd'"):
        OptimizerConfig(lr=1.0, optimizer="lamb")
    with pytest.raises(NotImplementedError, match="optimizer_cpu_offload"):
        OptimizerConfig(lr=1.0, optimizer_cpu_offload=True)


def _no_ddp_worker():
    ps.initialize_model_parallel()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="wrapped in megatron_ext.distributed.DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [model])
    # Without lr the groups wait for one (a scheduler sets it): step() refuses until then.
    unset = get_megatron_optimizer(OptimizerConfig(), [model])
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ValueError, match=r"parameter group\(s\) \[0, 1\] have no learning rate"):
        unset.step()
    model.zero_grad()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.5, weight_decay=0.0, clip_grad=0.0), [model])
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    ok, norm, zeros = optimizer.step()
    expected = torch.optim.Adam([torch.nn.Parameter(before.clone())], lr=0.5)
    expected.param_groups[0]["params"][0].grad = model.weight.grad.clone()
    expected.step()
    return {
        "update_successful": ok,
        "weight": model.weight.detach().tolist(),
        "plain_adam_weight": expected.param_groups[0]["params"][0].detach().tolist(),
    }


def test_plain_module_and_bad_input():
    (got,) = run_distributed(1, _no_ddp_worker)
    assert got["update_successful"] is True
    # A module without DistributedDataParallel steps as torch's Adam does.
    # float32, as the model: the values come back exactly (lists of Python floats).
    torch.testing.assert_close(torch.tensor(got["weight"]), torch.tensor(got["plain_adam_weight"]))


# --- checkpoints (the dist_checkpointing contract) -------------------------------------------------


def _ckpt_worker(directory, layouts):
    train_gpt = load_train_gpt()
    out = []
    for tp, pp, extra in layouts:
        args = train_gpt.parse_args(SMALL_GPT + ["--tp", str(tp), "--pp", str(pp), "--dtype", "float64",
                                                 "--use-distributed-optimizer", "--clip-grad", "0.05",
                                                 *extra])
        out.append(train_gpt.train(args)["losses"])
    return out


@pytest.mark.slow  # trains the example GPT
def test_distributed_optimizer_checkpoint_resumes_at_another_layout(tmp_path):
    d = str(tmp_path / "ckpt")
    # Uninterrupted 6 steps at tp 2 x dp 2; saved after 3 at that layout; resumed at pp 2 x dp 2.
    full, first, resumed = run_distributed(
        4, _ckpt_worker, d,
        [(2, 1, ["--steps", "6"]), (2, 1, ["--steps", "3", "--save", d]),
         (1, 2, ["--steps", "6", "--load", d])],
    )[0]
    torch.testing.assert_close(torch.tensor(first), torch.tensor(full[:3]), rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[3:]), rtol=1e-9, atol=0)
