"""Megatron-core's ``MambaModel``: the GPT model whose decoder is a hybrid stack of Mamba-2, attention,
MLP and mixture-of-experts layers laid out by a pattern (Nemotron-H, Granite 4, Mamba-2 models)."""

from __future__ import annotations

from typing import Any

from megatron_ext.models.gpt import GPTModel
from megatron_ext.ssm.mamba_hybrid_layer_allocation import allocate_layers


class MambaModel(GPTModel):
    """Megatron-core's ``MambaModel(config, mamba_stack_spec, vocab_size, max_sequence_length,
    pre_process=True, hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0, hybrid_override_pattern=None,
    post_process=True, fp16_lm_cross_entropy=False, parallel_output=True,
    share_embeddings_and_output_weights=False, position_embedding_type="none", rotary_percent=1.0,
    rotary_base=10000, scatter_embedding_sequence_parallel=True, seq_len_interpolation_factor=None,
    pg_collection=None)``, with GPTModel's ``init_seed`` and ``vp_stage`` as keywords.

    The layers are ``allocate_layers(config.num_layers, hybrid_attention_ratio, hybrid_mlp_ratio,
    hybrid_override_pattern)``: ``M`` a Mamba-2 layer (``ssm.MambaLayer``), ``*`` attention, ``-`` an
    MLP, ``E`` a mixture of experts, each with its pre-norm and residual, cut into pipeline stages as
    the transformer layers are (interleaved too, which Megatron-core's ``MambaStack`` refuses); the
    final norm is megatron_ext's. ``forward`` is GPTModel's, ``loss_mask`` included.
    ``mamba_stack_spec`` must be None (megatron_ext builds its own stack); ``pre_process`` and
    ``post_process`` default, as GPTModel's do, to this pipeline stage's place."""

    def __init__(
        self,
        config: Any,
        mamba_stack_spec: Any = None,
        vocab_size: int | None = None,
        max_sequence_length: int | None = None,
        pre_process: bool | None = None,
        hybrid_attention_ratio: float = 0.0,
        hybrid_mlp_ratio: float = 0.0,
        hybrid_override_pattern: str | None = None,
        post_process: bool | None = None,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        pg_collection: Any = None,
        *,
        init_seed: int | None = None,
        vp_stage: int | None = None,
    ) -> None:
        for what, value, default in (
            ("mamba_stack_spec", mamba_stack_spec, None),
            ("fp16_lm_cross_entropy", fp16_lm_cross_entropy, False),
            ("scatter_embedding_sequence_parallel", scatter_embedding_sequence_parallel, True),
            ("pg_collection", pg_collection, None),
        ):
            if value != default:
                raise NotImplementedError(f"MambaModel: {what}={value!r} is not supported by megatron_ext")
        if vocab_size is None or max_sequence_length is None:
            raise TypeError("MambaModel needs vocab_size and max_sequence_length")
        if getattr(config, "mtp_num_layers", None) is not None:
            raise NotImplementedError(
                "MambaModel: multi-token prediction is not supported by megatron_ext yet"
            )
        layer_types = allocate_layers(
            config.num_layers, hybrid_attention_ratio, hybrid_mlp_ratio, hybrid_override_pattern
        )
        object.__setattr__(self, "_layer_types", list(layer_types))
        super().__init__(
            config,
            vocab_size,
            max_sequence_length,
            pre_process,
            post_process,
            share_embeddings_and_output_weights,
            parallel_output,
            init_seed,
            vp_stage,
            position_embedding_type,
            rotary_percent,
            rotary_base,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
        )
        self.hybrid_attention_ratio, self.hybrid_mlp_ratio = hybrid_attention_ratio, hybrid_mlp_ratio
        self.hybrid_override_pattern = hybrid_override_pattern
