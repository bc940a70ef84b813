"""The step report (megatron_ext.training.report) at tp 2 x dp 2, pp 2 x dp 2 with virtual stages and
a tied embedding, ep 2 x dp 4 and tp 2 x ep 2 x etp 2 with experts: the model's parameter count
against the serial model built in the same processes, each rank's count, and each rank's state bytes
against the bytes per parameter of the precision and optimizer (the layer sizes leave the distributed
optimizer's buffers without padding, which the test checks first); and FullyShardedDataParallel at dp 4
under each sharding strategy, in bf16 with float32 gradients and in float64: the state a rank holds
between steps (the shards of what is sharded) and the bound on what a step gathers on top."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import run_distributed

HIDDEN, HEADS, FFN, VOCAB, SEQ = 128, 4, 256, 256, 64


def _config(dtype: torch.dtype, **kwargs):
    from megatron_ext.transformer import TransformerConfig

    settings = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                    hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
                    bf16=dtype == torch.bfloat16, use_cpu_initialization=True)
    settings.update(kwargs)
    return TransformerConfig(**settings)


def _models(config, vpp: int | None = None) -> list:
    from megatron_ext import tensor_parallel
    from megatron_ext.models import GPTModel

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    stages = [None] if vpp is None else range(vpp)
    return [GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=3, vp_stage=s)
            for s in stages]


def _serial_numel(dtype: torch.dtype, **kwargs) -> int:
    """The parameters of the model built at tp 1 x pp 1 x ep 1 (each tensor once)."""
    from megatron_ext import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    (model,) = _models(_config(dtype, **kwargs))
    return sum(p.numel() for p in model.parameters())


def _wrapped(models: list, dtype: torch.dtype, distributed: bool):
    from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer

    sixteen = dtype != torch.float32
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=sixteen, overlap_grad_reduce=True,
                                               use_distributed_optimizer=distributed)
    chunks = [DistributedDataParallel(m, ddp_config=ddp_config) for m in models]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=distributed), chunks)
    if distributed:  # the test's byte counts assume no padding in the buffers
        for chunk in chunks:
            for buffer in chunk.buffers:
                assert buffer.numel == sum(p.numel() for p in buffer.params), buffer.numel
    return chunks, optimizer


def _fsdp(models: list, dtype: torch.dtype, strategy: str, reshard_after_forward: bool = True):
    from megatron_ext.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype == torch.bfloat16, use_distributed_optimizer=True, use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy)
    chunks = [FullyShardedDataParallel(m.config, ddp_config, m, reshard_after_forward=reshard_after_forward)
              for m in models]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=1e-3, bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True), chunks)
    for chunk in chunks:  # the test's byte counts assume no padding in the buffers
        for buffer in chunk.buffers:
            assert buffer.numel == sum(p.numel() for p in buffer.params), buffer.numel
    return chunks, optimizer


def _all(value: int) -> list[int]:
    out = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(value))
    return [int(v) for v in out]


def _worker() -> dict:
    from megatron_ext import parallel_state as ps
    from megatron_ext.training.report import collect_step_report

    out = {}
    bf16, fp32 = torch.bfloat16, torch.float32
    batch = dict(global_batch_size=8, seq_length=SEQ)

    # tp 2 x dp 2: the LayerNorm weights and the row-parallel biases are tensor-parallel duplicates
    serial = _serial_numel(bf16)
    for dtype, distributed in ((bf16, True), (fp32, False)):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        config = _config(dtype, tensor_model_parallel_size=2)
        chunks, optimizer = _wrapped(_models(config), dtype, distributed)
        local = sum(p.numel() for c in chunks for p in c.parameters())
        report = collect_step_report(chunks, optimizer, tp=2, pp=1, cp=1, ep=1, etp=None, dp=2, vpp=None,
                                     **batch)
        out[("tp2", dtype, distributed)] = (report, serial, _all(local))
        if not distributed:  # after a step the moments exist: measured, the bytes projected before
            optimizer.step()  # zero gradients, in the gradient buffers
            out[("tp2 stepped", dtype, distributed)] = collect_step_report(
                chunks, optimizer, tp=2, pp=1, cp=1, ep=1, etp=None, dp=2, vpp=None, **batch)

    # pp 2 x dp 2 with two virtual stages of one layer each; the last stage's copy of the tied
    # embedding is counted once
    serial = _serial_numel(fp32, num_layers=4)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = _config(fp32, num_layers=4, pipeline_model_parallel_size=2,
                     virtual_pipeline_model_parallel_size=2)
    chunks, optimizer = _wrapped(_models(config, vpp=2), fp32, True)
    local = sum(p.numel() for c in chunks for p in c.parameters())
    report = collect_step_report(chunks, optimizer, tp=1, pp=2, cp=1, ep=1, etp=None, dp=2, vpp=2, **batch)
    out[("pp2", fp32, True)] = (report, serial, _all(local))

    # ep 2 x dp 4: expert state over the expert-data-parallel group (2 ranks), the rest over dp 4
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=FFN, add_bias_linear=False,
               moe_aux_loss_coeff=0.0)
    serial = _serial_numel(fp32, **moe)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    chunks, optimizer = _wrapped(_models(_config(fp32, expert_model_parallel_size=2, **moe)), fp32, True)
    params = [p for c in chunks for p in c.parameters()]
    experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    report = collect_step_report(chunks, optimizer, tp=1, pp=1, cp=1, ep=2, etp=1, dp=4, vpp=None, **batch)
    out[("ep2", fp32, True)] = (report, serial, _all(sum(p.numel() for p in params)), _all(experts))

    # tp 2 x dp 2 with ep 2 and the expert tensor parallelism of the tensor size (etp 2): the expert
    # data-parallel group is one rank, the router a tensor-parallel duplicate
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    config = _config(fp32, tensor_model_parallel_size=2, expert_model_parallel_size=2, **moe)
    chunks, optimizer = _wrapped(_models(config), fp32, True)
    params = [p for c in chunks for p in c.parameters()]
    experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    report = collect_step_report(chunks, optimizer, tp=2, pp=1, cp=1, ep=2, etp=2, dp=2, vpp=None, **batch)
    out[("ep2 etp2", fp32, True)] = (report, serial, _all(sum(p.numel() for p in params)), _all(experts))

    # FSDP at dp 4: (the report, the parameters of one transformer layer (a unit), of the root)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    for dtype, strategy, reshard in [(d, s, True) for d in (bf16, torch.float64)
                                     for s in ("optim", "optim_grads", "optim_grads_params")] + [
                                         (bf16, "optim_grads_params", False)]:
        (model,) = models = _models(_config(dtype))
        chunks, optimizer = _fsdp(models, dtype, strategy, reshard)
        layer = sum(p.numel() for p in model.decoder.layers[0].parameters())
        assert all(sum(p.numel() for p in m.parameters()) == layer for m in model.decoder.layers)
        root = sum(p.numel() for p in model.parameters()) - len(model.decoder.layers) * layer
        report = collect_step_report(chunks, optimizer, tp=1, pp=1, cp=1, ep=1, etp=None, dp=4, vpp=None,
                                     **batch)
        out[("fsdp", dtype, strategy, reshard)] = (report, layer, root)
    return out


def test_step_report_counts_parameters_once_and_measures_state():
    results = run_distributed(4, _worker)
    out = results[0]
    assert all(str(r[k][0]) == str(out[k][0]) for r in results for k in out if k[0] != "tp2 stepped")
    _check_fsdp({k: v for k, v in out.items() if k[0] == "fsdp"})
    out = {k: v for k, v in out.items() if k[0] != "fsdp"}
    for key, (report, serial, local, *expert) in ((k, v) for k, v in out.items() if k[0] != "tp2 stepped"):
        assert report.model_parameters == serial, key
        assert [r.parameters for r in report.ranks] == local, key
    # bf16 parameters, float32 gradient buffers, the distributed optimizer at dp 2: 2 + 4 + (4 + 8) / 2
    report, _, local = out[("tp2", torch.bfloat16, True)]
    assert [(r.parameter_bytes, r.gradient_bytes, r.main_bytes, r.moment_bytes) for r in report.ranks] == [
        (2 * n, 4 * n, 4 * n // 2, 8 * n // 2) for n in local
    ]
    assert [r.state_bytes for r in report.ranks] == [12 * n for n in local]
    assert not any(r.moments_measured for r in report.ranks)
    # float32, the plain optimizer: 4 + 4 + 8, the main parameters being the model's
    report, _, local = out[("tp2", torch.float32, False)]
    assert [(r.parameter_bytes, r.gradient_bytes, r.main_bytes, r.moment_bytes) for r in report.ranks] == [
        (4 * n, 4 * n, 0, 8 * n) for n in local
    ]
    stepped = out[("tp2 stepped", torch.float32, False)]
    assert [r.state_bytes for r in stepped.ranks] == [16 * n for n in local]
    assert all(r.moments_measured for r in stepped.ranks)
    # float32 with the distributed optimizer at dp 2: 4 + 4 + 8 / 2 (the main parameters are views)
    report, _, local = out[("pp2", torch.float32, True)]
    assert [(r.parameter_bytes, r.gradient_bytes, r.main_bytes, r.moment_bytes) for r in report.ranks] == [
        (4 * n, 4 * n, 0, 8 * n // 2) for n in local
    ]
    # experts: 4 + 4 + 8 / 2; the rest: 4 + 4 + 8 / 4
    report, _, local, experts = out[("ep2", torch.float32, True)]
    assert [r.state_bytes for r in report.ranks] == [
        8 * n + 8 * e // 2 + 8 * (n - e) // 4 for n, e in zip(local, experts)
    ]
    report, _, local, experts = out[("ep2 etp2", torch.float32, True)]
    assert [r.state_bytes for r in report.ranks] == [
        8 * n + 8 * e + 8 * (n - e) // 2 for n, e in zip(local, experts)
    ]
    assert report.tokens_per_step == 8 * SEQ
    text = str(out[("tp2", torch.bfloat16, True)][0]).splitlines()
    n = out[("tp2", torch.bfloat16, True)][1]
    assert text[0] == "step report (world 4): tp 2, pp 1, cp 1, ep 1, etp none, dp 2, vpp none"
    per_rank = out[("tp2", torch.bfloat16, True)][2][0]
    assert text[1] == (f"parameters: {n:,} in the model (each counted once); "
                       f"per rank {per_rank:,} to {per_rank:,}")
    assert text[-1] == f"tokens per step: 8 x {SEQ} = {8 * SEQ:,}"
    assert text[3].endswith("(to be allocated by the optimizer's first step)")


def _check_fsdp(out: dict) -> None:
    """Per rank at dp 4 (no padding): the parameters, gradient buffers, main parameters and moments
    between steps, and the bytes gathered in flight: the root's parameters and full gradients, up
    to three units' parameters (the one computing, the next one prefetched and the last; every unit
    without resharding after the forward) and one unit's full gradients."""
    dp = 4
    for (_, dtype, strategy, reshard), (report, layer, root) in out.items():
        n = 2 * layer + root
        p, g = (2, 4) if dtype == torch.bfloat16 else (8, 8)  # bytes of a parameter, of a gradient
        main = 4 if dtype == torch.bfloat16 else 0  # float32 copies of 16-bit parameters only
        params = p * n // dp if strategy == "optim_grads_params" else p * n
        grads = g * n if strategy == "optim" else g * n // dp
        moments = 2 * max(main, p) * n // dp
        gathered = root + 2 * layer if reshard else n  # at most three units: both here
        in_flight = {"optim": 0, "optim_grads": g * (root + layer),
                     "optim_grads_params": p * gathered + g * (root + layer)}
        key = (dtype, strategy, reshard)
        state = [(r.parameter_bytes, r.gradient_bytes, r.main_bytes, r.moment_bytes) for r in report.ranks]
        assert state == [(params, grads, main * n // dp, moments)] * dp, (key, state)
        assert [r.in_flight_bytes for r in report.ranks] == [in_flight[strategy]] * dp, key
        lines = [line for line in str(report).splitlines() if line.startswith("gathered in flight")]
        if strategy == "optim":
            assert lines == [], key
        else:
            assert lines[0].startswith(f"gathered in flight: up to {in_flight[strategy]:,} B "), (key, lines)
    # per parameter with bf16 parameters, float32 gradients and Adam: 2 + 4 + 12 / dp, 2 + 16 / dp, 18 / dp
    layer, root = out[("fsdp", torch.bfloat16, "optim", True)][1:]
    n = 2 * layer + root
    strategies = ("optim", "optim_grads", "optim_grads_params")
    assert [out[("fsdp", torch.bfloat16, s, True)][0].ranks[0].state_bytes for s in strategies] == [
        (6 + 12 // dp) * n, 2 * n + 16 * n // dp, 18 * n // dp]
