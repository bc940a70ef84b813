"""One pre-normalisation transformer layer."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext import tensor_parallel
from megatron_ext.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_ext.transformer.gated_delta_net import GatedDeltaNet
from megatron_ext.tensor_parallel.sharded_state import renamed_key, renamed_sharded_state_dict
from megatron_ext.transformer.attention import ATTENTION_KEYS, ParallelAttention
from megatron_ext.transformer.mlp import MLP_KEYS, ParallelMLP
from megatron_ext.transformer.moe.moe_layer import MoELayer
from megatron_ext.transformer.multi_latent_attention import MLA_KEYS, MLASelfAttention
from megatron_ext.transformer.transformer_config import TransformerConfig
from megatron_ext.transformer.utils import layer_norm, linear_attention_pattern, selectively_recomputed

# The layer's tensor names -> Megatron-core's checkpoint keys (the layer norms are stored under the
# linear they feed, as Megatron-core's local and Transformer Engine specs both store them).
LAYER_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "post_attention_layernorm.": "mlp.linear_fc1.layer_norm_",
    **{f"self_attention.{k}": f"self_attention.{v}" for k, v in ATTENTION_KEYS.items()},
    **{f"mlp.{k}": f"mlp.{v}" for k, v in MLP_KEYS.items()},
}


# A mixture-of-experts layer stores its second norm on its own, as Megatron-core's MoE specs do.
MOE_LAYER_KEYS = {**LAYER_KEYS, "post_attention_layernorm.": "pre_mlp_layernorm."}
# A multi-latent attention layer stores its first norm on its own too (its first linears are the
# down projections), and each latent norm with the up projection it feeds.
MLA_LAYER_KEYS = {
    "post_attention_layernorm.": "mlp.linear_fc1.layer_norm_",
    **{f"self_attention.{k}": f"self_attention.{v}" for k, v in MLA_KEYS.items()},
    **{f"mlp.{k}": f"mlp.{v}" for k, v in MLP_KEYS.items()},
}
MLA_MOE_LAYER_KEYS = {**MLA_LAYER_KEYS, "post_attention_layernorm.": "pre_mlp_layernorm."}


def is_moe_layer(config: TransformerConfig, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, global) is a mixture-of-experts layer:
    ``moe_layer_freq`` k makes every k-th layer one (layers 1, k + 1, ...), a list of 0/1 is the
    pattern itself (Megatron-core's rule). The multi-token prediction layers (numbers past
    ``num_layers``) are built like the last layer, as Megatron-core's MTP spec builds them."""
    if getattr(config, "num_moe_experts", None) is None:
        return False
    layer_number = min(layer_number, config.num_layers)
    freq = config.moe_layer_freq
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return (layer_number - 1) % freq == 0
    if isinstance(freq, (list, tuple)) and len(freq) == config.num_layers and set(freq) <= {0, 1}:
        return bool(freq[layer_number - 1])
    raise ValueError(
        f"moe_layer_freq must be a positive integer or a list of num_layers ({config.num_layers}) 0/1 "
        f"entries, got {freq!r}"
    )


def megatron_core_name(name: str) -> str:
    """A GPTModel tensor's name (``decoder.layers.<N>.<name>`` or stacked ``decoder.layers.<name>``)
    as Megatron-core's key."""
    head, sep, rest = name.partition("decoder.layers.")
    if not sep:
        return name
    number, dot, inner = rest.partition(".")
    if not (number.isdigit() and dot):
        number, dot, inner = "", "", rest
    return f"{head}{sep}{number}{dot}{renamed_key(inner, LAYER_KEYS)}"


class ParallelTransformerLayer(torch.nn.Module):
    """x + dropout(attention(LN(x))), then + dropout(MLP(LN(.))), with bias-dropout-add residuals
    (LN: ``config.normalization``, LayerNorm or RMSNorm).

    Normalisation parameters are replicated on every tensor-parallel rank; without sequence
    parallelism each rank sees the same activations, so their gradients agree without
    communication. Under sequence parallelism the layer's input and output are ``[s / tp, b, h]``
    and the LayerNorm (and row-parallel bias) gradients are partial: see ``layer_norm``.

    With ``config.bias_dropout_fusion`` each bias + dropout + residual add is one kernel (forward
    and backward), its mask drawn from the default generator (see ``megatron_ext.fusions``).

    Selective recomputation (``recompute_granularity="selective"``, while training) follows
    ``config.recompute_modules``: ``"core_attn"`` keeps only q, k and v of the attention (see
    ``ParallelAttention``), ``"mlp"`` only the MLP's input, ``"layernorm"`` frees both
    normalisations' outputs once the next module has used them and recomputes them when the
    backward reaches that module's output.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, layer_type: str | None = None):
        super().__init__()
        if not isinstance(config.hidden_size, int) or config.hidden_size < 1:
            raise ValueError(
                f"a transformer layer needs config.hidden_size >= 1, got {config.hidden_size!r}"
            )
        if layer_type not in (None, "*", "-", "E"):
            raise ValueError(f"layer_type must be None, '*', '-' or 'E', got {layer_type!r}")
        self.config = config
        self.layer_number = layer_number
        # A hybrid stack's layer (Megatron-core's MambaStack): attention only ("*"), or an MLP ("-")
        # or mixture of experts ("E") only; None: both.
        self.layer_type = layer_type
        self.input_layernorm = self.self_attention = self.post_attention_layernorm = self.mlp = None
        if layer_type in (None, "*"):
            self.input_layernorm = layer_norm(config, config.hidden_size)
            mla = bool(getattr(config, "multi_latent_attention", False))
            pattern = linear_attention_pattern(config)  # multi-token-prediction layers: full attention
            if layer_number <= len(pattern) and pattern[layer_number - 1]:
                self.self_attention = GatedDeltaNet(config, layer_number=layer_number)
            else:
                self.self_attention = (MLASelfAttention if mla else ParallelAttention)(config, layer_number)
        if layer_type in (None, "-", "E"):
            self.post_attention_layernorm = layer_norm(config, config.hidden_size)
            if layer_type == "E" or (layer_type is None and is_moe_layer(config, layer_number)):
                self.mlp = MoELayer(config, layer_number=layer_number)
            else:
                self.mlp = ParallelMLP(config)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: each tensor as a ShardedTensor (``sharded_offsets``: the
        layer axis a block prepends) under Megatron-core's keys (``LAYER_KEYS``; a mixture-of-experts
        layer's: ``MOE_LAYER_KEYS`` and the ``MoELayer``'s own; a multi-latent attention layer's:
        ``MLA_LAYER_KEYS`` / ``MLA_MOE_LAYER_KEYS``)."""
        if self.layer_type is not None:
            raise NotImplementedError(
                "distributed checkpoints of a hybrid stack's layers are not supported by megatron_ext yet"
            )
        if isinstance(self.self_attention, GatedDeltaNet):
            self.self_attention.sharded_state_dict()  # refused, named
        mla = isinstance(self.self_attention, MLASelfAttention)
        if not isinstance(self.mlp, MoELayer):
            keys = MLA_LAYER_KEYS if mla else LAYER_KEYS
            return renamed_sharded_state_dict(self, prefix, sharded_offsets, keys, metadata)
        keys = MLA_MOE_LAYER_KEYS if mla else MOE_LAYER_KEYS
        out = renamed_sharded_state_dict(self, prefix, sharded_offsets, keys, metadata, skip=("mlp",))
        out.update(self.mlp.sharded_state_dict(f"{prefix}mlp.", sharded_offsets, metadata))
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params=None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``packed_seq_params``: Megatron-core's ``PackedSeqParams`` of a row of packed sequences
        (see ``ParallelAttention.forward``); the rest of the layer works token by token.
        ``padding_mask`` [b, s] (True at padding): for a mixture-of-experts MLP's router."""
        recompute_norm = self.training and selectively_recomputed(self.config, "layernorm")
        if self.self_attention is not None:
            hidden_states = self._attention_part(
                hidden_states, attention_mask, rotary_pos_emb, packed_seq_params, recompute_norm
            )
        if self.mlp is None:
            return hidden_states
        return self._mlp_part(hidden_states, padding_mask, recompute_norm)

    def _residual_settings(self) -> tuple[bool, float, Any]:
        config = self.config
        fused = bool(getattr(config, "bias_dropout_fusion", False))
        return (config.apply_residual_connection_post_layernorm, config.hidden_dropout,
                get_bias_dropout_add(self.training, fused))

    def _attention_part(
        self, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params, recompute_norm: bool
    ) -> torch.Tensor:
        post_ln_residual, dropout, bias_dropout_add = self._residual_settings()
        norm_checkpoint = tensor_parallel.CheckpointWithoutOutput() if recompute_norm else None
        ln_out = self._norm(self.input_layernorm, hidden_states, norm_checkpoint)
        if isinstance(self.self_attention, GatedDeltaNet):  # causal, no positions: Megatron-core's call
            attention = self.self_attention(ln_out, attention_mask, packed_seq_params=packed_seq_params)
        else:
            attention = self.self_attention(ln_out, attention_mask, rotary_pos_emb, packed_seq_params)
        attn_out, attn_bias = attention
        residual = ln_out if post_ln_residual else hidden_states
        hidden_states = bias_dropout_add((attn_out, attn_bias), residual, dropout)
        if norm_checkpoint is not None:
            # The normalised input is freed until the attention's backward reaches its input.
            norm_checkpoint.discard_output_and_register_recompute(attn_out)
        return hidden_states

    def _mlp_part(self, hidden_states, padding_mask, recompute_norm: bool) -> torch.Tensor:
        post_ln_residual, dropout, bias_dropout_add = self._residual_settings()
        # "mlp" is the dense MLP; an MoE layer recomputes by "moe", "moe_act" and "shared_experts".
        recompute_mlp = (self.training and selectively_recomputed(self.config, "mlp")
                         and not isinstance(self.mlp, MoELayer))
        norm_checkpoint = tensor_parallel.CheckpointWithoutOutput() if recompute_norm else None
        ln_out = self._norm(self.post_attention_layernorm, hidden_states, norm_checkpoint)
        if recompute_mlp:
            mlp_out, mlp_bias = self._checkpointed_mlp(ln_out)
        elif isinstance(self.mlp, MoELayer):
            mlp_out, mlp_bias = self.mlp(ln_out, padding_mask=padding_mask)
        else:
            mlp_out, mlp_bias = self.mlp(ln_out)
        residual = ln_out if post_ln_residual else hidden_states
        out = bias_dropout_add((mlp_out, mlp_bias), residual, dropout)
        if norm_checkpoint is not None:
            norm_checkpoint.discard_output_and_register_recompute(mlp_out)
        return out

    def _checkpointed_mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP keeping only its input. Its output bias (the row-parallel layer's own parameter
        under ``skip_bias_add``, not an activation) is handed out beside the checkpoint: a
        parameter returned through it would take the checkpoint as its producer."""
        bias: list[torch.Tensor | None] = []

        def output_only(h: torch.Tensor) -> torch.Tensor:
            out, out_bias = self.mlp(h)
            bias[:] = [out_bias]
            return out

        return tensor_parallel.checkpoint(output_only, False, x), bias[0]

    @staticmethod
    def _norm(
        norm: torch.nn.Module, x: torch.Tensor, checkpoint: tensor_parallel.CheckpointWithoutOutput | None
    ) -> torch.Tensor:
        return norm(x) if checkpoint is None else checkpoint.checkpoint(norm, x)
