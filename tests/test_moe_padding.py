"""Padded batches through the router and the MoE layer, in float64: a padding mask makes the
losses, their gradients and the expert-bias counts those of the valid tokens alone; at ep 2 and at
tp 2 x ep 2 (sequence-parallel) with padding the layer equals the serial one. Also the forced
load balancing and Sinkhorn routing against their definitions."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.process_groups_config import ProcessGroupCollection
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.moe import MoELayer
from megatron_ext.transformer.moe.router_utils import (
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
    topk_routing_with_score_function,
)
from tests.conftest import TIGHT
from tests.distributed import run_distributed

E, K, H, FFN, S = 4, 2, 8, 6, 8
LOSSES = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.2],
              moe_z_loss_coeff=0.05)


def _config(**kwargs) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
                    moe_ffn_hidden_size=FFN, params_dtype=torch.float64, use_cpu_initialization=True,
                    add_bias_linear=False, init_method_std=0.5, moe_aux_loss_coeff=0.0)
    settings.update(kwargs)
    return TransformerConfig(**settings)


def _aux_only(layer: MoELayer, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """The tracked losses and the router weight's gradient from the router's losses alone."""
    get_moe_layer_wise_logging_tracker().clear()
    layer.zero_grad()
    layer(x, padding_mask=mask)[0].sum().mul(0).backward()
    tracked = {k: v["values"][0].item() for k, v in get_moe_layer_wise_logging_tracker().items()}
    return tracked, layer.router.weight.grad.clone()


@pytest.mark.parametrize("fields", [
    LOSSES,
    dict(LOSSES, calculate_per_token_loss=True),
    dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.05),
    dict(LOSSES, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
])
def test_padding_mask_is_the_valid_tokens_alone(fields):
    """Each sequence's second half padded: the losses, the gradient and the expert-bias counts
    equal those of the first halves without a mask."""
    torch.manual_seed(3)
    layer = MoELayer(_config(**fields), layer_number=1)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    x = torch.randn(S, 3, H, dtype=torch.float64)
    mask = torch.zeros(3, S, dtype=torch.bool)  # [b, s], True at padding
    mask[:, S // 2:] = True
    runs = []
    for inputs, m in ((x, mask), (x[: S // 2], None), (x, None)):
        if layer.router.enable_expert_bias:
            layer.router.local_tokens_per_expert.zero_()
        if layer.router.global_tokens_per_expert is not None:
            layer.router.reset_global_aux_loss_tracker()
        tracked, grad = _aux_only(layer, inputs, m)
        counts = layer.router.local_tokens_per_expert
        runs.append((tracked, grad, None if counts is None else counts.clone()))
    (masked, grad, counts), (valid, ref_grad, ref_counts), (unmasked, full_grad, _) = runs
    assert masked.keys() == valid.keys() and len(masked) >= 2
    for name in masked:
        assert masked[name] == pytest.approx(valid[name], rel=1e-12), name
        assert abs(unmasked[name] - valid[name]) > 1e-6, name  # the padding would change it
    torch.testing.assert_close(grad, ref_grad, **TIGHT)
    assert (full_grad - ref_grad).abs().max() > 1e-6
    if counts is not None:
        assert torch.equal(counts, ref_counts) and counts.sum() == 3 * (S // 2) * K
    get_moe_layer_wise_logging_tracker().clear()


def test_bad_padding_mask_raises():
    layer = MoELayer(_config(), layer_number=1)
    with pytest.raises(ValueError, match=r"padding_mask must be \[batch, seq\] = \(3, 8\)"):
        layer(torch.randn(S, 3, H, dtype=torch.float64), padding_mask=torch.zeros(S, 3, dtype=torch.bool))


@pytest.mark.parametrize("fields, message", [
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1),
     r"'sinkhorn' takes no aux loss"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_expert_capacity_factor=1.0),
     r"moe_expert_capacity_factor works with the aux-loss balancing types"),
    (dict(moe_router_load_balancing_type=["sinkhorn", "aux_loss"], moe_aux_loss_coeff=[0.0, 0.1]),
     r"'sinkhorn' is a routing, not a loss to combine"),
])
def test_bad_sinkhorn_settings_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        MoELayer(_config(**fields), layer_number=1)


def test_sinkhorn_routes_by_the_balanced_assignment():
    from megatron_ext.transformer.moe.router_utils import sinkhorn

    torch.manual_seed(4)
    for k in (1, 2):
        config = _config(moe_router_load_balancing_type="sinkhorn", moe_router_topk=k)
        layer = MoELayer(config, layer_number=1)
        x = torch.randn(S, 2, H, dtype=torch.float64)
        logits = x.reshape(-1, H) @ layer.router.weight.detach().T
        balanced = sinkhorn(logits.float())
        # the balanced assignment: rows sum to 1 / tokens, columns to 1 / experts
        torch.testing.assert_close(balanced.sum(1), torch.full((2 * S,), 1 / (2 * S)), rtol=1e-3, atol=0)
        torch.testing.assert_close(balanced.sum(0), torch.full((E,), 1 / E), rtol=1e-3, atol=0)
        weights = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, -1)
        for training, chooser in ((True, balanced), (False, weights)):
            layer.train(training)
            probs, routing_map = layer.router(x)
            chosen = torch.zeros_like(routing_map).scatter(1, chooser.topk(k, dim=1).indices, True)
            assert torch.equal(routing_map, chosen)
            torch.testing.assert_close(probs, weights * chosen, **TIGHT)


def _force_load_balancing() -> None:
    from megatron_ext import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    layer = MoELayer(_config(moe_router_force_load_balancing=True), layer_number=1)
    x = torch.randn(S, 2, H, dtype=torch.float64, requires_grad=True)
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    probs, routing_map = layer.router(x)
    tracker.set_states(states)
    with tracker.fork(tensor_parallel.random.get_expert_parallel_rng_tracker_name()):
        drawn = torch.empty(2 * S, E, dtype=torch.float64).normal_()
    ref_probs, ref_map = topk_routing_with_score_function(drawn, K)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, **TIGHT)
    # the gradient passes straight through the random logits to the gate
    weight = torch.randn(2 * S, E, dtype=torch.float64)
    (probs * weight).sum().backward()
    logits = drawn.clone().requires_grad_(True)
    (topk_routing_with_score_function(logits, K)[0] * weight).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, logits.grad.T @ x.detach().reshape(-1, H), **TIGHT)
    assert layer.router.weight.grad.abs().max() > 0


@pytest.mark.slow  # one spawned process
def test_force_load_balancing_routes_random_logits():
    run_distributed(1, _force_load_balancing)


# Padded batches in parallel ---------------------------------------------------------------------

LAYOUTS = [dict(tensor_model_parallel_size=1, expert_model_parallel_size=2),
           dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True)]
PARALLEL_CASES = [
    dict(LOSSES, moe_token_dispatcher_type="allgather"),
    dict(LOSSES, moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
         moe_router_enable_expert_bias=True),
    # (no z-loss: a mean per micro-batch, it differs between dp shards and one serial batch)
    dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.3,
         moe_token_dispatcher_type="alltoall"),
]


def _serial_reference(fields: dict, x: torch.Tensor, mask: torch.Tensor, gw: torch.Tensor, dp: int) -> dict:
    """The dp shards of the batch as micro-batches of one serial layer (``global_aux_loss``: the
    whole batch as one, its counts being the step's), each loss over dp."""
    torch.manual_seed(5)
    layer = MoELayer(_config(**fields), layer_number=1, pg_collection=ProcessGroupCollection())
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / dp, dtype=torch.float64))
    get_moe_layer_wise_logging_tracker().clear()
    x = x.clone().requires_grad_(True)
    shards = 1 if layer.router.global_tokens_per_expert is not None else dp
    outs = []
    for xs, ms, gs in zip(x.chunk(shards, 1), mask.chunk(shards, 0), gw.chunk(shards, 1)):
        out = layer(xs, padding_mask=ms)[0]
        (out * gs).sum().div(dp).backward()
        outs.append(out.detach())
    tracked = {k: v["values"][0].item() / shards for k, v in get_moe_layer_wise_logging_tracker().items()}
    counts = layer.router.local_tokens_per_expert
    return dict(layer=layer, out=torch.cat(outs, 1), x_grad=x.grad, tracked=tracked,
                router_grad=layer.router.weight.grad, counts=None if counts is None else counts.clone())


def _padded_layouts_worker() -> int:
    import torch.distributed as dist

    from megatron_ext import parallel_state as ps
    from megatron_ext.distributed.finalize_model_grads import finalize_model_grads
    from megatron_ext.transformer.moe.router_utils import reduce_aux_losses_tracker_across_ranks

    checked = 0
    for layout in LAYOUTS:
        tp, ep = layout["tensor_model_parallel_size"], layout["expert_model_parallel_size"]
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        for fields in PARALLEL_CASES:
            gen = torch.Generator().manual_seed(9)  # the same batch on every rank
            x = torch.randn(S, 2 * dp, H, dtype=torch.float64, generator=gen)
            mask = torch.rand(2 * dp, S, generator=gen) < 0.4
            gw = torch.randn(S, 2 * dp, H, dtype=torch.float64, generator=gen)
            ref = _serial_reference(fields, x, mask, gw, dp)
            layer = MoELayer(_config(**fields, **layout, expert_tensor_parallel_size=1), layer_number=1)
            with torch.no_grad():
                layer.router.weight.copy_(ref["layer"].router.weight)
                for i, e in enumerate(layer.local_expert_indices):
                    mine, theirs = layer.experts.local_experts[i], ref["layer"].experts.local_experts[e]
                    mine.linear_fc1.weight.copy_(theirs.linear_fc1.weight)
                    mine.linear_fc2.weight.copy_(theirs.linear_fc2.weight)
            # Each rank's losses unscaled: finalize_model_grads averages the gradients over dp.
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
            get_moe_layer_wise_logging_tracker().clear()
            rows = slice(tp_rank * S // tp, (tp_rank + 1) * S // tp)  # this rank's sequence share
            batch = slice(2 * dp_rank, 2 * dp_rank + 2)
            xs = x[rows, batch].clone().requires_grad_(True)
            out = layer(xs, padding_mask=mask[batch, rows])[0]
            (out * gw[rows, batch]).sum().backward()
            counts = layer.router.local_tokens_per_expert
            counts = None if counts is None else counts.clone()  # finalize_model_grads spends them
            global_counts = layer.router.global_tokens_per_expert
            assert global_counts is None or global_counts.sum() > 0
            finalize_model_grads([layer])
            # the step is over: global_aux_loss counts the next one afresh
            assert global_counts is None or (not global_counts.any() and layer.router.ga_steps == 0)
            reduce_aux_losses_tracker_across_ranks()
            label = f"{layout} {fields}"
            torch.testing.assert_close(out.detach(), ref["out"][rows, batch], **TIGHT,
                                       msg=lambda m: f"{label}: {m}")
            # the input's gradient reaches this rank from the losses of all ranks (the serial
            # micro-batches' losses were over dp)
            torch.testing.assert_close(xs.grad / dp, ref["x_grad"][rows, batch], **TIGHT,
                                       msg=lambda m: f"{label} input grad: {m}")
            torch.testing.assert_close(layer.router.weight.grad, ref["router_grad"], **TIGHT,
                                       msg=lambda m: f"{label} router grad: {m}")
            tracked = {k: v["values"][0].item() for k, v in get_moe_layer_wise_logging_tracker().items()}
            assert tracked.keys() == ref["tracked"].keys(), label
            for name, value in tracked.items():
                assert value == pytest.approx(ref["tracked"][name], rel=1e-10), f"{label} {name}"
            if ref["counts"] is not None:
                group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
                dist.all_reduce(counts, group=group)
                assert torch.equal(counts, ref["counts"]), label
            checked += 1
        ps.destroy_model_parallel()
    get_moe_layer_wise_logging_tracker().clear()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    return checked


@pytest.mark.slow  # a 4-rank group, 6 layouts and routers
def test_padded_batches_at_ep_2_and_tp_2_ep_2_equal_serial():
    assert run_distributed(4, _padded_layouts_worker) == [6] * 4


# Through GPTModel, as Megatron-core's GPTModel passes padding_mask ---------------------------------

def _gpt_run(layout: dict, mask: torch.Tensor | None, length: int = S) -> tuple[float, dict, list]:
    from megatron_ext import tensor_parallel
    from megatron_ext.distributed.finalize_model_grads import finalize_model_grads
    from megatron_ext.models.gpt import GPTModel
    from megatron_ext.transformer.moe.router_utils import reduce_aux_losses_tracker_across_ranks

    config = _config(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                     attention_dropout=0.0, pipeline_dtype=torch.float64, **LOSSES, **layout,
                     expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    model = GPTModel(config, vocab_size=32, max_sequence_length=S, init_seed=7)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 32, (2, S), generator=gen)[:, :length]
    labels = torch.randint(0, 32, (2, S), generator=gen)[:, :length]
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    get_moe_layer_wise_logging_tracker().clear()
    per_token = model(tokens, torch.arange(length).expand(2, length), labels=labels, padding_mask=mask)
    loss = per_token if mask is None else per_token * ~mask
    loss.sum().backward()
    finalize_model_grads([model])
    reduce_aux_losses_tracker_across_ranks()
    tracked = {k: v["values"][:2].tolist() for k, v in get_moe_layer_wise_logging_tracker().items()}
    grads = [layer.mlp.router.weight.grad.clone() for layer in model.decoder.layers]
    return float(loss.sum()), tracked, grads


def _gpt_padding_worker() -> dict:
    from megatron_ext import parallel_state as ps

    mask = torch.zeros(2, S, dtype=torch.bool)
    mask[:, S // 2:] = True  # the second half of both rows is padding
    ps.initialize_model_parallel()
    serial = _gpt_run({}, mask)
    valid_only = _gpt_run({}, None, length=S // 2)
    unmasked = _gpt_run({}, None)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    parallel = _gpt_run(dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                             sequence_parallel=True), mask)
    for name, values in serial[1].items():
        assert values == pytest.approx(valid_only[1][name], rel=1e-12), name
        assert values == pytest.approx(parallel[1][name], rel=1e-10), name
        assert abs(values[0] - unmasked[1][name][0]) > 1e-6, name
    for grad, ref, full in zip(parallel[2], serial[2], unmasked[2]):
        torch.testing.assert_close(grad, ref, **TIGHT)
        assert (full - ref).abs().max() > 1e-6
    # causal attention: the valid tokens see only valid tokens, so the router's gradient is theirs
    for grad, ref in zip(serial[2], valid_only[2]):
        torch.testing.assert_close(grad, ref, **TIGHT)
    return sorted(serial[1])


@pytest.mark.slow  # a 2-rank group, four models
def test_gpt_model_passes_padding_mask_to_the_routers():
    """GPTModel(padding_mask=[b, s]) as Megatron-core's: the routers of a padded batch give the
    losses and gradients of its valid tokens, serial and at tp 2 x ep 2 (sequence-parallel)."""
    for names in run_distributed(2, _gpt_padding_worker):
        assert names == ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"]
