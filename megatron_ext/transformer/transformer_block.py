"""The stack of transformer layers held by one pipeline stage."""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.dist_checkpointing.mapping import ShardedStateDict
from megatron_ext.dist_checkpointing.rank_shards import replace_prefix_for_sharding
from megatron_ext.pipeline_parallel.schedule_tables import stage_location, virtual_stage
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict
from megatron_ext.transformer.transformer_config import TransformerConfig
from megatron_ext.ssm.mamba_layer import MambaLayer
from megatron_ext.transformer.transformer_layer import ParallelTransformerLayer
from megatron_ext.transformer.utils import build_seeded, layer_norm


def _pipeline_sizes(config: TransformerConfig) -> tuple[int, int]:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp is None:
        vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return pp, vp or 1


def layers_per_virtual_stage(config: TransformerConfig, pp_size: int, vp_size: int = 1) -> list[int]:
    """How many transformer layers each virtual stage holds, in pipeline order. Which model chunk
    holds which virtual stage is parallel_state's pipeline layout: ``c * pp_size + r`` for chunk
    ``c`` of pipeline rank ``r`` (Megatron-core's interleaved assignment), or ZB-V's V.

    Megatron-core's splits: ``num_layers_in_first_pipeline_stage`` / ``..._last_...`` fix the
    first / last rank's layers and the other ranks share the rest equally; else
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` count the
    embedding / loss as one layer of the first / last virtual stage; else every virtual stage holds
    ``num_layers / (pp * vp)``. A rank's layers are split equally over its chunks. A split that does
    not come out even raises ValueError.
    """
    num_layers = config.num_layers
    first = getattr(config, "num_layers_in_first_pipeline_stage", None)
    last = getattr(config, "num_layers_in_last_pipeline_stage", None)
    if pp_size > 1 and (first is not None or last is not None):
        middle_ranks = pp_size - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0 or (middle_ranks == 0 and middle_layers != 0) or (
            middle_ranks > 0 and middle_layers % middle_ranks != 0
        ):
            raise ValueError(
                f"num_layers {num_layers} minus num_layers_in_first/last_pipeline_stage ({first}, {last}) "
                f"cannot be split equally over the {middle_ranks} other pipeline stages"
            )
        per_rank = [middle_layers // middle_ranks if middle_ranks else 0] * pp_size
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        for r, n in enumerate(per_rank):
            if n % vp_size != 0:
                raise ValueError(
                    f"pipeline stage {r} holds {n} layers, not divisible by the virtual pipeline "
                    f"size {vp_size}"
                )
        layout = parallel_state.get_pipeline_model_parallel_layout() if vp_size > 1 else "interleaved"
        return [per_rank[stage_location(s, pp_size, layout)[0]] // vp_size for s in range(pp_size * vp_size)]
    extra_first = bool(getattr(config, "account_for_embedding_in_pipeline_split", False))
    extra_last = bool(getattr(config, "account_for_loss_in_pipeline_split", False))
    total = num_layers + extra_first + extra_last
    stages = pp_size * vp_size
    if total % stages != 0:
        what = "num_layers" + (" + 1 (embedding)" if extra_first else "")
        what += " + 1 (loss)" if extra_last else ""
        raise ValueError(
            f"{what} = {total} is not divisible by pipeline_model_parallel_size x virtual pipeline size "
            f"= {pp_size} x {vp_size}"
        )
    counts = [total // stages] * stages
    counts[0] -= extra_first
    counts[-1] -= extra_last
    return counts


def get_num_layers_to_build(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> int:
    """The number of transformer layers of model chunk ``vp_stage`` of pipeline rank ``pp_rank``
    (default: this rank)."""
    pp, vp = _pipeline_sizes(config)
    return layers_per_virtual_stage(config, pp, vp)[_virtual_stage(vp_stage, pp_rank, pp, vp)]


def get_transformer_layer_offset(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> int:
    """The global index of the first transformer layer of model chunk ``vp_stage`` of pipeline
    rank ``pp_rank`` (default: this rank)."""
    pp, vp = _pipeline_sizes(config)
    return sum(layers_per_virtual_stage(config, pp, vp)[: _virtual_stage(vp_stage, pp_rank, pp, vp)])


def _virtual_stage(vp_stage: int | None, pp_rank: int | None, pp_size: int, vp_size: int) -> int:
    """The virtual stage of model chunk ``vp_stage`` of pipeline rank ``pp_rank`` (default: this
    rank), in parallel_state's pipeline layout."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    if vp_size == 1:
        return pp_rank
    if vp_stage is None or not 0 <= vp_stage < vp_size:
        raise ValueError(
            f"vp_stage must be a model chunk index in [0, {vp_size}) with a virtual pipeline of "
            f"size {vp_size}, got {vp_stage!r}"
        )
    return virtual_stage(pp_rank, vp_stage, pp_size, parallel_state.get_pipeline_model_parallel_layout())


class ParallelTransformer(torch.nn.Module):
    """This pipeline stage's layers (``num_layers / pp``, or model chunk ``vp_stage``'s share as
    ``get_num_layers_to_build`` says), and the final normalisation on the last stage.
    ``rotary_pos_emb`` (optional angles from ``transformer.rotary.RotaryEmbedding``) and
    ``packed_seq_params`` (Megatron-core's ``PackedSeqParams`` of packed rows) reach every layer's
    attention.

    On stages other than the first, the input comes from ``set_input_tensor`` (the activation
    received from the previous stage), as in Megatron-core. With
    ``config.recompute_granularity == "full"`` the layers chosen by ``recompute_method`` and
    ``recompute_num_layers`` are recomputed in the backward pass through
    ``tensor_parallel.checkpoint``, which replays the forward's RNG states; "selective"
    recomputation happens inside each layer (``ParallelTransformerLayer``).

    Under ``config.sequence_parallel`` the hidden states are ``[s / tp, b, h]`` and the whole
    stack runs on the model-parallel RNG stream (Megatron-core's TransformerBlock): dropout on
    sequence-sharded activations must differ across tensor-parallel ranks.

    ``init_seed``: when given, layer ``i`` (global index) is built from the CPU generator seeded
    with ``init_seed + i + 1`` so that its weights do not depend on the pipeline layout.

    ``layer_types`` (a hybrid stack, Megatron-core's ``MambaStack``): one symbol per global layer,
    ``"M"`` a ``MambaLayer``, ``"*"`` attention only, ``"-"`` an MLP only, ``"E"`` a mixture of experts
    only; None: every layer a transformer layer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        init_seed: int | None = None,
        vp_stage: int | None = None,
        *,
        layer_types: list[str] | None = None,
    ):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.input_tensor: torch.Tensor | None = None
        offset = get_transformer_layer_offset(config, vp_stage)
        layers = []
        for i in range(offset, offset + get_num_layers_to_build(config, vp_stage)):
            kind = None if layer_types is None else layer_types[i]
            if kind == "M":
                build = partial(MambaLayer, config, layer_number=i + 1)
            else:
                build = partial(ParallelTransformerLayer, config, layer_number=i + 1, layer_type=kind)
            layers.append(build_seeded(config, init_seed, i + 1, build))
        self.layers = torch.nn.ModuleList(layers)
        if post_process:  # ones and zeros: no seed
            self.final_layernorm = build_seeded(
                config, None, 0, partial(layer_norm, config, config.hidden_size)
            )

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.input_tensor = input_tensor

    def _recompute_plan(self) -> list[tuple[int, int, bool]]:
        """This stage's layers as ``(start, end, recomputed)`` runs. Full recomputation while
        training (Megatron-core's methods): ``uniform`` checkpoints every chunk of
        ``recompute_num_layers`` consecutive layers as one unit (only the chunk's input kept),
        ``block`` checkpoints each of the first ``recompute_num_layers`` layers of the stage and
        runs the rest as usual."""
        n = len(self.layers)
        config = self.config
        if config.recompute_granularity != "full" or not self.training:
            return [(0, n, False)]
        k = config.recompute_num_layers
        if config.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        return [(i, i + 1, True) for i in range(min(k, n))] + ([(k, n, False)] if k < n else [])

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: the layers by global layer number, stacked along a leading
        layer axis (``decoder.layers.<name>``) or, with ``metadata["non_homogeneous_layers"]`` or
        ``["singleton_local_shards"]`` or dense and MoE layers mixed (``moe_layer_freq``), one
        key per layer (``layers.<N>.<name>``)."""
        return block_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params=None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``padding_mask`` [b, s] (True at padding) goes to every layer's mixture of experts."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise RuntimeError(
                "ParallelTransformer: no input (on a later pipeline stage call set_input_tensor first)"
            )
        rng_context = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng_context:
            return self._run_layers(
                hidden_states, attention_mask, rotary_pos_emb, packed_seq_params, padding_mask
            )

    def _run_layers(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
        packed_seq_params=None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for start, end, recompute in self._recompute_plan():
            def run(h: torch.Tensor, start: int = start, end: int = end) -> torch.Tensor:
                for layer in self.layers[start:end]:
                    h = layer(h, attention_mask, rotary_pos_emb=rotary_pos_emb,
                              packed_seq_params=packed_seq_params, padding_mask=padding_mask)
                return h

            if recompute:
                hidden_states = tensor_parallel.checkpoint(run, False, hidden_states)
            else:
                hidden_states = run(hidden_states)
        if self.post_process:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


def _per_layer_keys(config: TransformerConfig, metadata: dict | None) -> bool:
    """One key per layer where asked, or where the layers differ: dense and mixture-of-experts
    layers mixed by ``moe_layer_freq`` (an int above 1 or any list, as Megatron-core decides)."""
    metadata = metadata or {}
    freq = getattr(config, "moe_layer_freq", 1)
    mixed = getattr(config, "num_moe_experts", None) is not None and (
        isinstance(freq, (list, tuple)) or (isinstance(freq, int) and freq > 1)
    )
    return bool(mixed or metadata.get("non_homogeneous_layers") or metadata.get("singleton_local_shards"))


def block_sharded_state_dict(
    block: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> ShardedStateDict:
    """``ParallelTransformer.sharded_state_dict``: the layers by global layer number (see the
    module docstring), then the block's other tensors (the final norm)."""
    if sharded_offsets:
        raise ValueError(f"a transformer block takes no sharded_offsets, got {sharded_offsets}")
    out: ShardedStateDict = {}
    num_layers = block.config.num_layers
    for local_index, layer in enumerate(block.layers):
        number = layer.layer_number - 1
        state_prefix = f"{prefix}layers.{local_index}."
        if _per_layer_keys(block.config, metadata):
            sharded_prefix, offsets = f"{prefix}layers.{number}.", ()
        else:
            sharded_prefix, offsets = f"{prefix}layers.", ((0, number, num_layers),)
        layer_dict = layer.sharded_state_dict(state_prefix, offsets, metadata)
        replace_prefix_for_sharding(layer_dict, state_prefix, sharded_prefix)
        out.update(layer_dict)
    out.update(module_sharded_state_dict(block, prefix, skip=("layers",)))
    return out
