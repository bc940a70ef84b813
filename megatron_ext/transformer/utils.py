"""Small pieces shared by the transformer modules."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch

from megatron_ext.dist_checkpointing.rank_shards import (
    make_sharded_object_for_checkpoint,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron_ext.fusions.fused_rms_norm import fused_rms_norm
from megatron_ext.tensor_parallel.meta_init import remember_build
from megatron_ext.tensor_parallel.utils import param_device

M = TypeVar("M", bound=torch.nn.Module)


@contextlib.contextmanager
def initialization_seed(base_seed: int | None, offset: int) -> Iterator[None]:
    """Draws the parameters built inside from the CPU generator seeded with ``base_seed + offset``
    and restores the generator afterwards.

    Seeding each layer by its global index makes a layer's (master) weights the same whichever
    pipeline stage builds it, so every parallel layout starts from the serial model's weights.
    ``base_seed=None`` leaves the generator alone.
    """
    if base_seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        # Only the CPU generator: torch.manual_seed would also reseed (and not restore) CUDA's.
        torch.random.default_generator.manual_seed(base_seed + offset)
        yield


def build_seeded(config: Any, base_seed: int | None, offset: int, build: Callable[[], M]) -> M:
    """``build()`` under ``initialization_seed(base_seed, offset)``. With
    ``config.init_model_with_meta_device`` it is built on the meta device and remembers how it was
    built, so that ``tensor_parallel.meta_init.materialize`` draws the same weights later."""

    def draw() -> M:
        with initialization_seed(base_seed, offset):
            return build()

    if not getattr(config, "init_model_with_meta_device", False):
        return draw()
    with torch.device("meta"):
        module = draw()
    return remember_build(module, draw)


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameter, same numbers) computed by megatron_ext's fused kernel
    (``fusions.fused_rms_norm``: one pass forward, one backward, float32 statistics for 16-bit inputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


def layer_norm(config: Any, hidden_size: int) -> torch.nn.Module:
    """The transformer's normalisation over the last ``hidden_size`` features: ``torch.nn.LayerNorm``
    or, with ``config.normalization == "RMSNorm"``, ``torch.nn.RMSNorm`` (what Megatron-core's local
    layers build; the fused kernel, ``FusedRMSNorm``, with ``config.persist_layer_norm`` or
    ``config.memory_efficient_layer_norm``), both with ``config.layernorm_epsilon``. Its parameters
    carry ``sequence_parallel`` (Megatron's attribute): under sequence parallelism each tensor-parallel
    rank normalises its own part of the sequence, so their gradients are partial sums that
    ``finalize_model_grads`` all-reduces."""
    eps, dtype = config.layernorm_epsilon, config.params_dtype
    if getattr(config, "normalization", "LayerNorm") == "RMSNorm":
        fused = getattr(config, "persist_layer_norm", False) or getattr(
            config, "memory_efficient_layer_norm", False
        )
        norm = (FusedRMSNorm if fused else torch.nn.RMSNorm)(hidden_size, eps=eps, dtype=dtype)
    else:
        norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def make_sharded_tensors_for_checkpoint(
    state_dict: dict[str, Any],
    prefix: str,
    tensor_parallel_layers_axis_map: dict[str, int] | None = None,
    sharded_offsets: tuple = (),
    extra_state_suffix: str = "_extra_state",
    tp_group: Any = None,
    dp_cp_group: Any = None,
) -> dict[str, Any]:
    """Megatron-core's helper: each entry of ``state_dict`` under ``prefix + name`` as a
    ShardedTensor split over tensor-parallel ranks along the axis ``tensor_parallel_layers_axis_map``
    gives it, else replicated; ``*_extra_state`` entries as ShardedObjects."""
    axis_map = tensor_parallel_layers_axis_map or {}
    groups = (
        {} if tp_group is None and dp_cp_group is None else {"tp_group": tp_group, "dp_cp_group": dp_cp_group}
    )
    out = {}
    for name, tensor in state_dict.items():
        key = f"{prefix}{name}"
        if name.endswith(extra_state_suffix):
            out[key] = make_sharded_object_for_checkpoint(tensor, key, sharded_offsets)
        elif name in axis_map:
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                tensor, key, axis_map[name], prepend_offsets=sharded_offsets, **groups
            )
        else:
            out[key] = make_sharded_tensor_for_checkpoint(tensor, key, sharded_offsets, **groups)
    return out


def selectively_recomputed(config: Any, module: str) -> bool:
    """Whether selective recomputation covers ``module`` (one of Megatron-core's
    ``recompute_modules``: "core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts")."""
    return getattr(config, "recompute_granularity", None) == "selective" and module in (
        getattr(config, "recompute_modules", None) or ()
    )


# --- Sliding windows and attention sinks --------------------------------------------------------

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def is_layer_window_attention(
    window_size: tuple[int, int] | None, window_attn_skip_freq: int | list | None, layer_number: int
) -> bool:
    """Whether layer ``layer_number`` (1-based) attends through the window (Megatron-core's rule):
    every layer when ``window_attn_skip_freq`` is None; an int k makes every k-th layer (k, 2k, ...)
    full attention; a list gives each layer, 1 for the window and 0 for full attention."""
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, list):
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"window_attn_skip_freq must be an int, a list or None, got {window_attn_skip_freq!r}")


def window_keys(window_size: Any) -> int | None:
    """The keys a query sees, itself included, of Megatron-core's / TransformerEngine's
    ``window_size=(left, right)``: query i sees keys ``i - left .. i + right``, -1 unbounded. A
    causal model's window is ``(left, 0)``: ``left + 1`` keys (Hugging Face's ``sliding_window``
    counts the same keys, so it is ``left + 1``); ``left`` -1 is no window (None)."""
    if window_size is None:
        return None
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)
    ):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1:
        raise ValueError(f"window_size=({left}, {right}): left must be >= 0, or -1 for no limit")
    if right != 0:
        raise ValueError(
            f"window_size=({left}, {right}): the right side must be 0; the window slides over causal "
            "attention, where no query sees a later key"
        )
    return None if left == -1 else left + 1


def layer_window(config: Any, layer_number: int) -> int | None:
    """The window (keys a query sees) of layer ``layer_number``'s attention, None for full
    attention."""
    window_size = getattr(config, "window_size", None)
    skip_freq = getattr(config, "window_attn_skip_freq", None)
    if not is_layer_window_attention(window_size, skip_freq, layer_number):
        return None
    return window_keys(window_size)


def check_attention_variants(config: Any) -> None:
    """ValueError naming a bad ``window_size``, ``window_attn_skip_freq`` or ``softmax_type``."""
    window_keys(config.window_size)
    freq = config.window_attn_skip_freq
    if freq is not None:
        valid_int = isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1
        valid_list = isinstance(freq, list) and len(freq) == config.num_layers and set(freq) <= {0, 1}
        if not (valid_int or valid_list):
            raise ValueError(
                "window_attn_skip_freq must be a positive int (every k-th layer full attention) or a list of "
                f"num_layers ({config.num_layers}) entries 0 or 1 (1: the window), got {freq!r}"
            )
    if config.softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type must be one of {list(SOFTMAX_TYPES)}, got {config.softmax_type!r}")
    variant = config.experimental_attention_variant
    if variant not in (None, "gated_delta_net"):
        raise NotImplementedError(
            f"experimental_attention_variant={variant!r} is not supported by megatron_ext "
            "(only 'gated_delta_net')"
        )
    if (variant is None) != (config.linear_attention_freq is None):
        raise ValueError(
            "experimental_attention_variant='gated_delta_net' and linear_attention_freq go together (the "
            f"variant's layers and where they are); got experimental_attention_variant={variant!r}, "
            f"linear_attention_freq={config.linear_attention_freq!r}"
        )
    if variant is not None:
        linear_attention_pattern(config)
        if config.context_parallel_size > 1:
            raise NotImplementedError(
                "experimental_attention_variant='gated_delta_net' with context_parallel_size > 1 is not "
                "supported by megatron_ext yet"
            )


def linear_attention_pattern(config: Any) -> list[int]:
    """Megatron-core's layer pattern of ``linear_attention_freq`` (1: a Gated DeltaNet layer, 0: full
    attention): an int N puts full attention at every N-th layer (N - 1 linear layers before each), a
    list of ``num_layers`` entries 0 or 1 is the pattern itself; no pattern without the variant."""
    freq = config.linear_attention_freq
    if getattr(config, "experimental_attention_variant", None) is None or freq is None:
        return [0] * config.num_layers
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return [0 if (i + 1) % freq == 0 else 1 for i in range(config.num_layers)]
    if isinstance(freq, list) and len(freq) == config.num_layers and set(freq) <= {0, 1}:
        return list(freq)
    raise ValueError(
        "linear_attention_freq must be a positive int (every N-th layer full attention) or a list of "
        f"num_layers ({config.num_layers}) entries 0 or 1 (1: linear attention), got {freq!r}"
    )


def make_softmax_offset(config: Any, tp_size: int, tp_rank: int) -> torch.Tensor | None:
    """The attention sinks of ``config.softmax_type`` for this tensor-parallel rank's heads, as
    Megatron-core's ``softmax_offset``: None for ``vanilla``; zeros for ``off-by-one`` (a constant,
    not saved); a parameter for ``learnable``, split over tensor-parallel ranks with the heads and
    drawn with ``config.init_method`` over all heads before the split, so every layout starts from
    the serial values."""
    kind = getattr(config, "softmax_type", "vanilla")
    heads = config.num_attention_heads // tp_size
    device = param_device(getattr(config, "use_cpu_initialization", False))
    if kind == "vanilla":
        return None
    if kind == "off-by-one":
        return torch.zeros(heads, dtype=config.params_dtype, device=device)
    if kind != "learnable":
        raise ValueError(f"softmax_type must be one of {list(SOFTMAX_TYPES)}, got {kind!r}")
    full = torch.zeros(config.num_attention_heads, dtype=config.params_dtype, device=device)
    if getattr(config, "perform_initialization", True):
        config.init_method(full)
    offset = torch.nn.Parameter(full[tp_rank * heads : (tp_rank + 1) * heads].clone())
    offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride = True, 0, 1
    return offset
