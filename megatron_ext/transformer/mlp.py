"""The tensor-parallel MLP: column-parallel h -> ffn, activation (or gated unit), row-parallel ffn -> h."""

from __future__ import annotations

import functools

import torch

from megatron_ext.fusions.fused_bias_geglu import sigmoid_gate_alpha
from megatron_ext.fusions.fused_bias_gelu import bias_gelu
from megatron_ext.fusions.fused_bias_swiglu import bias_swiglu
from megatron_ext.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_ext.tensor_parallel.sharded_state import renamed_sharded_state_dict
from megatron_ext.transformer.transformer_config import TransformerConfig

# The submodules' names here -> Megatron-core's checkpoint keys.
MLP_KEYS = {"dense_h_to_4h.": "linear_fc1.", "dense_4h_to_h.": "linear_fc2."}


class ParallelMLP(torch.nn.Module):
    """Y = act(X A + a) B + b with A split by columns and B by rows across tensor-parallel ranks.

    Forward needs one all-reduce (after B), backward one (of the input gradient of A). Returns
    ``(output, output_bias)`` with the bias of B not yet added, as Megatron-core does, so the caller
    can fuse it into bias-dropout-add. Without ``config.add_bias_linear`` neither linear has a bias.

    With ``config.gated_linear_unit`` A has ``2 ffn`` columns, the gate's and the linear half's,
    and Y = (act(X A_gate) * (X A_up)) B: SwiGLU with ``activation_func=F.silu``. Each rank holds
    matching columns of both halves, its ``[gate_r | up_r]`` (a stride-2 split of ``[gate | up]``),
    so the serial model's ``[gate | up]`` weight deals out as Megatron's checkpoints lay it out.

    With ``config.glu_linear_offset`` and ``config.activation_func_clamp_value`` the gated unit is
    Megatron-core's ``act(gate) * (up + offset)`` of the clamped halves (``glu``), gpt-oss's with
    ``quick_gelu``.

    With ``config.bias_activation_fusion`` the bias add and the activation run as one kernel
    (forward and backward): GeLU, or when gated SwiGLU or quick GEGLU with their offset and clamp
    (``fusions.bias_swiglu``, the same numbers). It computes the GeLU the unfused path does (exact
    erf form unless ``config.activation_func`` is ``partial(F.gelu, approximate="tanh")``), so the
    flag does not change the numbers; Megatron-core's fused path always takes the tanh form.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.gated = bool(getattr(config, "gated_linear_unit", False))
        bias = bool(getattr(config, "add_bias_linear", True))
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size * (2 if self.gated else 1),
            config=config,
            init_method=config.init_method,
            bias=bias,
            gather_output=False,
            skip_bias_add=True,
            stride=2 if self.gated else 1,
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
        )

        self.gelu_approximate = _gelu_approximate(getattr(config, "activation_func", None))
        self.bias_activation_fusion = bool(getattr(config, "bias_activation_fusion", False))
        if self.bias_activation_fusion and self.gated:
            check_fusable_glu(config)
        if self.bias_activation_fusion and not self.gated and self.gelu_approximate is None:
            raise ValueError(
                f"bias_activation_fusion supports the GeLU activation only, got activation_func="
                f"{config.activation_func!r}"
            )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: each tensor as a ShardedTensor (as the layers inside are split)
        under Megatron-core's keys (``linear_fc1``, ``linear_fc2``)."""
        return renamed_sharded_state_dict(self, prefix, sharded_offsets, MLP_KEYS, metadata)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        intermediate, bias = self.dense_h_to_4h(hidden_states)
        if self.bias_activation_fusion and self.gated:
            intermediate = fused_glu(self.config, intermediate, bias)
        elif self.bias_activation_fusion and bias is not None:
            intermediate = bias_gelu(intermediate, bias, self.gelu_approximate)
        else:
            if bias is not None:
                intermediate = intermediate + bias
            intermediate = self.activation(intermediate)
        return self.dense_4h_to_h(intermediate)

    def activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """The activation (of the gate half, times the linear half, when gated: ``glu``)."""
        if self.gated:
            return glu(self.config, intermediate)
        if self.gelu_approximate is None:
            return self.config.activation_func(intermediate)
        return torch.nn.functional.gelu(intermediate, approximate=self.gelu_approximate)


def _gelu_approximate(activation_func) -> str | None:
    """The ``approximate`` argument of a GeLU activation (None for the default), or None when the
    activation is not a GeLU."""
    if activation_func is None or activation_func is torch.nn.functional.gelu:
        return "none"
    if isinstance(activation_func, functools.partial) and activation_func.func is torch.nn.functional.gelu:
        if not activation_func.args and set(activation_func.keywords) <= {"approximate"}:
            return activation_func.keywords.get("approximate", "none")
    return None


def glu(config, intermediate: torch.Tensor) -> torch.Tensor:
    """The gated linear unit of Megatron-core's unfused path: ``act(gate) * (up + glu_linear_offset)``
    of the halves of the last dim, the gate clamped to at most ``activation_func_clamp_value`` and
    the linear half to within it when that is set (gpt-oss's experts: ``quick_gelu``, offset 1,
    clamp 7)."""
    gate, up = intermediate.chunk(2, dim=-1)
    clamp = getattr(config, "activation_func_clamp_value", None)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    offset = getattr(config, "glu_linear_offset", 0.0)
    return config.activation_func(gate) * (up + offset if offset else up)


def check_fusable_glu(config) -> None:
    """ValueError unless the fused kernel computes the config's gated unit: SiLU (SwiGLU) or quick
    GELU (with any offset and clamp)."""
    if sigmoid_gate_alpha(config.activation_func) is None:
        raise ValueError(
            "bias_activation_fusion with gated_linear_unit supports the SiLU (SwiGLU) and quick GELU "
            f"activations only, got activation_func={config.activation_func!r}"
        )


def fused_glu(config, intermediate: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``glu(config, intermediate + bias)`` as one kernel (forward and backward), for the
    activations ``check_fusable_glu`` accepts."""
    return bias_swiglu(
        intermediate,
        bias,
        alpha=sigmoid_gate_alpha(config.activation_func),
        linear_offset=getattr(config, "glu_linear_offset", 0.0),
        clamp_value=getattr(config, "activation_func_clamp_value", None),
    )
