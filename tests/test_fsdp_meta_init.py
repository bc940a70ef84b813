"""A model built on the meta device (``init_model_with_meta_device``) and drawn by
FullyShardedDataParallel unit by unit: every shard equals the shard of the same model built
directly (tensor, pipeline with the tied embedding, interleaved, expert parallelism), no rank holds
more than a unit or two beyond its shards while wrapping, and what cannot be drawn is refused."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
)
from megatron_ext.models.gpt import GPTModel
from megatron_ext.tensor_parallel.meta_init import materialize
from megatron_ext.transformer import TransformerConfig
from tests.distributed import run_distributed

LAYOUTS = {  # (tp, pp, vp, ep) at world 4, dp = 4 / (tp * pp)
    "tp2 sp": (2, 1, None, 1),
    "pp2 tied": (2, 2, None, 1),
    "pp2 interleaved": (1, 2, 2, 1),
    "ep2 etp2": (1, 1, None, 2),
}
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_grouped_gemm=True,
    moe_router_enable_expert_bias=True,
    moe_router_score_function="sigmoid",
)


def _config(tp: int, pp: int, vp, ep: int, meta: bool, layers: int = 4) -> TransformerConfig:
    return TransformerConfig(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=tp > 1,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=2 if ep > 1 else None,
        pipeline_dtype=torch.float64,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        init_model_with_meta_device=meta,
        **(MOE if ep > 1 else {}),
    )


def _chunks(config: TransformerConfig) -> list[GPTModel]:
    stages = (
        [None]
        if config.virtual_pipeline_model_parallel_size is None
        else range(config.virtual_pipeline_model_parallel_size)
    )
    return [GPTModel(config, vocab_size=64, max_sequence_length=16, init_seed=7, vp_stage=v) for v in stages]


def _shards(wrappers: list[FullyShardedDataParallel]) -> list[torch.Tensor]:
    return [
        w.param_shard(bucket).clone() for w in wrappers for buffer in w.buffers for bucket in buffer.buckets
    ]


def _same_shards_worker() -> dict:
    out = {}
    for name, (tp, pp, vp, ep) in LAYOUTS.items():
        ps.initialize_model_parallel(
            tp,
            pp,
            virtual_pipeline_model_parallel_size=vp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=2 if ep > 1 else None,
        )
        for strategy in ("optim", "optim_grads", "optim_grads_params"):
            ddp = DistributedDataParallelConfig(
                use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy
            )
            direct = [
                FullyShardedDataParallel(c.config, ddp, c) for c in _chunks(_config(tp, pp, vp, ep, False))
            ]
            meta_chunks = _chunks(_config(tp, pp, vp, ep, True))
            on_meta = sum(p.is_meta for c in meta_chunks for p in c.parameters())
            drawn = [FullyShardedDataParallel(c.config, ddp, c) for c in meta_chunks]
            left = sum(t.is_meta for w in drawn for t in [*w.module.parameters(), *w.module.buffers()])
            a, b = _shards(direct), _shards(drawn)
            out[(name, strategy)] = (
                on_meta,
                left,
                len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)),
                len(a),
            )
            # Attributes set on the meta parameters (tensor-parallel split, the tied copy) are kept.
            attrs = [
                (
                    getattr(p, "tensor_model_parallel", False),
                    getattr(p, "shared_embedding", False),
                    getattr(p, "allreduce", True),
                )
                for w in direct
                for p in w.module.parameters()
            ]
            attrs_meta = [
                (
                    getattr(p, "tensor_model_parallel", False),
                    getattr(p, "shared_embedding", False),
                    getattr(p, "allreduce", True),
                )
                for w in drawn
                for p in w.module.parameters()
            ]
            assert attrs == attrs_meta, (name, strategy)
        ps.destroy_model_parallel()
    return out


def test_drawn_unit_by_unit_equals_built_directly():
    """Every bucket's shard of the meta-built model equals the directly built one's, exactly, at every
    layout and sharding strategy; nothing is left on the meta device."""
    for out in run_distributed(4, _same_shards_worker, timeout=600):
        assert set(out) == {(n, s) for n in LAYOUTS for s in ("optim", "optim_grads", "optim_grads_params")}
        for key, (on_meta, left, equal, buckets) in out.items():
            assert on_meta > 0 and left == 0 and buckets > 0, (key, on_meta, left, buckets)
            assert equal, key


def _peak_worker() -> tuple[int, int, int, int]:
    """The bytes alive while a meta-built model of 8 layers is wrapped under optim_grads_params
    (sampled as each unit's buffer is made), the shards it ends with, the largest unit's padded
    buffer, and the bytes of the model built directly."""
    from benchmarks.common import live_cpu_storages
    from megatron_ext.distributed import param_and_grad_buffer as buffers

    ps.initialize_model_parallel()
    ddp = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    base = sum(live_cpu_storages().values())
    (chunk,) = _chunks(_config(1, 1, None, 1, True, layers=8))
    built = sum(live_cpu_storages().values()) - base  # rotary tables only: no parameter has storage
    samples = []
    original = buffers._ParamAndGradBuffer.__init__

    def sampled(self, *args, **kwargs):
        original(self, *args, **kwargs)
        samples.append(sum(live_cpu_storages().values()) - base)

    buffers._ParamAndGradBuffer.__init__ = sampled
    try:
        fsdp = FullyShardedDataParallel(chunk.config, ddp, chunk)
    finally:
        buffers._ParamAndGradBuffer.__init__ = original
    largest = max(sum(b.padded_numel for b in u.buckets) for u in fsdp._units) * 8
    shards = (
        sum(b.param_shard.numel() + b.grad_shard.numel() for buf in fsdp.buffers for b in buf.buckets) * 8
    )
    whole = (
        sum(
            p.numel()
            for p in GPTModel(
                _config(1, 1, None, 1, False, layers=8), vocab_size=64, max_sequence_length=16, init_seed=7
            ).parameters()
        )
        * 8
    )
    ps.destroy_model_parallel()
    return max(samples) - built, shards, largest, whole


def test_wrapping_a_meta_model_holds_one_unit_beyond_the_shards():
    for peak, shards, largest, whole in run_distributed(4, _peak_worker):
        # Beyond the shards (parameters and gradients): a unit drawn whole and its full buffer, less
        # than half the model's parameters; built directly, the whole model would be there.
        assert 0 < peak and peak - shards <= 2 * largest, (peak, shards, largest)
        assert 2 * largest < whole / 2, (largest, whole)


def _refusals_worker() -> list[str]:
    ps.initialize_model_parallel()
    messages = []

    def refused(build) -> None:
        try:
            build()
        except (ValueError, RuntimeError) as e:
            messages.append(str(e))
        else:
            messages.append("accepted")

    meta = _config(1, 1, None, 1, True)
    refused(
        lambda: TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=1, init_model_with_meta_device=True
        )
    )
    refused(lambda: DistributedDataParallel(meta, DistributedDataParallelConfig(), _chunks(meta)[0]))
    refused(
        lambda: FullyShardedDataParallel(
            meta,
            DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="no_shard"),
            _chunks(meta)[0],
        )
    )
    refused(lambda: _chunks(meta)[0](torch.zeros(1, 4, dtype=torch.long), None))  # run before drawn
    with torch.device("meta"):  # a module megatron_ext cannot build again
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    refused(lambda: materialize(plain, "cpu"))
    ps.destroy_model_parallel()
    return messages


def test_what_cannot_be_drawn_is_refused_alike_on_every_rank():
    first, second = run_distributed(2, _refusals_worker)
    assert first == second
    cpu_init, ddp, no_shard, unwrapped, foreign = first
    assert "init_model_with_meta_device=True, its parameters are still on the meta device" in unwrapped
    assert "init_model_with_meta_device=True needs use_cpu_initialization=True" in cpu_init
    assert "DistributedDataParallel" in ddp and "meta device" in ddp and "embedding" in ddp
    assert "'no_shard'" in no_shard
    assert "0.weight is on the meta device" in foreign


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
