"""Megatron-core's checkpointing API for optimizers and the DDP wrapper: a GPT trained at tp 2 x dp 2
(or tp 2 x pp 2) whose model and optimizer ``sharded_state_dict`` are saved with
``dist_checkpointing.save`` and loaded at another layout (tp 4 x dp 1, tp 1 x dp 4) continues
exactly as the run that never stopped (float64: losses and parameters to 1e-12), with the plain
(Llama-style model: strided SwiGLU factories) and the distributed optimizer; an fp16 optimizer's
state (main copies, Adam moments, step, loss scaler) saved again after such a load is the state it
was loaded from; unsupported sharding types are refused on every rank."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext import dist_checkpointing as dc
from megatron_ext import parallel_state as ps
from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_ext.optimizer import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from tests.conftest import SMALL_GPT, Comparisons, _plain, assert_comparisons, gpt_step, load_train_gpt
from tests.distributed import run_distributed

SAVED_AFTER, MORE = 2, 2  # steps before the checkpoint, steps after it


def _layout(train_gpt, tp: int, dp: int, extra: list[str], pp: int = 1):
    args = train_gpt.parse_args(SMALL_GPT + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp)] + extra)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return args, train_gpt.load_corpus(None, args.seq_len + 2)


def _step(train_gpt, args, corpus, step: int, ddp, optimizer) -> float | None:
    """One training step; the global batch's mean loss (on the last pipeline stage, else None)."""
    losses, _ = gpt_step(train_gpt, args, corpus, step, ddp, optimizer)
    if not ps.is_pipeline_last_stage():
        return None
    loss = torch.stack([d["lm loss"] for d in losses]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / args.dp


def _model(train_gpt, args, distributed: bool, seed: int | None = None):
    """A DDP-wrapped GPT (initialised from ``seed``, default ``args.seed``) and its Adam at the
    current layout; with the distributed optimizer, small buckets (parameters straddle the
    data-parallel slices); fp16: a loss scale that changes within a few steps."""
    model_args = argparse.Namespace(**{**vars(args), "seed": args.seed if seed is None else seed})
    ddp = DistributedDataParallel(
        train_gpt.build_model(model_args)[0],
        bucket_size_bytes=3000 if distributed else None,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.fp16, overlap_grad_reduce=True, use_distributed_optimizer=distributed
        ),
    )
    config = OptimizerConfig(lr=args.lr, weight_decay=0.1, fp16=args.fp16, initial_loss_scale=2.0**8,
                             loss_scale_window=2, hysteresis=1, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(config, [ddp])
    ddp.module.config.no_sync_func = ddp.no_sync
    ddp.module.config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer


def _save(path: str, ddp, optimizer, metadata=None) -> None:
    model_sd = ddp.sharded_state_dict()
    dc.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}, path)


def _load(path: str, ddp, optimizer, metadata=None) -> None:
    model_sd = ddp.sharded_state_dict()
    request = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                             metadata=metadata)}
    loaded = dc.load(request, path)
    ddp.load_state_dict({k[len("module."):]: v for k, v in loaded["model"].items()})
    optimizer.load_state_dict(loaded["optimizer"])


def _resume_worker(path: str, arch: str, distributed: bool, saved_at: tuple, resume_at: tuple[int, int]):
    """Trains SAVED_AFTER steps at ``saved_at`` (tp, pp, dp), saves, loads at ``resume_at``
    (tp, dp) into a model of another seed and trains MORE steps; also the run that never stopped,
    at ``resume_at``. Records the comparisons of both runs' losses and final parameters (this
    rank's, at the same layout)."""
    train_gpt = load_train_gpt()
    extra = ["--dtype", "float64", "--arch", arch] + (["--use-distributed-optimizer"] if distributed else [])
    tp, pp, dp = saved_at
    args, corpus = _layout(train_gpt, tp, dp, extra, pp=pp)
    ddp, optimizer = _model(train_gpt, args, distributed)
    assert isinstance(optimizer, DistributedOptimizer if distributed else FP32Optimizer)
    for s in range(SAVED_AFTER):
        _step(train_gpt, args, corpus, s, ddp, optimizer)
    _save(path, ddp, optimizer)
    sd = optimizer.sharded_state_dict(ddp.sharded_state_dict())
    if distributed:
        kinds = (sd["param_state_sharding_type"], sorted(sd["param_state"][0]))
        keys = sorted(v["fp32_param"].key for v in sd["param_state"].values())
    else:
        kinds = (sorted(sd["state"][0]), int(sd["state"]["common_step"]))
        keys = sorted(v["exp_avg"].key for k, v in sd["state"].items() if k != "common_step")

    tp, dp = resume_at
    args, corpus = _layout(train_gpt, tp, dp, extra)
    ddp, optimizer = _model(train_gpt, args, distributed, seed=99)
    _load(path, ddp, optimizer)
    after = range(SAVED_AFTER, SAVED_AFTER + MORE)
    resumed = [_step(train_gpt, args, corpus, s, ddp, optimizer) for s in after]
    resumed_params = {k: v.clone() for k, v in ddp.state_dict().items()}

    args, corpus = _layout(train_gpt, tp, dp, extra)
    ddp, optimizer = _model(train_gpt, args, distributed)
    reference = [_step(train_gpt, args, corpus, s, ddp, optimizer) for s in range(SAVED_AFTER + MORE)]
    made = Comparisons()
    made.close(torch.tensor(resumed, dtype=torch.float64),
               torch.tensor(reference[SAVED_AFTER:], dtype=torch.float64), "losses", rtol=1e-12, atol=0)
    reference_params = ddp.state_dict()
    assert resumed_params.keys() == reference_params.keys()
    for name, value in reference_params.items():
        made.close(resumed_params[name], value, name, rtol=1e-12, atol=1e-12)
    return {"made": made.made, "kinds": kinds, "keys": keys}


DIST_KEYS = ["exp_avg", "exp_avg_sq", "fp32_param"]


@pytest.mark.slow  # trains the example GPT three times (18-77 s on the 2 shared cores)
@pytest.mark.parametrize(
    "arch,distributed,saved_at,resume_at,kinds,key",
    [
        # Llama: the SwiGLU [gate | up] weight's state is a factory of tp-strided pieces.
        ("llama", False, (2, 1, 2), (4, 1), (["exp_avg", "exp_avg_sq"], SAVED_AFTER),
         "optimizer.state.exp_avg.module.decoder.layers.mlp.linear_fc1.weight"),
        ("gpt", True, (2, 1, 2), (1, 4), ("fully_sharded_model_space", DIST_KEYS),
         "optimizer.state.fp32_param.module.embedding.word_embeddings.weight"),
        # Two pipeline stages (the last one's tied output weight a replica of the embedding) to one.
        ("gpt", True, (2, 2, 1), (1, 4), ("fully_sharded_model_space", DIST_KEYS),
         "optimizer.state.fp32_param.module.decoder.layers.self_attention.linear_qkv.weight"),
    ],
)
def test_resume_at_another_layout_equals_uninterrupted(
    tmp_path, arch, distributed, saved_at, resume_at, kinds, key
):
    results = run_distributed(4, _resume_worker, str(tmp_path / "ckpt"), arch, distributed, saved_at,
                              resume_at, timeout=600)
    assert all(key in out["keys"] for out in results)
    for out in results:
        assert out["kinds"] == kinds
        assert_comparisons(out["made"])


def _fp16_and_refusals_worker(path: str) -> dict:
    """An fp16 optimizer (dynamic loss scale) trained at tp 2 x dp 2 and saved, loaded at tp 1 x
    dp 4 and saved again: both checkpoints' tensors (rank 0 returns them) and loss scalers. Then
    the distributed optimizer's refusals of unsupported sharding types, on every rank."""
    train_gpt = load_train_gpt()
    args, corpus = _layout(train_gpt, 2, 2, ["--fp16"])
    ddp, optimizer = _model(train_gpt, args, False)
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    for s in range(3):
        _step(train_gpt, args, corpus, s, ddp, optimizer)
    first, second = os.path.join(path, "first"), os.path.join(path, "second")
    _save(first, ddp, optimizer)
    scalers = [_plain_tree(optimizer.grad_scaler.state_dict())]
    args, corpus = _layout(train_gpt, 1, 4, ["--fp16"])
    ddp, optimizer = _model(train_gpt, args, False, seed=99)
    _load(first, ddp, optimizer)
    _save(second, ddp, optimizer)
    scalers.append(_plain_tree(optimizer.grad_scaler.state_dict()))
    steps = optimizer.state_dict()["step"]

    args, corpus = _layout(train_gpt, 2, 2, ["--dtype", "float64", "--use-distributed-optimizer"])
    ddp, optimizer = _model(train_gpt, args, True)
    model_sd = ddp.sharded_state_dict()
    refusals = []
    for kwargs in ({"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}},
                   {"sharding_type": "fsdp_dtensor"}):
        with pytest.raises(ValueError) as e:
            optimizer.sharded_state_dict(model_sd, **kwargs)
        refusals.append(str(e.value))
    with pytest.raises(ValueError) as e:
        optimizer.load_state_dict({"param_state": {}, "param_state_sharding_type": "dp_zero_gather_scatter"})
    refusals.append(str(e.value))
    with pytest.raises(ValueError) as e:  # a model sharded state dict lacking parameters
        optimizer.sharded_state_dict({k: v for k, v in model_sd.items() if "bias" not in k})
    refusals.append(str(e.value))
    out = {"scalers": scalers, "steps": steps, "refusals": refusals}
    out["first"], out["second"] = (_plain_tree(dc.load_plain_tensors(p)) for p in (first, second))
    return out


def _plain_tree(x):
    """Nested dicts and lists with each tensor as plain values (exact: ``conftest._plain``), to
    leave the worker and be compared with ``==``."""
    if isinstance(x, dict):
        return {k: _plain_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain_tree(v) for v in x]
    return _plain(x)


@pytest.mark.slow  # fp16 training of the example GPT (22-43 s)
def test_fp16_state_round_trips_and_refusals(tmp_path):
    results = run_distributed(4, _fp16_and_refusals_worker, str(tmp_path), timeout=600)
    first = results[0]["first"]
    assert any(k.startswith("optimizer.state.fp32_param.module.") for k in first)
    assert any(k.startswith("optimizer.state.exp_avg_sq.module.") for k in first)
    for out in results:
        assert out["first"] == out["second"] == first  # every tensor, bit for bit, and the common state
        saved, loaded = out["scalers"]
        assert saved == loaded and saved["scale"] != _plain(torch.tensor([2.0**8]))  # it moved
        assert out["steps"] >= 1
        bad_type, bad_kwarg, bad_load, not_params = out["refusals"]
        assert "'dp_reshardable' is not supported" in bad_type and "fully_sharded_model_space" in bad_type
        assert "'fsdp_dtensor' is not supported" in bad_kwarg
        assert "'dp_zero_gather_scatter' is not supported" in bad_load
        assert "is not in the model's sharded state dict" in not_params


@pytest.mark.parametrize("package", ["megatron_ext", "megatron.core"])
def test_plain_and_chained_state_round_trip(package):
    """Adam over a Linear, and a ChainedOptimizer of two, keyed by the ShardedTensors of
    ``package`` (Megatron-core's own classes: its model code over megatron_ext's optimizers): the
    entries come back of that package's classes (chained ones prefixed ``chained_<i>.``), and
    what they load into fresh optimizers is the state."""
    if package == "megatron.core":
        mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
    else:
        from megatron_ext.dist_checkpointing import mapping
    from megatron_ext.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
    from megatron_ext.optimizer import ChainedOptimizer

    def adam_over(nets):
        optimizers = [get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=0.0), [n]) for n in nets]
        model_sd = {
            f"{i}.{n}": mapping.ShardedTensor.from_rank_offsets(f"{i}.{n}", p)
            for i, net in enumerate(nets)
            for n, p in net.named_parameters()
        }
        return (optimizers[0] if len(nets) == 1 else ChainedOptimizer(optimizers)), model_sd

    def as_loaded(x):  # what dist_checkpointing.load gives for each leaf
        if isinstance(x, mapping.ShardedTensor):
            return x.data.clone()
        return x.unwrap() if isinstance(x, mapping.LocalNonpersistentObject) else x

    def linears(seed):
        torch.manual_seed(seed)
        return [torch.nn.Linear(3, 2, dtype=torch.float64) for _ in range(2)]

    for count in (1, 2):
        nets = linears(0)[:count]
        optimizer, model_sd = adam_over(nets)
        for _ in range(2):
            for net in nets:
                net(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()
            for o in getattr(optimizer, "chained_optimizers", [optimizer]):  # (no groups for a global norm)
                o.step()
            optimizer.zero_grad()
        sd = optimizer.sharded_state_dict(model_sd)
        tensors = [v for v in nested_values(sd) if isinstance(v, mapping.ShardedTensor)]
        assert len(tensors) == 4 * count  # exp_avg and exp_avg_sq of a weight and a bias each
        prefix = "" if count == 1 else "chained_1."
        assert f"{prefix}optimizer.state.exp_avg.{count - 1}.weight" in {t.key for t in tensors}
        first = sd if count == 1 else sd[0]
        assert type(first["param_groups"][0]["params"]) is mapping.LocalNonpersistentObject
        assert int(first["state"]["common_step"]) == 2

        fresh, fresh_model_sd = adam_over(linears(1)[:count])
        fresh.sharded_state_dict(fresh_model_sd, is_loading=True)
        fresh.load_state_dict(dict_list_map_outplace(as_loaded, sd))
        parts = [getattr(o, "chained_optimizers", [o]) for o in (optimizer, fresh)]
        for a, b in zip(*parts, strict=True):
            saved, loaded = a.param_state_by_name(), b.param_state_by_name()
            assert saved.keys() == loaded.keys() == {"weight", "bias"}
            for name in saved:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(loaded[name][key], saved[name][key]), (count, name, key)
            assert b.state_dict()["step"] == 2
