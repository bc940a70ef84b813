"""The top-k router: a replicated linear gate h -> E, the top-k choice, the load-balancing and z
losses and token dropping (Megatron-core's ``TopKRouter``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.process_groups_config import ProcessGroupCollection
from megatron_ext.resolve import group_size
from megatron_ext.transformer.moe.router_utils import (
    MoEAuxLossAutoScaler,
    _softmax,
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_tokens_per_expert_and_token_count,
    save_to_aux_losses_tracker,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def moe_process_groups(pg_collection: Any = None) -> ProcessGroupCollection:
    """``pg_collection``, or parallel_state's groups; without torch.distributed's process groups,
    an empty collection (every group then reads as size 1)."""
    if pg_collection is not None:
        return pg_collection
    if parallel_state.model_parallel_is_initialized():
        return ProcessGroupCollection.use_mpu_process_groups()
    return ProcessGroupCollection()


class TopKRouter(torch.nn.Module):
    """Routes each token to its ``moe_router_topk`` experts.

    ``forward(input [s, b, h]) -> (probs, routing_map)``, both [s*b, E]. The gate weight [E, h]
    is replicated (with ``sequence_parallel`` set under sequence parallelism, so its gradient is
    summed over the tensor-parallel ranks like a LayerNorm's). In training, the balance loss
    (``moe_router_load_balancing_type`` ``aux_loss`` over the micro-batch, ``seq_aux_loss`` per
    sequence, ``global_aux_loss`` over the micro-batches of the step so far) and the z-loss
    (``moe_z_loss_coeff``) join the backward through ``MoEAuxLossAutoScaler`` and are tracked per
    layer for logging. Token counts for the balance loss are summed over the tensor ×
    context-parallel group (``global_aux_loss``: tensor × data × context): each rank's loss is its
    share of the loss of all those tokens. ``sinkhorn`` routes by S-BASE's balanced assignment
    instead of a loss. A ``padding_mask`` (True at padding) keeps padding tokens out of every loss
    and count. With ``moe_router_enable_expert_bias`` the (sigmoid) routing adds
    ``expert_bias``, a float32 buffer that ``finalize_model_grads`` moves after each step from the
    tokens counted in ``local_tokens_per_expert``. With ``moe_router_num_groups`` and
    ``moe_router_group_topk`` each token's experts come from its best groups of experts
    (``router_utils.group_limited_topk``): arithmetic on the token's own scores, so it needs no
    communication under any parallelism.
    """

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.layer_number: int | None = None
        if self.routing_type == "sinkhorn" and config.moe_aux_loss_coeff:
            raise ValueError(
                f"moe_router_load_balancing_type='sinkhorn' takes no aux loss, got "
                f"moe_aux_loss_coeff={config.moe_aux_loss_coeff!r} (expected 0)"
            )
        if self.routing_type == "sinkhorn" and config.moe_expert_capacity_factor is not None:
            raise ValueError(
                "moe_expert_capacity_factor works with the aux-loss balancing types, not with "
                f"moe_router_load_balancing_type='sinkhorn' (got {config.moe_expert_capacity_factor!r})"
            )
        if isinstance(self.routing_type, list) and "sinkhorn" in self.routing_type:
            raise ValueError(
                f"moe_router_load_balancing_type={self.routing_type!r}: 'sinkhorn' is a routing, not "
                "a loss to combine; give it alone"
            )
        groups = moe_process_groups(pg_collection)
        self.tp_cp_group = getattr(groups, "tp_cp", None)
        self.tp_dp_cp_group = getattr(groups, "tp_dp_cp", None)
        self.input_jitter = None
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32)
        )
        self.bias = (
            torch.nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32))
            if getattr(config, "add_bias_linear", False)
            else None
        )
        self.calculate_per_token_loss = bool(getattr(config, "calculate_per_token_loss", False))
        self.reset_parameters()
        self.enable_expert_bias = bool(config.moe_router_enable_expert_bias)
        if self.enable_expert_bias:
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32),
                persistent=False,
            )
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None
        if self.get_aux_loss_coeff("global_aux_loss") > 0:
            # Token counts summed over the tensor x data x context-parallel group, kept over the
            # micro-batches of a step.
            self.register_buffer(
                "global_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32),
                persistent=False,
            )
            self.register_buffer("ga_steps", torch.tensor(0.0), persistent=False)
        else:
            self.global_tokens_per_expert = None
            self.ga_steps = None

    def reset_parameters(self) -> None:
        if getattr(self.config, "perform_initialization", True):
            self.config.init_method(self.weight.data)
        self.weight.data = self.weight.data.to(self.config.params_dtype)
        self.weight.sequence_parallel = bool(self.config.sequence_parallel)
        if self.bias is not None:
            if getattr(self.config, "perform_initialization", True):
                self.config.init_method(self.bias.data)
            self.bias.data = self.bias.data.to(self.config.params_dtype)
            self.bias.sequence_parallel = bool(self.config.sequence_parallel)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """The logits [s, b, E] (in ``moe_router_dtype`` when set)."""
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        weight = self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), weight, bias)

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """``moe_aux_loss_coeff`` for ``aux_loss_type`` when it is (one of) the balancing types."""
        if isinstance(self.routing_type, str):
            return self.config.moe_aux_loss_coeff if self.routing_type == aux_loss_type else 0.0
        if aux_loss_type in self.routing_type:
            return self.config.moe_aux_loss_coeff[self.routing_type.index(aux_loss_type)]
        return 0.0

    def is_aux_loss_enabled(self) -> bool:
        return any(self.get_aux_loss_coeff(t) > 0 for t in AUX_LOSS_NAMES)

    def _num_layers(self) -> int:
        return self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)

    def _balance_loss(
        self,
        probs: torch.Tensor,
        scores: torch.Tensor,
        routing_map: torch.Tensor,
        aux_loss_type: str,
        seq_length: int,
        bsz: int,
        with_padding_mask: bool,
    ) -> torch.Tensor:
        coeff = self.get_aux_loss_coeff(aux_loss_type)
        if coeff == 0:
            return probs
        topk, per_sequence = self.topk, aux_loss_type == "seq_aux_loss"
        is_global = aux_loss_type == "global_aux_loss"
        group = self.tp_dp_cp_group if is_global else self.tp_cp_group
        if per_sequence:  # each sequence's tokens counted apart: the batch as extra experts
            scores, routing_map, topk = (
                scores.reshape(seq_length, -1),
                routing_map.reshape(seq_length, -1),
                topk * bsz,
            )
        counts, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map, group, topk, with_padding_mask
        )
        if with_padding_mask:  # the valid tokens counted in the scores' precision
            local_tokens, total_tokens = local_tokens.to(scores.dtype), total_tokens.to(scores.dtype)
        if is_global:  # the mean count per micro-batch since the last optimizer step
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
            counts = self.global_tokens_per_expert / self.ga_steps
        loss = switch_load_balancing_loss_func(
            scores, counts, total_tokens, self.topk, self.num_experts, coeff
        )
        if per_sequence:
            loss = loss / bsz
        save_to_aux_losses_tracker(
            AUX_LOSS_NAMES[aux_loss_type], loss / coeff, self.layer_number, self._num_layers(),
            reduce_group=group, reduce_group_has_dp=is_global,
        )
        if self.calculate_per_token_loss:
            loss = loss * self._main_loss_tokens(local_tokens)
        return MoEAuxLossAutoScaler.apply(probs, loss)

    def _main_loss_tokens(self, local_tokens):
        """The tokens a per-token loss's gradient is divided by for this rank's share: those of
        its tensor x context-parallel group, whose ranks each hold a share of the loss over all of
        them (the main loss's count is the group's too), so the shares' gradients sum to the
        serial one's."""
        size = group_size(self.tp_cp_group)
        if size == 1:
            return local_tokens
        if not torch.is_tensor(local_tokens):  # no padding: the group's ranks hold equal shares
            return local_tokens * size
        total = local_tokens.detach().clone()
        dist.all_reduce(total, group=self.tp_cp_group)
        return total

    def reset_global_aux_loss_tracker(self) -> None:
        """Clears the counts of ``global_aux_loss`` (``finalize_model_grads`` after each step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def sinkhorn_load_balancing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """S-BASE routing: in training the experts are chosen by the Sinkhorn-balanced scores
        (float32, no gradient); the weights are the sigmoid (k = 1) or softmax of the logits."""

        def activation(x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(x) if self.topk == 1 else _softmax(x).type_as(x)

        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.to(torch.float32)), k=self.topk, dim=1)
            logits = activation(logits)
        else:
            logits = activation(logits)
            _, indices = torch.topk(logits, k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
        return logits * routing_map, routing_map

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attaches the z-loss (coefficient split over the tensor × context-parallel ranks, mean
        over the tokens that are not padding) to the logits in training."""
        if not self.config.moe_z_loss_coeff or not self.training or not torch.is_grad_enabled():
            return logits
        coeff = self.config.moe_z_loss_coeff / group_size(self.tp_cp_group)
        if padding_mask is not None and group_size(self.tp_cp_group) > 1:
            # The mean over the valid tokens of all tensor x context-parallel ranks, which may hold
            # different numbers of them (Megatron-core takes each rank's own mean over the ranks).
            valid = ~padding_mask
            count = valid.sum()
            dist.all_reduce(count, group=self.tp_cp_group)
            z_values = torch.square(torch.logsumexp(logits, dim=-1)) * valid
            z_loss = z_values.sum() / torch.clamp(count, min=1) * self.config.moe_z_loss_coeff
        else:
            z_loss = z_loss_func(logits, coeff, padding_mask=padding_mask)
        if self.calculate_per_token_loss:
            num_tokens = logits.shape[0] if padding_mask is None else (~padding_mask).sum()
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss * self._main_loss_tokens(num_tokens))
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        # Each tensor x context-parallel rank's mean over its own tokens, summed over those ranks:
        # the batch's mean, as the balance losses are logged (Megatron-core logs one rank's share).
        save_to_aux_losses_tracker(
            "z_loss", z_loss / self.config.moe_z_loss_coeff, self.layer_number, self._num_layers(),
            reduce_group=self.tp_cp_group,
        )
        return logits

    def apply_input_jitter(self, input: torch.Tensor) -> torch.Tensor:
        """``moe_input_jitter_eps``: the input times uniform noise in [1 - eps, 1 + eps), drawn
        from torch's default generator by ``torch.distributions.Uniform`` as Megatron-core does (in
        evaluation too)."""
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return input
        if self.input_jitter is None:
            self.input_jitter = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - eps, dtype=input.dtype, device=input.device),
                torch.tensor(1.0 + eps, dtype=input.dtype, device=input.device),
            ).rsample
        return input * self.input_jitter(input.shape)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """``logits`` [s, b, E]; ``padding_mask`` [s, b], True at padding: those tokens are
        routed, but the z-loss, the balance losses and the expert-bias counts leave them out."""
        seq_length, bsz = logits.shape[:2]
        logits = logits.reshape(-1, self.num_experts)
        if padding_mask is not None:
            if padding_mask.numel() != logits.shape[0]:
                raise ValueError(
                    f"TopKRouter: padding_mask has shape {tuple(padding_mask.shape)}, expected "
                    f"[{seq_length}, {bsz}] like the input's tokens"
                )
            padding_mask = padding_mask.reshape(-1).bool()
        logits = self.apply_z_loss(logits, padding_mask)
        if self.routing_type == "sinkhorn":
            probs, routing_map = self.sinkhorn_load_balancing(logits)
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits,
                self.topk,
                use_pre_softmax=self.config.moe_router_pre_softmax,
                num_groups=self.config.moe_router_num_groups,
                group_topk=self.config.moe_router_group_topk,
                scaling_factor=self.config.moe_router_topk_scaling_factor,
                score_function=self.score_function,
                expert_bias=self.expert_bias,
            )
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs,
                routing_map,
                router_topk=self.topk,
                capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, padding_mask=padding_mask
            )
            for kind in AUX_LOSS_NAMES:
                probs = self._balance_loss(
                    probs, scores, aux_map, kind, seq_length, bsz, padding_mask is not None
                )
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                counted = routing_map if padding_mask is None else routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += counted.sum(dim=0)
        return probs, routing_map

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()
        logits = self.gating(self.apply_input_jitter(input))
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        return self.routing(logits, padding_mask)
