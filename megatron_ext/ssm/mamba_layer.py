"""A Mamba-2 layer of a hybrid stack (Megatron-core's ``MambaLayer``): a pre-norm and the mixer, with its
residual."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.ssm.mamba_mixer import MambaMixer
from megatron_ext.transformer.utils import layer_norm


class MambaLayer(torch.nn.Module):
    """Megatron-core's ``MambaLayer(config, submodules, layer_number=1, residual_in_fp32=False,
    pg_collection=None, pp_layer_offset=0)``: ``x + mixer(norm(x))`` (its output bias added), the norm
    the config's (``normalization``, ``layernorm_epsilon``). ``submodules`` must be None: megatron_ext
    builds its own ``norm`` and ``mixer``."""

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int = 1,
        residual_in_fp32: bool = False,
        pg_collection: Any = None,
        pp_layer_offset: int = 0,
    ) -> None:
        super().__init__()
        if submodules is not None:
            raise NotImplementedError(
                "MambaLayer: submodules must be None (megatron_ext builds its own norm and mixer), got "
                f"{submodules!r}"
            )
        self.config, self.layer_number, self.residual_in_fp32 = config, layer_number, residual_in_fp32
        self.norm = layer_norm(config, config.hidden_size)
        self.mixer = MambaMixer(
            config,
            d_model=config.hidden_size,
            layer_number=layer_number,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | None = None,
        *,
        packed_seq_params: Any = None,
        padding_mask: torch.Tensor | None = None,
        **unused: Any,
    ) -> torch.Tensor:
        """``attention_mask``, ``rotary_pos_emb`` and ``padding_mask`` are the other layers': the mixer is
        causal and positionless (a mask is refused, as by Gated DeltaNet)."""
        if attention_mask is not None:
            raise ValueError(
                "MambaLayer: the recurrence is causal and takes no attention_mask; got one of shape "
                f"{tuple(attention_mask.shape)} (give packed rows as packed_seq_params)"
            )
        if unused:
            raise TypeError(f"MambaLayer.forward got unexpected arguments {sorted(unused)}")
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        out, bias = self.mixer(
            self.norm(hidden_states), inference_context, packed_seq_params=packed_seq_params
        )
        if bias is not None:
            out = out + bias
        return (residual + out).to(hidden_states.dtype)
