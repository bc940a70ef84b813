"""overlap_param_gather: the distributed optimizer's step leaves the parameter all-gathers in flight
and each module's forward pre-hook waits for its own parameters. Checked in float64 on gloo: the
gathers are deferred (after step() the parameters outside this rank's slice still hold their old
values, and a later bucket is still in flight when an earlier layer's forward starts); training
with the overlap equals training without it (bitwise) and the plain optimizer (1e-12) at
(tp, pp, dp) = (1, 1, 4), (1, 2, 2), and (1, 2, 2) and (2, 1, 2) with the fused output layer +
cross-entropy (the tied word embedding's last-stage copy read outside the output layer's forward);
state dicts, checkpoints saved right after step() and loads over gathers in flight see the updated
values; examples/train_gpt.py --overlap-param-gather gives the same losses as without, in float64,
fp16 (dynamic loss scaling) and bf16 with sequence parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_ext.optimizer import (
    DistributedOptimizer,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from tests.conftest import SMALL_GPT, gpt_step, load_train_gpt
from tests.distributed import run_distributed


def _outside_my_slices(ddp: DistributedDataParallel) -> dict[int, torch.Tensor]:
    """Per parameter, a flat mask of the elements another data-parallel rank updates."""
    masks = {}
    for bucket in ddp.grad_buckets:
        lo, hi = ddp.shard_range(bucket)
        for p, offset in zip(bucket.params_list, bucket.offsets):
            index = torch.arange(offset, offset + p.numel())
            masks[id(p)] = (index < lo) | (index >= hi)
    return masks


# --- a small model: the mechanics ---------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 10),
                                        torch.nn.Tanh(), torch.nn.Linear(10, 3))
        self.unused = torch.nn.Linear(5, 5)  # no forward: only weight decay moves it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _small_worker(dtype: torch.dtype):
    ps.initialize_model_parallel()  # dp = 2
    rank = dist.get_rank()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)).to(dtype)

    def build(overlap: bool):
        torch.manual_seed(0)
        model = _Net().to(dtype)
        sixteen = dtype != torch.float64
        ddp = DistributedDataParallel(model, bucket_size_bytes=100, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=sixteen, overlap_grad_reduce=True, use_distributed_optimizer=True,
            overlap_param_gather=overlap))
        config = OptimizerConfig(lr=0.05, bf16=sixteen, clip_grad=0.0, use_distributed_optimizer=True,
                                 overlap_param_gather=overlap)
        return model, ddp, get_megatron_optimizer(config, [ddp])

    def train_step(ddp, optimizer):
        optimizer.zero_grad()
        loss = ddp(x).float().square().mean()
        loss.backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]
        return loss.item()

    def both():  # a step of the overlapped model, then of the reference
        out["losses"].append(train_step(ddp, opt))
        out["ref_losses"].append(train_step(ref, ref_opt))

    ref_model, ref, ref_opt = build(False)
    model, ddp, opt = build(True)
    assert isinstance(opt, DistributedOptimizer) and len(ddp.grad_buckets) > 2
    assert ddp.use_forward_hook and not ref.use_forward_hook
    # No forward pre-hook waits for the unused weight's bucket: the next step() must.
    assert sorted(ddp._bucket_of[model.unused.weight].names) == ["unused.bias", "unused.weight"]
    masks = _outside_my_slices(ddp)
    out = {"losses": [], "ref_losses": []}

    # Deferred: after step() every bucket's gather is in flight. It writes into the parameters in
    # place (they are views into the bucket's parameter buffer): inside this rank's slices the
    # update is there, outside them each value is the old one or, once the gather has landed, the
    # new one (the forward pre-hooks wait for them; below, hooks off, all are the new ones).
    before = [p.detach().clone() for p in model.parameters()]
    both()
    assert all(b.param_gather is not None for b in ddp.grad_buckets)
    assert not ref.param_gather_in_flight
    changed = updated = 0
    for p, q, old in zip(model.parameters(), ref_model.parameters(), before):
        outside = masks[id(p)]
        now, new, old = p.detach().view(-1), q.detach().view(-1), old.view(-1)
        assert torch.equal(now[~outside], new[~outside])
        assert bool(((now[outside] == old[outside]) | (now[outside] == new[outside])).all())
        changed += int((old[outside] != new[outside]).sum())
        updated += int((~outside).sum())
    assert changed > 0 and updated > 0

    # The first layer's forward waits for its own bucket only; the last layer's is still in flight.
    seen = []
    first, last = model.body[0], model.body[4]
    own = ddp._bucket_of[first.weight]
    later = ddp._bucket_of[last.weight]
    assert own is not later
    handle = first.register_forward_pre_hook(
        lambda *unused: seen.append((own.param_gather is None, later.param_gather is not None,
                                     torch.equal(first.weight, ref_model.body[0].weight))))
    both()
    handle.remove()
    assert seen == [(True, True, True)], seen

    # A state dict taken right after step() holds the updated values; so does param_state_by_name.
    sd = {k: v.clone() for k, v in ddp.state_dict().items()}  # (a state dict's tensors alias the parameters)
    ref_sd = ref.state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    assert not ddp.param_gather_in_flight
    both()
    by_name, ref_by_name = opt.param_state_by_name(), ref_opt.param_state_by_name()
    for name in ref_by_name:
        for key in ref_by_name[name]:
            assert torch.equal(by_name[name][key], ref_by_name[name][key]), (name, key)

    # A load over gathers in flight is not overwritten by them.
    assert ddp.param_gather_in_flight
    assert not all(torch.equal(p.detach(), sd[n]) for n, p in ref_model.named_parameters())
    model.load_state_dict(sd)  # (the wrapper's state dict is the module's: no "module." prefix)
    ddp(x)
    assert all(torch.equal(p.detach(), sd[n]) for n, p in model.named_parameters())
    ref.load_state_dict(sd)

    # Hooks off: param_sync gathers at once (or, with param_sync=False, leaves the gathers to
    # finish_param_sync); the forwards without hooks then read the updated values.
    both()
    ddp.disable_forward_pre_hook()
    assert not ddp.param_gather_in_flight
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    with pytest.raises(RuntimeError, match="already disabled"):
        ddp.disable_forward_pre_hook()
    both()
    assert ddp.param_gather_in_flight  # the step still only starts them
    ddp.enable_forward_pre_hook()
    with pytest.raises(RuntimeError, match="already enabled"):
        ddp.enable_forward_pre_hook()
    ddp.disable_forward_pre_hook(param_sync=False)
    assert ddp.param_gather_in_flight
    ddp.finish_param_sync()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    ddp.enable_forward_pre_hook()
    # start_param_sync() leaves what is in flight alone; force_sync finishes everything.
    both()
    works = [b.param_gather[0] for b in ddp.grad_buckets]
    ddp.start_param_sync()
    assert all(b.param_gather[0] is w for b, w in zip(ddp.grad_buckets, works))
    ddp.start_param_sync(force_sync=True)
    assert not ddp.param_gather_in_flight
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    ref.start_param_sync()  # without overlap: a synchronous re-gather, the values unchanged
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))

    # Misuse is refused clearly.
    with pytest.raises(RuntimeError, match="overlap_param_gather=True"):
        ref.enable_forward_pre_hook()
    plain = DistributedDataParallel(torch.nn.Linear(2, 2), ddp_config=DistributedDataParallelConfig())
    with pytest.raises(RuntimeError, match="use_distributed_optimizer=True"):
        plain.start_param_sync()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_small_model_gathers_are_deferred_and_exact(dtype):
    for out in run_distributed(2, _small_worker, dtype):
        assert out["losses"] == out["ref_losses"]  # bitwise


def test_config_fields():
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)
    assert ddp_config.overlap_param_gather
    config = OptimizerConfig(lr=1.0, use_distributed_optimizer=True, overlap_param_gather=True)
    assert config.overlap_param_gather
    with pytest.raises(NotImplementedError, match="overlap_param_gather_with_optimizer_step"):
        OptimizerConfig(lr=1.0, overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(NotImplementedError, match="align_param_gather"):
        DistributedDataParallelConfig(align_param_gather=True)


# --- GPT: pipeline stages, the tied embedding, checkpoints ---------------------------------------


def _gpt_build(train_gpt, args, distributed: bool, overlap: bool, fused: bool):
    model = train_gpt.build_model(args)[0]
    model.config.fused_output_cross_entropy = fused
    ddp = DistributedDataParallel(model, bucket_size_bytes=3000 if distributed else None,
                                  ddp_config=DistributedDataParallelConfig(
                                      overlap_grad_reduce=True, use_distributed_optimizer=distributed,
                                      overlap_param_gather=overlap))
    model.config.no_sync_func = ddp.no_sync
    config = OptimizerConfig(lr=args.lr, weight_decay=0.1, clip_grad=0.05,
                             use_distributed_optimizer=distributed, overlap_param_gather=overlap)
    return ddp, get_megatron_optimizer(config, [ddp])


def _gpt_step(train_gpt, args, corpus, step, ddp, optimizer):
    losses, (ok, grad_norm, _) = gpt_step(train_gpt, args, corpus, step, ddp, optimizer)
    assert ok
    return [d["lm loss"].item() for d in losses], grad_norm


def _gpt_worker(directory, layouts):
    train_gpt = load_train_gpt()
    out = {}
    for tp, pp, dp, fused in layouts:
        args = train_gpt.parse_args(SMALL_GPT + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
                                                 "--dtype", "float64"])
        train_gpt.check_args(args, dist.get_world_size())
        corpus = train_gpt.load_corpus(None, args.seq_len + 2)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        plain, plain_opt = _gpt_build(train_gpt, args, False, False, fused)
        ref, ref_opt = _gpt_build(train_gpt, args, True, False, fused)
        ddp, opt = _gpt_build(train_gpt, args, True, True, fused)
        assert isinstance(plain_opt, FP32Optimizer) and isinstance(opt, DistributedOptimizer)
        masks = _outside_my_slices(ddp)
        tied = ddp.module.shared_embedding_or_output_weight()
        r = {"worst": 0.0, "stale": 0, "first_layer_saw_later_in_flight": []}
        ckpt = f"{directory}/{tp}{pp}{dp}{int(fused)}"

        # Records, when the first module with parameters of the first transformer layer starts its
        # forward, whether its own bucket is done while the bucket gathered last is in flight.
        owner = next(m for m in ddp.module.decoder.layers[0].modules() if list(m.parameters(recurse=False)))
        own = [ddp._bucket_of[p] for p in owner.parameters(recurse=False)]
        first_forward = [True]

        def probe(*unused):
            if first_forward[0]:
                first_forward[0] = False
                # The order is learnt in the first backward (parameters read outside their owner,
                # such as the fused output layer's weight, are gathered first).
                last = ddp._param_gather_order()[-1]
                assert all(b is not last for b in own)
                r["first_layer_saw_later_in_flight"].append(
                    (all(b.param_gather is None for b in own), last.param_gather is not None))

        owner.register_forward_pre_hook(probe)  # after the wrapper's hook
        snapshot = None
        for step in range(4):
            first_forward[0] = True
            before = [p.detach().clone() for p in ref.parameters()]  # what the last step gathered
            a = _gpt_step(train_gpt, args, corpus, step, plain, plain_opt)
            b = _gpt_step(train_gpt, args, corpus, step, ref, ref_opt)
            c = _gpt_step(train_gpt, args, corpus, step, ddp, opt)
            assert c == b, (step, b, c)  # losses and gradient norm: bitwise equal without overlap
            r["worst"] = max(r["worst"], max((abs(x - y) / abs(x) for x, y in zip(a[0], c[0])), default=0.0),
                             abs(a[1] - c[1]) / a[1])
            # Deferred: the gathers are in flight. They write in place, so outside this rank's
            # slices a parameter holds its old value or, where its gather has landed, the new one.
            assert ddp.param_gather_in_flight
            for p, q, old in zip(ddp.parameters(), ref.parameters(), before):
                outside = masks[id(p)]
                now, new = p.detach().view(-1)[outside], q.detach().view(-1)[outside]
                old = old.view(-1)[outside]
                assert bool(((now == old) | (now == new)).all())
                r["stale"] += int((old != new).sum())  # values only the gathers bring
            if step == 1:
                # Saved right after step(): the checkpoint holds the updated parameters.
                save_checkpoint(ckpt, 2, ddp, opt)
                assert not ddp.param_gather_in_flight
                snapshot = [p.detach().clone() for p in ref.parameters()]
            if step == 2 and tied is not None:
                # The tied embedding's bucket (its own) is in flight like the others; the forward waits.
                assert ddp._bucket_of[tied].param_gather is not None
        ddp.disable_forward_pre_hook()  # e.g. for an evaluation: gathers now
        for (name, p), q, s in zip(plain.named_parameters(), ddp.parameters(), ref.parameters()):
            assert torch.equal(q, s), name
            r["worst"] = max(r["worst"], ((p - q).abs().max() / p.abs().max().clamp_min(1e-30)).item())
        ddp.enable_forward_pre_hook()

        # The checkpoint saved with gathers in flight loads the step-2 values.
        fresh, _ = _gpt_build(train_gpt, args, True, False, fused)
        load_checkpoint(ckpt, fresh, None)
        assert all(torch.equal(p, s) for p, s in zip(fresh.parameters(), snapshot))
        out[(tp, pp, dp, fused)] = r
        ps.destroy_model_parallel()
    return out


@pytest.mark.slow  # trains the example GPT
def test_gpt_overlap_equals_no_overlap_and_plain(tmp_path):
    layouts = [(1, 1, 4, False), (1, 2, 2, False), (1, 2, 2, True), (2, 1, 2, True)]
    results = run_distributed(4, _gpt_worker, str(tmp_path), layouts, timeout=600)
    for out in results:
        for layout, r in out.items():
            assert r["worst"] < 1e-12, (layout, r["worst"])
            assert r["stale"] > 0, layout  # the gathers had values to bring after step()
            # The first forward after a step found the first layer's bucket done and the last one
            # in flight (step 0 follows no step, step 2 follows the save, which gathered).
            saw = r["first_layer_saw_later_in_flight"]
            assert saw == [(True, False), (True, True), (True, False), (True, True)], (layout, saw)


# --- examples/train_gpt.py --overlap-param-gather -------------------------------------------------


def _train_gpt_worker(layout, extra):
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(
        SMALL_GPT + layout + ["--use-distributed-optimizer", "--grad-bucket-bytes", "3000"] + extra
    )
    out = train_gpt.train(args)
    return out["losses"], out["skipped_steps"]


@pytest.mark.parametrize("layout", [
    ["--tp", "1", "--pp", "2", "--virtual-pipeline", "2", "--dtype", "float64", "--steps", "3"],
    # fp16 with dynamic loss scaling (the first steps overflow and are skipped: no gathers; the
    # later ones update) and bf16 with sequence parallelism: the 16-bit parameters are gathered in
    # flight while the fp32 main parameters stay sharded.
    ["--tp", "1", "--pp", "2", "--fp16", "--steps", "24"],
    ["--tp", "2", "--pp", "1", "--bf16", "--sequence-parallel", "--steps", "3"],
], ids=["float64-interleaved", "fp16", "bf16-sequence-parallel"])
@pytest.mark.slow  # trains the example GPT
def test_train_gpt_overlap_param_gather_flag(tmp_path, layout):
    without, skipped = run_distributed(4, _train_gpt_worker, layout, [])[0]
    extra = ["--overlap-param-gather", "--save", str(tmp_path)]  # the save follows a step: gathers in flight
    with_overlap = run_distributed(4, _train_gpt_worker, layout, extra)[0]
    assert with_overlap == (without, skipped)  # bitwise, and the same steps skipped
    assert skipped < len(without) - 2, skipped  # some steps did update (and gather)


def test_train_gpt_overlap_param_gather_needs_distributed_optimizer():
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL_GPT + ["--tp", "1", "--pp", "1", "--overlap-param-gather"])
    with pytest.raises(ValueError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        train_gpt.check_args(args, 1)
