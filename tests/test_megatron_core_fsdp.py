"""Megatron-core 0.16.1's own GPTModel (local layer spec, built by benchmarks/megatron_core_gpt.py as
tests/test_megatron_core_model.py builds it) wrapped in megatron_ext's FullyShardedDataParallel
(``DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=S)``),
trained with megatron_ext's distributed optimizer, schedule and finalize_model_grads, against the
same model under megatron_ext's plain DistributedDataParallel: the losses, gradient norms and
trained parameters agree in float64 under every strategy. Megatron-core's TransformerLayer is a
unit by its class name (megatron_ext's floor imports no model code), and under
optim_grads_params the units' and the root's parameters have no storage between steps.
Skipped when megatron-core is not installed."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch

# Not importorskip: the workers resolve megatron.core's packages to megatron_ext before
# megatron.core is first imported, and they import this module first.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from benchmarks.megatron_core_gpt import Run, cpu_patches, setup, train_step, use_megatron_ext  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow  # a 2-rank and a 4-rank group, four trainings each

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
# Three micro-batches per data-parallel rank and step (global batch 12, micro-batch 2, dp 2).
# SGD (momentum 0.9): its update is proportional to the gradient, so a wrongly scaled gradient
# moves the weights (Adam's update hardly changes when a gradient is scaled); Adam with its two
# sharded moments at tp 2.
LAYOUTS = {
    2: ("gpt dp2", Run(global_batch=12, steps=3, optimizer="sgd")),
    4: ("llama tp2 dp2 sequence-parallel",
        Run(arch="llama", tp=2, sequence_parallel=True, global_batch=12, steps=3)),
}
MICRO_BATCHES = 3
FSDP_CLASS = "megatron_ext.distributed.fully_sharded_data_parallel.FullyShardedDataParallel"
MEGATRON_CORE_LAYER = "megatron.core.transformer.transformer_layer.TransformerLayer"


def _layer_weight(chunk: torch.nn.Module) -> torch.Tensor:
    return chunk.module.decoder.layers[0].mlp.linear_fc1.weight


def _train(run: Run) -> dict[str, Any]:
    """``run.steps`` steps; the per-step losses and norms, the trained parameters (gathered) and,
    under FSDP, the units and the storage a layer's and the embedding's weight hold after a step."""
    from megatron.core import parallel_state as ps

    model, optimizer, scheduler = setup(run)
    (chunk,) = model
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "storage": [], "in flight": []}
    hook = None
    if run.fsdp is not None:
        # In the first layer's forward the next layer's gather is in flight (optim_grads_params);
        # stop_communication() waits for it, and the training goes on as before.
        def stop(*unused: Any) -> None:
            before = chunk.param_gather_in_flight
            chunk.stop_communication()
            out["in flight"].append((before, chunk.param_gather_in_flight))

        hook = chunk.module.decoder.layers[0].register_forward_hook(stop)
    try:
        for step in range(run.steps):
            loss, norm = train_step(run, model, optimizer, scheduler, step)
            if hook is not None:
                hook.remove()
                hook = None
            out["losses"].append(loss)
            out["grad_norms"].append(norm)
            if run.fsdp is not None:
                embedding = chunk.module.embedding.word_embeddings.weight
                out["storage"].append(
                    (_layer_weight(chunk).untyped_storage().nbytes(), embedding.untyped_storage().nbytes()))
        if run.fsdp is not None:
            out["wrapper"] = type(chunk).__module__ + "." + type(chunk).__qualname__
            out["units"] = [type(u.module).__module__ + "." + type(u.module).__qualname__
                            for u in chunk._units if u.module is not None]
            # Megatron-core's FSDP wrapper's name; the whole parameters, resharded after
            checkpoint = chunk.state_dict_for_save_checkpoint()
            out["storage after checkpoint"] = _layer_weight(chunk).untyped_storage().nbytes()
            chunk.gather_all_params()
        else:
            checkpoint = chunk.state_dict()
        out["checkpoint"] = {k: v.flatten().tolist() for k, v in checkpoint.items() if torch.is_tensor(v)}
        # plain lists: tensors would travel back through shared memory the rank may free first
        out["params"] = {n: p.detach().flatten().tolist() for n, p in chunk.module.named_parameters()}
    finally:
        ps.destroy_model_parallel()
    return out


def _train_layouts(world_size: int) -> dict[str, dict[str, Any]]:
    use_megatron_ext()
    cpu_patches(full=False)
    name, run = LAYOUTS[world_size]
    results = {"ddp": _train(run)}
    for strategy in STRATEGIES:
        results[strategy] = _train(dataclasses.replace(run, fsdp=strategy, distributed_optimizer=True))
    return results


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_megatron_core_gpt_model_under_megatron_ext_fsdp_trains_as_under_ddp(world_size):
    name, run = LAYOUTS[world_size]
    per_rank = run_distributed(world_size, _train_layouts, world_size, timeout=600)
    for rank, results in enumerate(per_rank):
        ddp = results["ddp"]
        assert len(ddp["losses"]) == run.steps and ddp["losses"][-1] < ddp["losses"][0], (name, ddp["losses"])
        for strategy in STRATEGIES:
            got, where = results[strategy], f"{name} {strategy} rank {rank}"
            assert got["wrapper"] == FSDP_CLASS, where
            if strategy == "optim":  # the distributed optimizer's buffers: no units
                assert got["units"] == [], where
            else:  # each of Megatron-core's transformer layers a unit of its own, by default
                assert got["units"] == [MEGATRON_CORE_LAYER] * run.layers, (where, got["units"])
            for what in ("losses", "grad_norms"):
                torch.testing.assert_close(torch.tensor(got[what], dtype=torch.float64),
                                           torch.tensor(ddp[what], dtype=torch.float64), rtol=1e-9, atol=0,
                                           msg=lambda m: f"{where} {what}: {m}")
            assert sorted(got["params"]) == sorted(ddp["params"]), where
            for param, value in ddp["params"].items():
                torch.testing.assert_close(torch.tensor(got["params"][param]), torch.tensor(value),
                                           rtol=1e-9, atol=1e-12,
                                           msg=lambda m: f"{where} {param}: {m}")
            assert sorted(got["checkpoint"]) == sorted(ddp["checkpoint"]), where
            for key, value in ddp["checkpoint"].items():
                torch.testing.assert_close(torch.tensor(got["checkpoint"][key]), torch.tensor(value),
                                           rtol=1e-9, atol=1e-12, msg=lambda m: f"{where} {key}: {m}")
            # The first step's micro-batches, in the first layer: from the second on (the units'
            # order known) the next layer's gather is in flight under sharded parameters; waited for.
            prefetch = strategy == "optim_grads_params"
            in_flight = [(False, False)] + [(prefetch, False)] * (MICRO_BATCHES - 1)
            assert got["in flight"] == in_flight, (where, got["in flight"])
            # After each optimizer step: the full parameters' storage is freed only when sharded.
            for layer, embedding in got["storage"]:
                if strategy == "optim_grads_params":
                    assert (layer, embedding) == (0, 0), (where, got["storage"])
                    assert got["storage after checkpoint"] == 0, where
                else:
                    assert layer > 0 and embedding > 0, (where, got["storage"])
