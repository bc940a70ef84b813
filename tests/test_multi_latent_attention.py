"""Multi-latent attention (``transformer.multi_latent_attention.MLASelfAttention``) against an
unfused float64 reference written here from the formulas (DeepSeek's interleaved rotation as a
product of complex numbers, the [s, s] scores in memory): the output, the input's gradient and every
weight's gradient, serial and at tp 2 (with and without sequence parallelism), cp 2 (ring,
all-gather and all-to-all), tp 2 x cp 2, with and without query compression, RoPE and YaRN, and
with each selective recomputation; YaRN's frequencies against their formula; the config's
refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.distributed.finalize_model_grads import allreduce_layernorm_grads
from megatron_ext.transformer.context_parallel import get_pos_emb_on_this_cp_rank
from megatron_ext.transformer.multi_latent_attention import MLASelfAttention
from megatron_ext.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron_ext.transformer.yarn_rotary import YarnRotaryEmbedding, yarn_correction_range
from tests.distributed import run_distributed

SEQ, BATCH = 8, 2
SIZES = dict(num_layers=1, hidden_size=32, num_attention_heads=4, kv_lora_rank=8, qk_head_dim=6,
             qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True, add_bias_linear=False,
             hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
             use_cpu_initialization=True,
             rotary_scaling_factor=4.0, original_max_position_embeddings=4, mscale=0.8, mscale_all_dim=0.9,
             rotary_base=50.0)
VARIANTS = {
    "yarn q_lora": dict(q_lora_rank=12, rope_type="yarn"),
    "rope no q_lora": dict(q_lora_rank=None, rope_type="rope"),
}


def _config(**overrides) -> MLATransformerConfig:
    return MLATransformerConfig(**{**SIZES, **overrides})


def _full_weights(config, seed: int) -> dict[str, torch.Tensor]:
    """Serial weights by Megatron-core's names (norm weights away from 1)."""
    g = torch.Generator().manual_seed(seed)
    h, n = config.hidden_size, config.num_attention_heads
    qd = config.qk_head_dim + config.qk_pos_emb_head_dim

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])

    w = {}
    if config.q_lora_rank is None:
        w["linear_q_proj"] = draw(n * qd, h)
    else:
        w["linear_q_down_proj"] = draw(config.q_lora_rank, h)
        w["q_latent_norm"] = 1 + 0.3 * torch.randn(config.q_lora_rank, generator=g, dtype=torch.float64)
        w["linear_q_up_proj"] = draw(n * qd, config.q_lora_rank)
    w["linear_kv_down_proj"] = draw(config.kv_lora_rank + config.qk_pos_emb_head_dim, h)
    w["kv_latent_norm"] = 1 + 0.3 * torch.randn(config.kv_lora_rank, generator=g, dtype=torch.float64)
    w["linear_kv_up_proj"] = draw(n * (config.qk_head_dim + config.v_head_dim), config.kv_lora_rank)
    w["linear_proj"] = draw(h, n * config.v_head_dim)
    return w


def _rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _inv_freq(config) -> torch.Tensor:
    """The rotary frequencies (float32, as the models compute them) from their formulas."""
    dim, base = config.qk_pos_emb_head_dim, config.rotary_base
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if config.rope_type == "rope":
        return 1.0 / powers
    factor = config.rotary_scaling_factor
    turns = lambda r: dim * math.log(config.original_max_position_embeddings / (r * 2 * math.pi)) / (  # noqa: E731
        2 * math.log(base))
    low, high = max(math.floor(turns(config.beta_fast)), 0), min(math.ceil(turns(config.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    original = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (1.0 / (factor * powers)) * (1 - original) + (1.0 / powers) * original


def _mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def reference(x: torch.Tensor, w: dict, config) -> torch.Tensor:
    """MLA over ``x`` [s, b, h] from the weights ``w`` with [s, s] scores, in float64."""
    s, b, _ = x.shape
    n, dn, dv = config.num_attention_heads, config.qk_head_dim, config.v_head_dim
    dr = config.qk_pos_emb_head_dim
    eps = config.layernorm_epsilon
    if config.q_lora_rank is None:
        q = x @ w["linear_q_proj"].T
    else:
        q = _rms(x @ w["linear_q_down_proj"].T, w["q_latent_norm"], eps) @ w["linear_q_up_proj"].T
    q = q.view(s, b, n, dn + dr)
    latent, k_rot = (x @ w["linear_kv_down_proj"].T).split([config.kv_lora_rank, dr], dim=-1)
    kv = (_rms(latent, w["kv_latent_norm"], eps) @ w["linear_kv_up_proj"].T).view(s, b, n, dn + dv)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), _inv_freq(config))  # [s, dr / 2]
    # Megatron-core's softmax scale carries mscale_all_dim's factor whatever the rope type.
    m = config.rotary_scaling_factor
    factor, scale = 1.0, _mscale(m, config.mscale_all_dim) ** 2 / math.sqrt(dn + dr)
    if config.rope_type == "yarn":
        factor = _mscale(m, config.mscale) / _mscale(m, config.mscale_all_dim)
    cos = (angles.cos() * factor).double()[:, None, None, :]
    sin = (angles.sin() * factor).double()[:, None, None, :]

    def rotate(t):  # channel pairs (2i, 2i + 1) turned by angle i: a complex product
        pairs = t.unflatten(-1, (dr // 2, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        return torch.stack((re * cos - im * sin, im * cos + re * sin), dim=-1).flatten(-2)

    query = torch.cat((q[..., :dn], rotate(q[..., dn:])), dim=-1)
    key = torch.cat((kv[..., :dn], rotate(k_rot[:, :, None, :]).expand(s, b, n, dr)), dim=-1)
    value = kv[..., dn:]
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), value).reshape(s, b, n * dv)
    return context @ w["linear_proj"].T


# How each weight is split over tensor-parallel ranks: dim (None: whole on every rank).
SPLIT = {"linear_q_proj": 0, "linear_q_up_proj": 0, "linear_kv_up_proj": 0, "linear_proj": 1}


def _param(module, name):
    return getattr(module, name).weight


def _load(module, w: dict, tp: int, rank: int) -> None:
    with torch.no_grad():
        for name, full in w.items():
            dim = SPLIT.get(name)
            _param(module, name).copy_(full if dim is None else full.chunk(tp, dim)[rank])


def _local(t: torch.Tensor, sp: bool) -> torch.Tensor:
    """This rank's rows of a [s, b, ...] tensor: its cp chunks, then its sequence-parallel slice."""
    t = get_pos_emb_on_this_cp_rank(t, 0, ps.get_context_parallel_group())
    if sp:
        t = t.chunk(ps.get_tensor_model_parallel_world_size(), 0)[ps.get_tensor_model_parallel_rank()]
    return t


def _compare(variant: str, tp: int, cp: int, sp: bool, comm: str, recompute: str | None) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    extra = dict(recompute_granularity="selective", recompute_modules=[recompute]) if recompute else {}
    config = _config(**VARIANTS[variant], tensor_model_parallel_size=tp, context_parallel_size=cp,
                     sequence_parallel=sp, cp_comm_type=comm, **extra)
    module = MLASelfAttention(config, layer_number=1).train()
    w = _full_weights(config, seed=7)
    tp_rank = ps.get_tensor_model_parallel_rank()
    _load(module, w, tp, tp_rank)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SEQ, BATCH, config.hidden_size, generator=g, dtype=torch.float64)
    grad_out = torch.randn(SEQ, BATCH, config.hidden_size, generator=g, dtype=torch.float64)

    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    ref_x = x.clone().requires_grad_()
    ref_out = reference(ref_x, ref_w, config)
    (ref_out * grad_out).sum().backward()

    local_x = _local(x, sp).clone().requires_grad_()
    out, bias = module(local_x)
    assert bias is None
    (out * _local(grad_out, sp)).sum().backward()
    allreduce_layernorm_grads([module])  # the duplicated weights' and norms' partial sums under sp
    diffs = {"out": ((out - _local(ref_out, sp)).abs().max() / ref_out.abs().max()).item(),
             "x grad": ((local_x.grad - _local(ref_x.grad, sp)).abs().max() / ref_x.grad.abs().max()).item()}
    cp_group = ps.get_context_parallel_group()
    for name, ref in ref_w.items():
        grad = _param(module, name).grad.clone()
        dist.all_reduce(grad, group=cp_group)  # each cp rank's share of the sequence
        dim = SPLIT.get(name)
        expected = ref.grad if dim is None else ref.grad.chunk(tp, dim)[tp_rank]
        diffs[name] = ((grad - expected).abs().max() / ref.grad.abs().max()).item()
    ps.destroy_model_parallel()
    return diffs


CASES_1 = [(v, 1, 1, False, "p2p", None) for v in VARIANTS] + [
    ("yarn q_lora", 1, 1, False, "p2p", "core_attn"),
    ("yarn q_lora", 1, 1, False, "p2p", "mla_up_proj"),
]
CASES_2 = [(v, 2, 1, sp, "p2p", None) for v in VARIANTS for sp in (False, True)] + [
    ("yarn q_lora", 1, 2, False, comm, None) for comm in ("p2p", "all_gather", "a2a")
] + [("rope no q_lora", 1, 2, False, "p2p", "mla_up_proj"), ("yarn q_lora", 2, 1, True, "p2p", "mla_up_proj")]
CASES_4 = [("yarn q_lora", 2, 2, True, "p2p", None), ("rope no q_lora", 2, 2, False, "all_gather", None)]


def _worker(cases):
    return [_compare(*case) for case in cases]


@pytest.mark.slow  # three world sizes
def test_mla_equals_the_unfused_reference_in_every_layout():
    for world, cases in ((1, CASES_1), (2, CASES_2), (4, CASES_4)):
        results = run_distributed(world, _worker, cases)
        for rank, per_rank in enumerate(results):
            for case, diffs in zip(cases, per_rank):
                assert len(diffs) >= 7, diffs
                for what, diff in diffs.items():
                    assert diff < 1e-12, (case, rank, what, diff)


def test_yarn_frequencies_follow_the_formula():
    config = _config(q_lora_rank=None, rope_type="yarn")
    rope = YarnRotaryEmbedding(config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                               scaling_factor=config.rotary_scaling_factor,
                               original_max_position_embeddings=config.original_max_position_embeddings,
                               mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)
    angles, factor = rope(6)
    expected = torch.outer(torch.arange(6, dtype=torch.float32), _inv_freq(config))
    assert torch.equal(angles[:, 0, 0], torch.cat((expected, expected), dim=-1))
    m = config.rotary_scaling_factor
    assert factor == pytest.approx(_mscale(m, 0.8) / _mscale(m, 0.9), rel=1e-15)
    # Both ends blend: the first pair keeps its frequency, the last is interpolated.
    assert yarn_correction_range(32, 1, 4, 50.0, 4) == (0, 0)
    inv = _inv_freq(config)
    assert inv[0] == 1.0 and inv[1] == pytest.approx(1.0 / (4.0 * 50.0 ** 0.5), rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(kv_lora_rank=0), ValueError, "kv_lora_rank must be a positive integer, got 0"),
        (dict(q_lora_rank=0), ValueError, "q_lora_rank must be a positive integer or None"),
        (dict(v_head_dim=-1), ValueError, "v_head_dim must be a positive integer"),
        (dict(qk_pos_emb_head_dim=3), ValueError, "3 rotated channels"),
        (dict(rope_type="ntk"), ValueError, "Unsupported RoPE type"),
        (dict(rotary_interleaved=True), ValueError, "rotary_interleaved does not work"),
        (dict(apply_rope_fusion=True, rope_type="rope"), ValueError, "only works with YARN"),
        (dict(num_query_groups=2), ValueError, "num_query_groups \\(2\\) must equal num_attention_heads"),
        (dict(original_max_position_embeddings=0), ValueError, "original_max_position_embeddings"),
        (dict(rotary_scaling_factor=float("nan")), ValueError, "rotary_scaling_factor"),
        (dict(cache_mla_latents=True), NotImplementedError, "cache_mla_latents"),
    ],
)
def test_bad_mla_configs_raise(overrides, error, match):
    with pytest.raises(error, match=match):
        _config(**overrides)


def test_mla_needs_its_config_fields():
    with pytest.raises(ValueError, match="build the config as an MLATransformerConfig"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, multi_latent_attention=True)
    with pytest.raises(ValueError, match="'mla_up_proj' is only supported with multi_latent_attention"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                          recompute_granularity="selective", recompute_modules=["mla_up_proj"])
