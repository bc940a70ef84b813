"""A GPT built from the parallel transformer, split into pipeline stages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.comm_errors import reported
from megatron_ext.dist_checkpointing.mapping import ShardedStateDict
from megatron_ext.dist_checkpointing.rank_shards import make_tp_sharded_tensor_for_checkpoint
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict
from megatron_ext.tensor_parallel.meta_init import materialize
from megatron_ext.tensor_parallel.utils import comm_device, param_device
from megatron_ext.transformer import ParallelTransformer, TransformerConfig
from megatron_ext.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    MultiTokenPredictionBlock,
    roll_tensor,
)
from megatron_ext.transformer.rotary import RotaryEmbedding
from megatron_ext.transformer.utils import build_seeded, initialization_seed
from megatron_ext.transformer.yarn_rotary import YarnRotaryEmbedding, yarn_arguments

TIED_EMBEDDING_NAME = "embedding.word_embeddings.weight"


def packed_rotary_len(packed_seq_params) -> int:
    """The positions the rotary angles of a packed row need: its longest sequence, padded
    (``max_seqlen_q`` / ``max_seqlen_kv``, and the boundaries themselves)."""
    lengths = [packed_seq_params.max_seqlen_q or 0, packed_seq_params.max_seqlen_kv or 0]
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        bounds = getattr(packed_seq_params, name)
        if bounds is not None and bounds.numel() > 1:
            lengths.append(int((bounds[1:] - bounds[:-1]).max()))
    return max(lengths)
_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")


class GPTEmbedding(torch.nn.Module):
    """Vocab-parallel word embedding (+ learned position embedding with ``position_embedding_type``
    ``"learned_absolute"``) + dropout -> ``[s, b, h]``.

    Under sequence parallelism the output is this rank's ``[s / tp, b, h]`` slice of the
    sequence (scattered along dim 0), and its dropout draws from the model-parallel RNG stream:
    each rank drops different positions of different tokens, as in Megatron-core.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
    ):
        super().__init__()
        self.config = config
        self.max_sequence_length = max_sequence_length
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.init_method, config=config
        )
        self.position_embeddings = None
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype
            )
            if config.perform_initialization:
                config.init_method(self.position_embeddings.weight.data)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids.size(-1) > self.max_sequence_length:
            raise ValueError(
                f"sequence length {input_ids.size(-1)} exceeds max_sequence_length {self.max_sequence_length}"
            )
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                raise ValueError("position_ids are needed with learned absolute position embeddings")
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout(
                    embeddings, p=self.config.hidden_dropout, training=self.training
                )
        return torch.nn.functional.dropout(embeddings, p=self.config.hidden_dropout, training=self.training)


class GPTModel(torch.nn.Module):
    """Decoder-only language model; one instance per pipeline stage, or with a virtual pipeline
    one per model chunk (``vp_stage``: chunk c of pipeline rank r holds virtual stage ``c * pp + r``
    and its layers, ``transformer_block.get_transformer_layer_offset``; only chunk 0 of the first
    stage embeds, only the last chunk of the last stage computes the loss).

    The first stage (``pre_process``) embeds tokens; the last (``post_process``) applies the final
    normalisation and computes vocab-parallel logits with the word-embedding matrix (or, with
    ``share_embeddings_and_output_weights=False``, an output matrix of its own), never gathering
    them: with ``labels`` the forward returns the per-token loss ``[b, s]`` from
    ``vocab_parallel_cross_entropy`` with ``overwrite_logits=True``, whose backward writes the
    gradient over the logits nobody else reads (or, with ``config.fused_output_cross_entropy``, from
    ``vocab_parallel_linear_cross_entropy``, which never holds the logits), without them the logits
    ``[b, s, vocab / tp]``. When the
    first and last stages differ, the last stage holds its own copy of the word embedding, made
    equal to the first stage's at construction and kept equal by summing their gradients over the
    embedding group (``megatron_ext.distributed.finalize_model_grads``).

    Weights are drawn from the CPU generator: component ``k`` (the embedding, each layer by its
    global index, the output layer) from ``init_seed + k``, so a layer's weights do not depend on
    which stage builds it. ``init_seed`` defaults to ``torch.initial_seed()`` (what
    ``torch.manual_seed`` last set). With ``config.use_cpu_initialization`` every parallel layout
    therefore starts from the serial model's weights.

    Positions, as Megatron-core's ``GPTModel`` takes them: ``position_embedding_type``
    ``"learned_absolute"`` (a learned table added to the word embedding), ``"rope"`` (rotary
    embeddings of the queries and keys in every layer, with ``rotary_percent``, ``rotary_base``,
    ``seq_len_interpolation_factor`` and ``config.rotary_interleaved``; positions ``0 .. s - 1``,
    ``position_ids`` are not read), ``"yarn"`` (the same with YaRN's angles and attention factor,
    ``transformer.yarn_rotary``, its settings read from the config's attributes
    ``yarn_rotary_scaling_factor``, ``yarn_original_max_position_embeddings``, ``yarn_beta_fast``,
    ``yarn_beta_slow``, ``yarn_mscale``, ``yarn_mscale_all_dim`` and
    ``yarn_correction_range_round_to_int``, as Megatron-core's) or ``"none"``.

    ``packed_seq_params`` (Megatron-core's ``PackedSeqParams``, ``qkv_format="thd"``): each row of
    ``input_ids`` is packed sequences that never attend to each other, rotated from position 0 each
    (learned positions read ``position_ids``, which then restart per sequence too); under context
    parallelism every sequence is split into 2 * cp chunks on its own
    (``megatron_ext.utils.get_thd_batch_on_this_cp_rank``).
    """

    # A hybrid stack's layer symbols (MambaModel's), one per global layer; None: transformer layers.
    _layer_types: list[str] | None = None

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        share_embeddings_and_output_weights: bool = True,
        parallel_output: bool = True,
        init_seed: int | None = None,
        vp_stage: int | None = None,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        seq_len_interpolation_factor: float | None = None,
        mtp_block_spec=None,
    ):
        super().__init__()
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={position_embedding_type!r} is not one of "
                f"{list(_POSITION_EMBEDDING_TYPES)}"
            )
        self.config = config
        self.position_embedding_type = position_embedding_type
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.vp_stage = vp_stage
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        seed = torch.initial_seed() if init_seed is None else init_seed
        # Multi-token prediction on the chunk that computes the loss (Megatron-core's placement).
        self.mtp_process = getattr(config, "mtp_num_layers", None) is not None and self.post_process
        _check_mtp_layout(config, position_embedding_type, mtp_block_spec)

        if self.pre_process or self.mtp_process:
            self.embedding = build_seeded(
                config, seed, 0,
                lambda: GPTEmbedding(config, vocab_size, max_sequence_length, position_embedding_type),
            )
        # Multi-latent attention rotates in each layer (its own angles, Megatron-core's MLA).
        if position_embedding_type == "rope" and not getattr(config, "multi_latent_attention", False):
            # Every stage rotates its own layers' queries and keys.
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
            )
        elif position_embedding_type == "yarn" and not getattr(config, "multi_latent_attention", False):
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.kv_channels,
                rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                **yarn_arguments(config),
            )
        self.decoder = ParallelTransformer(
            config, self.pre_process, self.post_process, init_seed=seed, vp_stage=vp_stage,
            layer_types=self._layer_types,
        )
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(config, vp_stage=vp_stage, init_seed=seed)
        if self.post_process:
            # The output layer reads the embedding (or its copy on this stage) when tied.
            tied_here = (self.pre_process or self.mtp_process) and share_embeddings_and_output_weights
            self.output_layer = build_seeded(
                config, seed, config.num_layers + 1,
                lambda: tensor_parallel.ColumnParallelLinear(
                    config.hidden_size,
                    vocab_size,
                    config=config,
                    init_method=config.init_method,
                    bias=False,
                    gather_output=not parallel_output,
                    skip_weight_param_allocation=tied_here,
                ),
            )
        self._setup_tied_output_weight(seed)

    def _setup_tied_output_weight(self, seed: int) -> None:
        """Makes the last stage's copy of the word embedding (the tied output weight, or the
        embedding multi-token prediction reads) equal to the first stage's."""
        mtp = getattr(self.config, "mtp_num_layers", None) is not None
        if mtp and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            _check_embedding_copy_reachable()
        if not self.share_embeddings_and_output_weights and not mtp:
            return
        if self.pre_process and self.post_process:
            return  # one stage: the output layer reads the embedding weight itself
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return
        if not (self.pre_process or self.post_process):
            return  # a middle model chunk holds no copy
        if not parallel_state.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=self.vp_stage):
            return
        weight = self.shared_embedding_or_output_weight()
        if weight.is_meta:
            # The copy is made now, over the embedding group: its module is drawn here, not by the
            # sharding wrapper later.
            holder = self.embedding if self.pre_process or self.mtp_process else self.output_layer
            materialize(holder, param_device(True))
        weight.shared_embedding = True
        if self.post_process:
            # The copy: counted once in the gradient norm (Megatron's ``shared`` attribute).
            weight.shared = True
            if parallel_state.get_pipeline_model_parallel_layout() == "v":
                # The first stage is model chunk 0 of this rank: draw the embedding it draws.
                with initialization_seed(seed, 0):
                    first = GPTEmbedding(
                        self.config, self.vocab_size, self.max_sequence_length, self.position_embedding_type
                    )
                weight.data.copy_(first.word_embeddings.weight.data)
                return
            weight.data.zero_()
        group = parallel_state.get_embedding_group()
        device = comm_device(group)  # the model may still be on the CPU when NCCL moves CUDA tensors
        data = weight.data if weight.device == device else weight.data.to(device)
        with reported("all-reduce of the tied word embedding at initialisation", group, tensor=data):
            dist.all_reduce(data, group=group)
        if data is not weight.data:
            weight.data.copy_(data)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """The word-embedding matrix on the first stage, its copy on the last (the tied output
        weight, or multi-token prediction's embedding), else None."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process and self.share_embeddings_and_output_weights:
            return self.output_layer.weight
        return None

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor per stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: every tensor as a ShardedTensor under its global name (layer
        numbering: see ``ParallelTransformer.sharded_state_dict``); a tied output weight on the last
        stage is a non-main replica of ``embedding.word_embeddings.weight``."""
        return gpt_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        packed_seq_params=None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``loss_mask`` (``[b, s]``, default all ones) weighs the tokens of the multi-token
        prediction losses, as in Megatron-core (the main loss is returned per token, unweighted).
        ``padding_mask`` (``[b, s]``, True at padding) reaches the mixture-of-experts routers, which
        leave those tokens out of their losses and counts; under sequence parallelism each rank
        takes its share of the sequence (on every pipeline stage)."""
        if getattr(self.config, "init_model_with_meta_device", False) and next(self.parameters()).is_meta:
            raise ValueError(
                f"{type(self).__name__}: built with init_model_with_meta_device=True, its parameters are "
                "still on the meta device: wrap it in FullyShardedDataParallel (a sharding strategy), which "
                "draws them, before running it"
            )
        if padding_mask is not None and self.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            padding_mask = padding_mask.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else None
        rotary_pos_emb = self._rotary_angles(input_ids, packed_seq_params)
        hidden = self.decoder(
            hidden, attention_mask, rotary_pos_emb, packed_seq_params, padding_mask=padding_mask
        )
        if not self.post_process:
            return hidden
        weight = (
            self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        )
        if labels is None:
            logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, vocab (/ tp if parallel_output)]
            return logits.transpose(0, 1).contiguous()
        if self.mtp_process:
            hidden = self._attach_mtp_losses(
                hidden, input_ids, position_ids, labels, loss_mask, weight,
                (attention_mask, rotary_pos_emb, packed_seq_params),
            )
        return self._language_model_loss(hidden, labels, weight)

    def _rotary_angles(self, input_ids: torch.Tensor | None, packed_seq_params) -> torch.Tensor | None:
        """The rotary angles every layer of this stage reads (None without a model-wide rotary
        embedding: learned or no positions, or multi-latent attention's own per layer)."""
        if not hasattr(self, "rotary_pos_emb"):
            return None
        if packed_seq_params is not None:
            # Every packed sequence from position 0: the angles of the longest one's positions, of
            # which each layer takes a sequence's own (on every cp rank: chunks of each sequence).
            device = input_ids.device if self.pre_process else self.decoder.input_tensor.device
            angles = self.rotary_pos_emb(packed_rotary_len(packed_seq_params), device=device, packed_seq=True)
            return angles[0] if isinstance(angles, tuple) else angles
        if self.pre_process:
            seq_len, device = input_ids.size(1), input_ids.device
        else:
            received = self.decoder.input_tensor
            if received is None:
                raise RuntimeError(
                    "GPTModel: no input (on a later pipeline stage call set_input_tensor first)"
                )
            seq_len, device = received.size(0), received.device
            if self.config.sequence_parallel:
                seq_len *= parallel_state.get_tensor_model_parallel_world_size()
        # The angles of the whole sequence, of which the embedding keeps this cp rank's chunks.
        cp_group = self.rotary_pos_emb.cp_group
        seq_len *= cp_group.size() if cp_group is not None else 1
        angles = self.rotary_pos_emb(seq_len, device=device)
        return angles[0] if isinstance(angles, tuple) else angles  # YaRN's comes with its factor

    def _language_model_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None
    ) -> torch.Tensor:
        """The per-token loss ``[b, s]`` of ``labels`` under the output layer's logits of ``hidden``."""
        if self.config.fused_output_cross_entropy:
            group = self.output_layer.tp_group
            if self.config.sequence_parallel:
                # The fused op all-reduces the hidden states' gradient itself, so the gather's
                # backward only takes this rank's slice of it.
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    hidden, tensor_parallel_output_grad=False, group=group
                )
            loss = tensor_parallel.vocab_parallel_linear_cross_entropy(
                hidden,
                self.output_layer.weight if weight is None else weight,
                labels.transpose(0, 1),
                tp_group=group,
            )
            return loss.transpose(0, 1).contiguous()  # [b, s]
        # The loss reads vocab-parallel logits whatever parallel_output says. Nothing else reads
        # them, so the loss's backward writes the gradient over them (no second logits buffer).
        logits, _ = self.output_layer(hidden, weight=weight, runtime_gather_output=False)
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1), overwrite_logits=True
        )
        return loss.transpose(0, 1).contiguous()  # [b, s]

    def _attach_mtp_losses(
        self, hidden: torch.Tensor, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
        labels: torch.Tensor, loss_mask: torch.Tensor | None, weight: torch.Tensor | None, layer_args: tuple,
    ) -> torch.Tensor:
        """Runs the multi-token prediction depths and attaches their losses to ``hidden`` (Megatron-core's
        ``_postprocess``): depth k's loss is the mean, over the tokens ``loss_mask`` keeps k + 1 places
        ahead, of the cross-entropy of the labels k + 1 places ahead, times ``mtp_loss_scaling_factor /
        mtp_num_layers`` (per token with ``calculate_per_token_loss``: the sum). Over a context-parallel
        group each rank's share is its sum over the group's token count, times cp (its share of the
        data-parallel average over dp x cp); Megatron-core divides by each rank's own count, which differs
        between ranks by the masked end positions, so its loss there is not the serial one."""
        if input_ids is None:
            raise RuntimeError(
                "GPTModel: multi-token prediction embeds the input tokens on the last pipeline stage; pass "
                "input_ids there too"
            )
        config = self.config
        if position_ids is None:
            position_ids = torch.zeros_like(input_ids)
        depths = self.mtp(input_ids, position_ids, hidden, *layer_args, embedding=self.embedding)
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        cp = cp_group.size() if cp_group is not None else 1
        packed_seq_params = layer_args[2]
        mask = loss_mask
        if mask is None:
            mask = torch.ones(labels.shape, dtype=torch.float64, device=labels.device)
        factor = config.mtp_loss_scaling_factor / config.mtp_num_layers
        per_token = bool(getattr(config, "calculate_per_token_loss", False))
        for depth, depth_hidden in enumerate(depths):
            labels, _ = roll_tensor(labels, -1, -1, cp_group, packed_seq_params)
            mask, count = roll_tensor(mask, -1, -1, cp_group, packed_seq_params)
            total = (self._language_model_loss(depth_hidden, labels, weight) * mask).sum()
            count = count.detach().to(torch.float64)
            if cp > 1:
                count = count.clone()
                with reported("all-reduce of the multi-token prediction token count", cp_group, tensor=count):
                    dist.all_reduce(count, group=cp_group)
            mean = total * cp / count.clamp(min=1).to(total.dtype)
            if self.training:
                MTPLossLoggingHelper.save_loss_to_tracker(
                    mean, depth, config.mtp_num_layers,
                    avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
                )
            hidden = MTPLossAutoScaler.apply(hidden, factor * (total if per_token else mean))
        return hidden


def _check_mtp_layout(config: TransformerConfig, position_embedding_type: str, mtp_block_spec) -> None:
    """What multi-token prediction needs of the model (the same on every rank)."""
    if mtp_block_spec is not None:
        raise TypeError(
            "GPTModel builds its multi-token prediction block from config.mtp_num_layers (each depth's layer "
            f"like the decoder's last); module specs are not supported, got mtp_block_spec={mtp_block_spec!r}"
        )
    if getattr(config, "mtp_num_layers", None) is None:
        return
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if position_embedding_type == "learned_absolute" and pp > 1:
        raise ValueError(
            "multi-token prediction (mtp_num_layers) with learned absolute positions needs the position "
            "embedding on the last pipeline stage, where nothing keeps a copy equal to the first "
            "stage's: use position_embedding_type 'rope' or 'none', or pipeline_model_parallel_size 1"
        )


def _check_embedding_copy_reachable() -> None:
    """Multi-token prediction on the last pipeline stage reads a copy of the word embedding that the
    embedding group keeps equal to the first stage's. Every stage of the pipeline knows that group's
    ranks, so all raise the same error without a collective (a collective here, once per model
    chunk, would not pair with the tied-embedding all-reduce of the other ranks' chunks)."""
    # The last virtual stage: on the last pipeline rank, or on the first in ZB-V's V layout.
    holder = (parallel_state.get_pipeline_model_parallel_first_rank()
              if parallel_state.get_pipeline_model_parallel_layout() == "v"
              else parallel_state.get_pipeline_model_parallel_last_rank())
    if holder not in parallel_state.get_pipeline_embedding_ranks():
        raise RuntimeError(
            "multi-token prediction (mtp_num_layers) runs on the last pipeline stage, which is not in the "
            "embedding group (get_embedding_ranks of initialize_model_parallel): its copy of the word "
            "embedding could not be kept equal to the first stage's; keep the last stage in that group"
        )


def gpt_sharded_state_dict(
    model: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> ShardedStateDict:
    """``GPTModel.sharded_state_dict``: embedding, decoder (``block_sharded_state_dict``),
    multi-token prediction depths (``mtp.layers.<k>.``), output layer. The last stage's copy of the
    word embedding (a tied output weight, or multi-token prediction's embedding) is a non-main
    replica of the first stage's ``embedding.word_embeddings.weight`` (loaded, not saved), as in
    Megatron-core."""
    if sharded_offsets:
        raise ValueError(f"GPTModel takes no sharded_offsets, got {sharded_offsets}")
    out = module_sharded_state_dict(model, prefix, skip=("decoder", "output_layer", "mtp"))
    out.update(model.decoder.sharded_state_dict(f"{prefix}decoder.", (), metadata))
    replica = (1, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))
    if getattr(model, "mtp_process", False):
        out.update(model.mtp.sharded_state_dict(f"{prefix}mtp.", (), metadata))
        if not model.pre_process:
            weight, key = model.embedding.word_embeddings.weight, prefix + TIED_EMBEDDING_NAME
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                weight, key, weight.partition_dim % weight.dim(), replica_id=replica
            )
    output_layer = getattr(model, "output_layer", None)
    if output_layer is None:
        return out
    out.update(module_sharded_state_dict(output_layer, f"{prefix}output_layer."))
    weight_key = f"{prefix}output_layer.weight"
    if model.share_embeddings_and_output_weights and weight_key in out and not model.pre_process:
        weight = output_layer.weight
        out[weight_key] = make_tp_sharded_tensor_for_checkpoint(
            weight,
            prefix + TIED_EMBEDDING_NAME,
            weight.partition_dim % weight.dim(),
            replica_id=replica,
        )
    return out
