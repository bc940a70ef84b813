"""A Hugging Face config's fields, read and checked: ``_field`` (a ``PretrainedConfig``'s attribute
or a ``config.json`` dict's key), ``_positive`` (a positive integer, or a ValueError naming the
field) and ``layer_windows`` / ``window_fields`` (each layer's sliding window, as transformers 5
picks it, and the TransformerConfig fields that say the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# transformers' names of a layer's attention in ``layer_types``.
SLIDING, FULL = "sliding_attention", "full_attention"
# The families whose transformers models window the layers ``layer_types`` names "sliding_attention"
# (a config without the field gets the family's rule), and those that window every layer.
_PER_LAYER = ("qwen2", "qwen3", "qwen2_moe", "gpt_oss")
_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")


def _field(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _positive(hf_config: Any, name: str, default: Any = None) -> int:
    """The field, or ``default`` where it is missing or null; refused unless a positive integer."""
    value = _field(hf_config, name)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"the Hugging Face config's {name!r} must be a positive integer, got "
            + ("nothing (the field is missing)" if value is None else repr(value))
        )
    return value


def _default_layer_types(hf_config: Any, model_type: str, layers: int, windowed: bool) -> list[str]:
    """``layer_types`` as the family's config makes it when the field is missing."""
    if model_type == "gpt_oss":  # every other layer, from the first
        return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    first_full = _field(hf_config, "max_window_layers", 28)
    if isinstance(first_full, bool) or not isinstance(first_full, int):
        raise ValueError(
            f"the Hugging Face config's 'max_window_layers' must be an integer, got {first_full!r}"
        )
    if model_type == "qwen2_moe":  # the even layers below max_window_layers
        return [SLIDING if windowed and i % 2 == 0 and i < first_full else FULL for i in range(layers)]
    return [SLIDING if windowed and i >= first_full else FULL for i in range(layers)]  # from it on


def layer_windows(hf_config: Any, model_type: str) -> list[int | None]:
    """The keys a query of each layer sees through transformers' sliding window (``sliding_window``
    W: keys ``i - W < j <= i``), None where the layer attends to every earlier key.

    Mistral and Mixtral window every layer when ``sliding_window`` is set, Qwen3-MoE when
    ``use_sliding_window`` is; Qwen2, Qwen3, Qwen2-MoE and gpt-oss the layers ``layer_types``
    names "sliding_attention" (without the field, the family's rule: Qwen2 and Qwen3 from layer
    ``max_window_layers`` on, Qwen2-MoE the even layers below it, both only with
    ``use_sliding_window``; gpt-oss every other layer from the first). A ``layer_types`` of another
    length than ``num_hidden_layers``, other entries, or windowed layers without a positive
    ``sliding_window`` raise ValueError."""
    layers = _field(hf_config, "num_hidden_layers")
    if model_type not in _PER_LAYER + _EVERY_LAYER:
        return [None] * layers
    window = _field(hf_config, "sliding_window")
    if model_type.startswith("qwen") and not _field(hf_config, "use_sliding_window", False):
        window = None  # Qwen's configs drop the window unless use_sliding_window
    if model_type in _EVERY_LAYER:
        types = [SLIDING if window else FULL] * layers
    else:
        types = _field(hf_config, "layer_types")
        if types is None:
            types = _default_layer_types(hf_config, model_type, layers, window is not None)
        if not isinstance(types, (list, tuple)) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
            raise ValueError(
                f"the Hugging Face config's 'layer_types' must list {layers} entries (num_hidden_layers), "
                f"each {SLIDING!r} or {FULL!r}, got {types!r}"
            )
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"the Hugging Face config's 'sliding_window' must be a positive integer for its "
            f"{SLIDING!r} layers, got {window!r}"
        )
    return [window if kind == SLIDING else None for kind in types]


def window_fields(windows: list[int | None]) -> dict[str, Any]:
    """Megatron-core's ``window_size`` and ``window_attn_skip_freq`` of ``layer_windows``: W keys is
    ``window_size=(W - 1, 0)``; on some layers only, ``window_attn_skip_freq`` lists each layer (1:
    the window)."""
    sizes = {w for w in windows if w is not None}
    if not sizes:
        return {}
    if len(sizes) > 1:
        raise ValueError(
            f"the layers' sliding windows differ ({sorted(sizes)}): Megatron-core has one window_size"
        )
    (window,) = sizes
    fields: dict[str, Any] = dict(window_size=(window - 1, 0))
    if None in windows:
        fields["window_attn_skip_freq"] = [int(w is not None) for w in windows]
    return fields
