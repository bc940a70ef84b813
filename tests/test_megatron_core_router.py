"""megatron_ext's ``TopKRouter.routing`` against Megatron-core 0.16.1's on the same logits, on CPU
processes: the routing, the balance losses (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``
over micro-batches), the z-loss, their gradients and tracked values with a padding mask, Sinkhorn
routing, token dropping (both drop policies, with and without padding to capacity) and the input
jitter. Megatron-core's router runs on CPU once its gate (``gating``, which moves the weight to a
GPU) is left out. Skipped when megatron-core is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ext import parallel_state as ps  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

H, S, B = 8, 16, 2
BASE = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
            moe_ffn_hidden_size=4, add_bias_linear=False, moe_aux_loss_coeff=0.0)
MASKED = [
    dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.2),
    dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.3),
    dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
         moe_aux_loss_coeff=[0.1, 0.2, 0.3], moe_z_loss_coeff=0.01, moe_router_score_function="sigmoid"),
    dict(moe_router_load_balancing_type="none", moe_z_loss_coeff=0.02, calculate_per_token_loss=True),
]
# With calculate_per_token_loss, a rank's balance and z losses are scaled by the tokens of its
# tensor x context-parallel group (the main loss's count, so that the ranks' shares sum to the serial
# gradient); Megatron-core scales by the rank's own tokens (the balance loss with a padding mask by
# the group's, its in-place all-reduce of the local counts): compared where that group is one rank
# (tests/test_train_gpt_sft.py checks tp 2 and cp 2 against serial).
PER_TOKEN = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.2],
                 moe_z_loss_coeff=0.01, calculate_per_token_loss=True)
GLOBAL_PER_TOKEN = dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.3,
                        calculate_per_token_loss=True)
DROPPING = [
    dict(num_moe_experts=4, moe_expert_capacity_factor=factor, moe_token_drop_policy=policy,
         moe_pad_expert_input_to_capacity=pad)
    for factor in (1.0, 0.5) for policy in ("probs", "position") for pad in (False, True)
]
SINKHORN = [dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=k) for k in (1, 2)]
NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


def _close(a: torch.Tensor, b: torch.Tensor, label: str) -> None:
    """Equal to float32 rounding: both sides compute in float32, in their own order of sums."""
    scale = max(float(b.abs().max()), 1e-30)
    torch.testing.assert_close(a.to(b.dtype), b, rtol=2e-6, atol=2e-6 * scale, msg=lambda m: f"{label}: {m}")


def _routers(fields: dict):
    from megatron.core.transformer import TransformerConfig as MCoreConfig
    from megatron.core.transformer.moe.router import TopKRouter as MCoreRouter

    from megatron_ext.process_groups_config import ProcessGroupCollection
    from megatron_ext.transformer import TransformerConfig
    from megatron_ext.transformer.moe.router import TopKRouter

    settings = {**BASE, **fields}
    groups = ProcessGroupCollection.use_mpu_process_groups()
    ours = TopKRouter(TransformerConfig(**settings), groups)
    theirs = MCoreRouter(MCoreConfig(**settings), groups)
    for router in (ours, theirs):
        router.set_layer_number(1)
    return ours, theirs


def _route(router, logits: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor):
    logits = logits.clone().requires_grad_(True)
    probs, routing_map = router.routing(logits, padding_mask=mask)
    (probs * weight).sum().backward()
    return probs.detach(), routing_map, logits.grad


def _compare(fields: dict, gen: torch.Generator, masked: bool, steps: int = 1, train: bool = True) -> int:
    """Routes ``steps`` micro-batches (then one more after the step's reset) through both routers;
    returns how many (token, expert) entries the routing maps hold."""
    from megatron.core.transformer.moe import moe_utils as mcore_utils

    from megatron_ext.transformer.moe import router_utils

    ours, theirs = _routers(fields)
    ours.train(train)
    theirs.train(train)
    entries = 0
    for step in range(steps + 1):
        if step == steps:  # a new optimizer step: global_aux_loss starts counting afresh
            ours.reset_global_aux_loss_tracker()
            theirs.reset_global_aux_loss_tracker()
        E = ours.num_experts
        logits = torch.randn(S, B, E, generator=gen)
        mask = (torch.rand(S, B, generator=gen) < 0.4) if masked else None
        weight = torch.randn(S * B, E, generator=gen)
        router_utils.get_moe_layer_wise_logging_tracker().clear()
        mcore_utils.get_moe_layer_wise_logging_tracker().clear()
        label = f"{fields} step {step}"
        probs, routing_map, grad = _route(ours, logits, mask, weight)
        ref_probs, ref_map, ref_grad = _route(theirs, logits, mask, weight)
        assert torch.equal(routing_map, ref_map), label
        entries += int(routing_map.sum())
        _close(probs, ref_probs, f"{label} probs")
        _close(grad, ref_grad, f"{label} logits' gradient")
        tracked = router_utils.get_moe_layer_wise_logging_tracker()
        ref_tracked = mcore_utils.get_moe_layer_wise_logging_tracker()
        assert set(tracked) == set(ref_tracked) & set(NAMES), label
        for name in tracked:
            value, ref = tracked[name]["values"][0], ref_tracked[name]["values"][0]
            if name == "z_loss":  # Megatron-core logs one rank's share; the sum is the batch's
                ref = ref / ps.get_tensor_model_parallel_world_size()
            _close(value, ref, f"{label} tracked {name}")
    return entries


def _megatron_core_router_worker() -> dict:
    from megatron.core.transformer.moe import moe_utils as mcore_utils
    from megatron.core.transformer.moe.router import TopKRouter as MCoreRouter

    from megatron_ext.transformer.moe.router_utils import MoEAuxLossAutoScaler

    # Megatron-core's router keeps its global_aux_loss counts on the current GPU: here, on the CPU.
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: "cpu"
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    mcore_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    out = {"dropping": []}
    try:
        for tp in (2, 1):  # tp 2: the counts summed over tp x cp; tp 1, dp 2: over dp for global
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
            gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
            for fields in MASKED:
                # With padding over more than one tp x cp rank, the z-loss here is the mean over
                # the valid tokens of all of them, Megatron-core's the sum of each rank's mean / tp.
                z_kept = {k: v for k, v in fields.items() if tp == 1 or k != "moe_z_loss_coeff"}
                _compare(z_kept, gen, masked=True, steps=2)
                if tp == 1 or not fields.get("calculate_per_token_loss"):
                    _compare(fields, gen, masked=False, steps=2)
            if tp == 1:
                _compare(PER_TOKEN, gen, masked=True)
                _compare(GLOBAL_PER_TOKEN, gen, masked=False, steps=2)
            for fields in SINKHORN:
                _compare(fields, gen, masked=False, train=True)
                _compare(fields, gen, masked=False, train=False)
            ps.destroy_model_parallel()
        ps.initialize_model_parallel()
        gen = torch.Generator().manual_seed(7)
        for fields in DROPPING:
            out["dropping"].append(_compare(fields, gen, masked=False, steps=0))
        # The input jitter: the same noise from the same default generator.
        ours, theirs = _routers(dict(moe_input_jitter_eps=0.1))
        x = torch.randn(S, B, H, generator=gen)
        torch.manual_seed(3)
        jittered = ours.apply_input_jitter(x)
        torch.manual_seed(3)
        out["jitter"] = torch.equal(jittered, MCoreRouter.apply_input_jitter(theirs, x))
        out["jitter_moves"] = float((jittered / x - 1).abs().max())
    finally:
        torch.cuda.current_device = current_device
    return out


@pytest.mark.slow  # two spawned processes, Megatron-core's router beside ours in every setting
def test_router_equals_megatron_core():
    for out in run_distributed(2, _megatron_core_router_worker):
        # 32 tokens, top-2 of 4 experts: capacity 16 (factor 1) or 8 (factor 0.5) per expert; with
        # padding to capacity every expert holds exactly its capacity.
        assert out["dropping"][1] == 64 and out["dropping"][3] == 64, out
        assert out["dropping"][5] == 32 and out["dropping"][7] == 32, out
        assert all(n <= 64 for n in out["dropping"]), out
        assert out["jitter"] and 0 < out["jitter_moves"] <= 0.1, out
