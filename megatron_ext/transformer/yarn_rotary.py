"""YaRN rotary embeddings (Megatron-core's ``YarnRotaryEmbedding``): the rotary angles of a model
trained at ``original_max_position_embeddings`` positions stretched ``scaling_factor`` times.

Channel pair ``i`` turns by ``p * f_i`` with ``f_i`` blended between the original frequency
``base^(-2i / dim)`` (the fast pairs, which turn more than ``beta_fast`` times over the original
context) and that frequency divided by ``scaling_factor`` (the slow pairs, fewer than ``beta_slow``
turns), linearly in between. The cosines and sines are multiplied by the concentration factor
``yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim)``, returned
beside the angles; multi-latent attention also multiplies its softmax scale by
``yarn_mscale(scaling_factor, mscale_all_dim)`` squared. Computed wherever the caller's tensors are
(no CUDA device is named here), in float32 as Megatron-core and Hugging Face transformers do.
"""

from __future__ import annotations

import math

import torch

from megatron_ext import parallel_state
from megatron_ext.transformer.context_parallel import get_pos_emb_on_this_cp_rank


def yarn_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration_factor(
    scaling_factor: float, mscale: float | None, mscale_all_dim: float | None
) -> float:
    """The factor on the cosines and sines: ``yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)``,
    or ``yarn_mscale(s)`` when either is None (Megatron-core's rule)."""
    if mscale is None or mscale_all_dim is None:
        return yarn_mscale(scaling_factor)
    return float(yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original_positions: int,
                          round_to_int: bool = True) -> tuple[float, float]:
    """The first and last channel pair whose frequency is blended: the pairs that turn ``beta_fast``
    and ``beta_slow`` times over ``original_positions`` positions, clamped to ``[0, dim - 1]``."""

    def pair_turning(turns: float) -> float:
        return dim * math.log(original_positions / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class YarnRotaryEmbedding(torch.nn.Module):
    """``forward(max_seq_len, offset=0, packed_seq=False, cp_group=None) -> (angles, mscale)``:
    ``[max_seq_len, 1, 1, dim]`` float32 angles (this context-parallel rank's rows over a group of
    more than one rank, unless ``packed_seq``) and the concentration factor. Megatron-core's
    signature; ``rotary_percent`` is accepted and, as there, not applied (every channel of
    ``kv_channels`` turns); ``use_cpu_initialization`` changes nothing: the frequencies are made on
    the CPU and follow the device ``forward`` is asked for. ``seq_len_interpolation_factor``, which
    Megatron-core's YaRN accepts and ignores, is refused."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000.0,
        use_cpu_initialization: bool = False,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
        cp_group: torch.distributed.ProcessGroup | None = None,
    ):
        super().__init__()
        if kv_channels < 2 or kv_channels % 2:
            raise ValueError(
                f"YaRN rotates channel pairs: kv_channels must be even and >= 2, got {kv_channels}"
            )
        if rotary_interleaved:
            raise ValueError("Yarn RoPE does not support interleaved rotary embeddings")
        if seq_len_interpolation_factor is not None:
            raise NotImplementedError(
                "YarnRotaryEmbedding: seq_len_interpolation_factor is not applied by YaRN (scaling_factor "
                f"stretches the positions); got {seq_len_interpolation_factor}"
            )
        if scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be positive, got {scaling_factor}")
        self.dim = kv_channels
        self.rotary_base = rotary_base
        self.rotary_interleaved = False
        self.seq_len_interpolation_factor = None
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.mscale, self.mscale_all_dim = mscale, mscale_all_dim
        self.correction_range_round_to_int = correction_range_round_to_int
        cpu = dict(dtype=torch.float32, device="cpu")  # a table, not a parameter: never on the meta device
        powers = rotary_base ** (torch.arange(0, kv_channels, 2, **cpu) / kv_channels)
        extrapolated, interpolated = 1.0 / powers, 1.0 / (scaling_factor * powers)
        low, high = yarn_correction_range(beta_fast, beta_slow, kv_channels, rotary_base,
                                          original_max_position_embeddings, correction_range_round_to_int)
        if low == high:
            high += 0.001  # a ramp of width 0 would divide by 0
        ramp = ((torch.arange(kv_channels // 2, **cpu) - low) / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: the original frequency, 0: the interpolated one
        # Neither a parameter nor a buffer (as RotaryEmbedding's): float32 whatever the model's dtype.
        self.inv_freq = interpolated * (1 - keep) + extrapolated * keep
        self.concentration = yarn_concentration_factor(scaling_factor, mscale, mscale_all_dim)
        self.cp_group = (
            cp_group if cp_group is not None
            else parallel_state.get_context_parallel_group(check_initialized=False)
        )

    def forward(
        self,
        max_seq_len: int,
        offset: int = 0,
        packed_seq: bool = False,
        cp_group: torch.distributed.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, float]:
        if self.inv_freq.device != torch.device(device or "cpu"):
            self.inv_freq = self.inv_freq.to(device)
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1 and not packed_seq:
            angles = get_pos_emb_on_this_cp_rank(angles, 0, cp_group)
        return angles, self.concentration


# Megatron-core's GPTModel(position_embedding_type="yarn") reads YaRN's settings from these config
# attributes (set on the config object, not dataclass fields), each one YarnRotaryEmbedding's argument.
YARN_CONFIG_ATTRIBUTES = {
    "yarn_rotary_scaling_factor": "scaling_factor",
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_mscale": "mscale",
    "yarn_mscale_all_dim": "mscale_all_dim",
    "yarn_correction_range_round_to_int": "correction_range_round_to_int",
}


def yarn_arguments(config) -> dict:
    """YarnRotaryEmbedding's keyword arguments from a config's ``yarn_*`` attributes
    (``YARN_CONFIG_ATTRIBUTES``); a ValueError naming those it lacks."""
    missing = [name for name in YARN_CONFIG_ATTRIBUTES if not hasattr(config, name)]
    if missing:
        raise ValueError(
            "position_embedding_type 'yarn' reads YaRN's settings from the config's attributes "
            f"{list(YARN_CONFIG_ATTRIBUTES)} (Megatron-core's names); the config has no {missing}"
        )
    return {argument: getattr(config, name) for name, argument in YARN_CONFIG_ATTRIBUTES.items()}


def yarn_concentration_of(config) -> float:
    """The factor on the cosines and sines of every rotary embedding a config with
    ``yarn_rotary_scaling_factor`` applies (Megatron-core's attention reads it so), else 1."""
    if not hasattr(config, "yarn_rotary_scaling_factor"):
        return 1.0
    return yarn_concentration_factor(config.yarn_rotary_scaling_factor, getattr(config, "yarn_mscale", None),
                                     getattr(config, "yarn_mscale_all_dim", None))
