"""Multi-token prediction (DeepSeek-V3's MTP, Megatron-core's ``MultiTokenPredictionBlock``): after
the decoder, depth k predicts the token k + 1 places ahead from its own transformer layer over
the projection of the previous depth's normalised hidden state joined with the embedding of the
token k places ahead; every depth's logits come from the model's output layer. The losses join
the backward through ``MTPLossAutoScaler`` (scaled by ``mtp_loss_scaling_factor / mtp_num_layers``)
and are logged apart (``MTPLossLoggingHelper``); the main loss is unchanged."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.pipeline_parallel.aux_loss import MoEAuxLossAutoScaler
from megatron_ext.tensor_parallel import ColumnParallelLinear
from megatron_ext.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_ext.tensor_parallel.sharded_state import renamed_sharded_state_dict
from megatron_ext.transformer.transformer_layer import ParallelTransformerLayer
from megatron_ext.transformer.utils import build_seeded, layer_norm


class MTPLossAutoScaler(MoEAuxLossAutoScaler):
    """Megatron-core's class: ``apply(output, mtp_loss)`` returns ``output`` and gives ``mtp_loss``
    the gradient ``main_loss_backward_scale`` in the backward (the C++ node of
    ``MoEAuxLossAutoScaler``, with a scale of its own), which the schedules set
    (``pipeline_parallel.aux_loss.set_aux_loss_scale``) when ``config.mtp_num_layers`` is set."""

    main_loss_backward_scale: torch.Tensor | None = None


def roll_tensor(
    tensor: torch.Tensor, shifts: int = -1, dims: int = -1, cp_group: dist.ProcessGroup | None = None,
    packed_seq_params: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rolled, rolled.sum())``: ``tensor`` moved one place left along the sequence dim ``dims``,
    the place after each sequence's end filled with 0 (Megatron-core's ``roll_tensor``). Over a
    context-parallel group (each rank holding chunks ``r`` and ``2 cp - 1 - r`` of every sequence) the
    element entering a chunk's end comes from the chunk after it, on this rank or a neighbour: one
    all-gather of the chunks' first elements. With ``packed_seq_params`` (``cu_seqlens_q`` on the
    whole row) each packed sequence rolls on its own. Not differentiable (token ids, labels, masks).
    Collective over ``cp_group`` when it has more than one rank."""
    cp = cp_group.size() if cp_group is not None else 1
    if packed_seq_params is None and cp == 1:
        rolled = torch.roll(tensor, shifts=shifts, dims=dims)
        rolled.select(dims, shifts).fill_(0)
        return rolled, rolled.sum()
    if shifts != -1:
        raise NotImplementedError(
            f"roll_tensor: over context-parallel chunks or packed rows only shifts=-1, got {shifts}"
        )
    moved = tensor.movedim(dims, -1)
    length = moved.shape[-1]
    if packed_seq_params is not None:
        bounds = [int(b) // cp for b in packed_seq_params.cu_seqlens_q.tolist()]
    else:
        bounds = [0, length]
    # Each sequence's local rows: one piece at cp 1, two halves (chunks r and 2 cp - 1 - r) above.
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        pieces += [(start, end)] if cp == 1 else [(start, (start + end) // 2), ((start + end) // 2, end)]
    firsts = torch.stack([moved[..., start] for start, _ in pieces])
    if cp > 1:
        gathered = [torch.empty_like(firsts) for _ in range(cp)]
        dist.all_gather(gathered, firsts.contiguous(), group=cp_group)
        rank = cp_group.rank()
    rolled = torch.empty_like(moved)
    for i, (start, end) in enumerate(pieces):
        rolled[..., start : end - 1] = moved[..., start + 1 : end]
        if cp == 1:
            following = torch.zeros_like(firsts[i])
        elif i % 2 == 0:  # chunk r: chunk r + 1 follows (rank r + 1's first, or chunk cp: this rank's second)
            following = gathered[rank + 1][i] if rank < cp - 1 else firsts[i + 1]
        else:  # chunk 2 cp - 1 - r: chunk 2 cp - r follows (rank r - 1's second), none after the last
            following = gathered[rank - 1][i] if rank > 0 else torch.zeros_like(firsts[i])
        rolled[..., end - 1] = following
    rolled = rolled.movedim(-1, dims)
    return rolled, rolled.sum()


class MTPLossLoggingHelper:
    """Megatron-core's logger of the multi-token prediction losses: each depth's loss per micro-batch
    added into ``tracker["values"]``, averaged over its group when read (``track_mtp_metrics``)."""

    tracker: dict = {}

    @staticmethod
    def save_loss_to_tracker(
        loss: torch.Tensor, layer_number: int, num_layers: int,
        reduce_group: dist.ProcessGroup | None = None, avg_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Adds ``loss`` (of depth ``layer_number``, 0-based, of ``num_layers``) to the tracker."""
        if layer_number is None:
            return
        tracker = MTPLossLoggingHelper.tracker
        values = tracker.get("values")
        if values is None or values.numel() != num_layers or values.device != loss.device:
            # torch's default dtype, as Megatron-core's tracker: a float64 loss is logged rounded to it
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        tracker["values"][layer_number] += loss.detach()
        tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group

    @staticmethod
    def clean_loss_in_tracker() -> None:
        tracker = MTPLossLoggingHelper.tracker
        if "values" in tracker:
            tracker["values"].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_loss_in_tracker() -> None:
        """Sums the values over ``reduce_group`` and averages them over ``avg_group``."""
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        values = tracker["values"]
        if tracker.get("reduce_group") is not None:
            dist.all_reduce(values, group=tracker["reduce_group"])
        if tracker.get("avg_group") is not None:  # SUM and divide: gloo has no AVG
            dist.all_reduce(values, group=tracker["avg_group"])
            values /= dist.get_world_size(tracker["avg_group"])

    @staticmethod
    def track_mtp_metrics(loss_scale: float, iteration: int, writer: Any = None, wandb_writer: Any = None,
                          total_loss_dict: dict | None = None) -> None:
        """Reduces the tracked losses, times ``loss_scale`` (1 / micro-batches: their mean), into
        ``total_loss_dict`` as ``"mtp_{k} loss"`` (and the writers), then clears the tracker."""
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        losses = tracker["values"] * loss_scale
        for i, loss in enumerate(losses):
            name = f"mtp_{i + 1} loss"
            if total_loss_dict is not None:
                total_loss_dict[name] = total_loss_dict.get(name, 0) + loss
            if writer is not None:
                writer.add_scalar(name, loss, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: loss}, iteration)
        MTPLossLoggingHelper.clean_loss_in_tracker()


class MultiTokenPredictionLayer(torch.nn.Module):
    """Depth ``layer_number`` (1-based): ``final_layernorm(layer(eh_proj([enorm(embed(next tokens)) |
    hnorm(h)])))``, ``layer`` a transformer layer built like the decoder's last (global layer number
    ``num_layers + layer_number``), ``eh_proj`` column-parallel from ``2 h`` to ``h`` (gathered, and
    scattered over the sequence under sequence parallelism). ``forward`` returns the depth's hidden
    states and the token and position ids rolled one place."""

    def __init__(self, config: Any, layer_number: int = 1, vp_stage: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.vp_stage = vp_stage
        hidden = config.hidden_size
        self.enorm = layer_norm(config, hidden)
        self.hnorm = layer_norm(config, hidden)
        self.eh_proj = ColumnParallelLinear(
            2 * hidden, hidden, config=config, init_method=config.init_method, bias=False, gather_output=False
        )
        self.transformer_layer = ParallelTransformerLayer(
            config, layer_number=config.num_layers + layer_number
        )
        self.final_layernorm = layer_norm(config, hidden)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None, rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params: Any = None, embedding: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        input_ids, _ = roll_tensor(input_ids, -1, -1, cp_group, packed_seq_params)
        position_ids, _ = roll_tensor(position_ids, -1, -1, cp_group, packed_seq_params)
        decoder_input = embedding(input_ids, position_ids)

        def project_and_layer(h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            with (tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel
                  else contextlib.nullcontext()):
                h, _ = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(h)), dim=-1))
                h = gather_from_tensor_model_parallel_region(h, group=self.eh_proj.tp_group)
                if self.config.sequence_parallel:
                    h = scatter_to_sequence_parallel_region(h, group=self.eh_proj.tp_group)
                h = self.transformer_layer(h, attention_mask, rotary_pos_emb, packed_seq_params)
            return self.final_layernorm(h)

        config = self.config
        if self.training and config.recompute_granularity == "full" and config.recompute_method == "uniform":
            hidden_states = tensor_parallel.checkpoint(project_and_layer, False, hidden_states, decoder_input)
        else:
            hidden_states = project_and_layer(hidden_states, decoder_input)
        return hidden_states, input_ids, position_ids

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron-core's keys: ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` and the
        transformer layer's own (``transformer_layer.<its keys>``)."""
        out = renamed_sharded_state_dict(
            self, prefix, sharded_offsets, {}, metadata, skip=("transformer_layer",)
        )
        layer = self.transformer_layer
        out.update(layer.sharded_state_dict(f"{prefix}transformer_layer.", sharded_offsets, metadata))
        return out


class MultiTokenPredictionBlock(torch.nn.Module):
    """The ``config.mtp_num_layers`` depths (on the last pipeline stage). ``init_seed``: depth k
    (0-based) drawn from the CPU generator seeded with ``init_seed + num_layers + 2 + k``, so its
    weights do not depend on the layout. ``forward`` returns the list of each depth's hidden
    states (Megatron-core concatenates them along the sequence; here they stay apart)."""

    def __init__(
        self, config: Any, spec: Any = None, vp_stage: int | None = None, init_seed: int | None = None
    ):
        super().__init__()
        if spec is not None:
            raise TypeError(
                "MultiTokenPredictionBlock builds its layers from the config (each like the decoder's last "
                f"layer); module specs are not supported, got {spec!r}"
            )
        self.config = config
        self.vp_stage = vp_stage
        self.mtp_loss_scaling_factor = config.mtp_loss_scaling_factor
        layers = []
        for depth in range(config.mtp_num_layers):
            layers.append(build_seeded(
                config, init_seed, config.num_layers + 2 + depth,
                partial(MultiTokenPredictionLayer, config, depth + 1, vp_stage),
            ))
        self.layers = torch.nn.ModuleList(layers)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None, rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params: Any = None, embedding: Callable | None = None,
    ) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            hidden_states, input_ids, position_ids = layer(
                input_ids, position_ids, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params,
                embedding,
            )
            out.append(hidden_states)
        return out

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron-core's keys: depth k under ``layers.<k>.``."""
        out = {}
        for i, layer in enumerate(self.layers):
            out.update(layer.sharded_state_dict(f"{prefix}layers.{i}.", sharded_offsets, metadata))
        return out
