"""One DeepSeek-V3-style transformer layer, forward + backward per rank, float32, on CPU processes (gloo,
one thread each), at expert-parallel sizes 1 and 2: multi-latent attention with YaRN, then a
mixture of experts with a shared expert and group-limited sigmoid routing with the expert bias.
Three layers from the same weights, in the same run, variants interleaved:

- ``megatron_ext``: its ``ParallelTransformerLayer`` as ``examples/train_gpt.py --arch deepseek``
  builds it (the example's own ``parse_args``, ``check_args`` and ``build_model``; the layer is the
  built model's only decoder layer), MoE with ``SequentialMLP`` experts and the alltoall dispatcher;
- ``Megatron-core``: Megatron-core 0.16.1's own ``TransformerLayer`` from
  ``get_gpt_layer_local_spec(num_experts, multi_latent_attention=True, qk_layernorm=True)``, its
  ``MLATransformerConfig`` given megatron_ext's config's field values, run on Megatron-core's own
  parallel modules with the CPU patches of ``benchmarks/megatron_core_gpt.py``. Its local spec
  does not build without TransformerEngine (its ``DotProductAttention`` takes no ``k_channels`` /
  ``v_channels``): megatron_ext's ``ContextParallelDotProductAttention`` is its core attention;
- ``transformers``: transformers' ``DeepseekV3DecoderLayer`` (SDPA attention, its default
  experts implementation), at ep 1 only; its rotary cosines and sines, which its model computes
  once for all layers, are computed in the timed run.

The weights are drawn by transformers (a one-layer ``DeepseekV3ForCausalLM``, the norms moved away
from 1 and a random expert bias; every RMSNorm's epsilon the example's 1e-5, the latent norms' set
by hand, as transformers builds them with 1e-6 whatever its config says), loaded into megatron_ext's
model with ``megatron_ext.models.hf.load_hf_state_dict`` and copied from megatron_ext's layer into
Megatron-core's by name. Every rank holds its own ``--seq`` tokens (one sequence; the layer's input
as the previous layer hands it over: a fresh non-leaf tensor each repetition) and its ``E / ep``
experts; the output gets a fresh gradient each repetition (``output.backward(grad)``). Once, after
timing, every layer runs on the same input and gradient: the largest differences of its output and
of its input's gradient from megatron_ext's are reported, beside the largest change the layer makes
to its input and to the gradient it is handed (the residual path carries the rest). Timing and
memory method: benchmarks/common.py.

The default sizes are DeepSeek-V3's divided by 4 where they are widths (hidden 1792, 32 heads,
query latent 384, key/value latent 128, expert width 512), its head dims kept (128 + 64 rotated,
values 128), YaRN as V3's (factor 40, 4096 original positions, mscale 1, mscale_all_dim 1), 16
experts in 4 groups of which 2 per token, the top 4 of those, scaling factor 2.5, one shared expert
as wide as a routed one; 1024 tokens per rank.

    python benchmarks/deepseek_layer.py [--ep 1 2] [--seq 1024] [--reps 3] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings

import torch
import torch.distributed as dist

from common import print_table, run_interleaved, summarize, write_json

from megatron_ext import parallel_state as ext_ps
from megatron_ext.models.hf import load_hf_state_dict
from tests.distributed import run_distributed

# Per size: the layer's shape and routing. "v3/4": DeepSeek-V3's widths divided by 4.
SIZES = {
    "v3/4": dict(hidden=1792, heads=32, q_lora_rank=384, kv_lora_rank=128, qk_head_dim=128,
                 qk_pos_emb_head_dim=64, v_head_dim=128, experts=16, groups=4, group_topk=2, topk=4,
                 ffn=512, seq=1024),
    "quick": dict(hidden=64, heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                  v_head_dim=8, experts=8, groups=2, group_topk=1, topk=2, ffn=16, seq=32),
}
# DeepSeek-V3's YaRN and routing constants.
YARN_FACTOR, ORIGINAL_POSITIONS, SCALING_FACTOR = 40.0, 4096, 2.5
# The example's (Megatron-core's default); DeepSeek-V3's files say 1e-6.
NORM_EPSILON = 1e-5
VOCAB = 256  # the one-layer models' (the example's smallest); no embedding or output layer is timed
SEED = 1234

# megatron_ext's layer names -> Megatron-core's local spec's (the rest are the same).
MEGATRON_CORE_NAMES = {
    "self_attention.q_latent_norm.": "self_attention.q_layernorm.",
    "self_attention.kv_latent_norm.": "self_attention.kv_layernorm.",
    "post_attention_layernorm.": "pre_mlp_layernorm.",
    "mlp.shared_experts.dense_h_to_4h.": "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.dense_4h_to_h.": "mlp.shared_experts.linear_fc2.",
}


def train_gpt_argv(s: dict, ep: int) -> list[str]:
    """examples/train_gpt.py's command line for a one-layer DeepSeek model of sizes ``s``."""
    flags = dict(
        arch="deepseek", tp=1, pp=1, ep=ep, layers=1, hidden=s["hidden"], heads=s["heads"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"], qk_head_dim=s["qk_head_dim"],
        qk_pos_emb_head_dim=s["qk_pos_emb_head_dim"], v_head_dim=s["v_head_dim"], rope_type="yarn",
        rotary_scaling_factor=YARN_FACTOR, mscale=1.0, mscale_all_dim=1.0, num_experts=s["experts"],
        moe_router_topk=s["topk"], moe_router_num_groups=s["groups"], moe_router_group_topk=s["group_topk"],
        moe_router_topk_scaling_factor=SCALING_FACTOR, moe_ffn_hidden_size=s["ffn"],
        moe_token_dispatcher_type="alltoall", seq_len=s["seq"], vocab_size=VOCAB, dropout=0.0, seed=SEED,
    )
    return [part for name, value in flags.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def hf_model(s: dict):
    """transformers' one-layer DeepseekV3ForCausalLM of sizes ``s`` (the same on every rank)."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=VOCAB, hidden_size=s["hidden"], num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"], q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"],
        qk_nope_head_dim=s["qk_head_dim"], qk_rope_head_dim=s["qk_pos_emb_head_dim"],
        v_head_dim=s["v_head_dim"], num_hidden_layers=1, first_k_dense_replace=0,
        n_routed_experts=s["experts"], num_experts_per_tok=s["topk"], n_group=s["groups"],
        topk_group=s["group_topk"], n_shared_experts=1, moe_intermediate_size=s["ffn"],
        routed_scaling_factor=SCALING_FACTOR, num_nextn_predict_layers=0, rms_norm_eps=NORM_EPSILON,
        max_position_embeddings=ORIGINAL_POSITIONS * int(YARN_FACTOR),
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": YARN_FACTOR,
                         "original_max_position_embeddings": ORIGINAL_POSITIONS, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32)
    attention = model.model.layers[0].self_attn
    for norm in (attention.q_a_layernorm, attention.kv_a_layernorm):  # built with 1e-6 whatever the config
        norm.variance_epsilon = NORM_EPSILON
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # the norms away from 1 and a random expert bias (both start constant)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        bias = model.model.layers[0].mlp.gate.e_score_correction_bias
        bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
    return model.train()


def megatron_ext_layer(s: dict, hf_state: dict) -> torch.nn.Module:
    """megatron_ext's layer, built as examples/train_gpt.py builds it, with transformers' weights."""
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.model import build_model
    from megatron_ext.training.validation import check_args

    args = parse_args(train_gpt_argv(s, dist.get_world_size()))
    check_args(args, dist.get_world_size())
    ext_ps.initialize_model_parallel(expert_model_parallel_size=args.ep)
    (model,) = build_model(args)
    load_hf_state_dict(model, hf_state)
    return model.decoder.layers[0].train()


def megatron_core_layer(source: torch.nn.Module) -> torch.nn.Module:
    """Megatron-core's own layer, configured and weighted as megatron_ext's layer ``source``."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from benchmarks.megatron_core_gpt import bind_te_general_gemm, mla_without_te
    from megatron_ext.transformer.context_parallel import ContextParallelDotProductAttention

    bind_te_general_gemm()
    mla_without_te()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)
    ours = source.config
    config = MLATransformerConfig(**{
        f.name: getattr(ours, f.name) for f in dataclasses.fields(MLATransformerConfig)
        if f.init and hasattr(ours, f.name) and f.name != "finalize_model_grads_func"
    })
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm", multi_latent_attention=True, qk_layernorm=True)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    layer = build_module(spec, config=config, layer_number=1)
    state = {}
    for name, tensor in source.state_dict().items():
        for old, new in MEGATRON_CORE_NAMES.items():
            name = name.replace(old, new)
        state[name] = tensor
    missing, unexpected = layer.load_state_dict(state, strict=False)
    left = [name for name in missing if not name.startswith("self_attention.rotary_pos_emb.")]
    if left or unexpected:
        raise ValueError(f"weights not copied into Megatron-core's layer: {left}; unknown: {unexpected}")
    return layer.train()


def _variants(s: dict):
    """The layers, a prepare (a fresh non-leaf input [s, 1, h] and its output's gradient) and a
    run per layer, and a function giving each layer's largest differences from megatron_ext's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = hf_model(s)
        ours = megatron_ext_layer(s, source.state_dict())
        layers = {"megatron_ext": ours, "Megatron-core": megatron_core_layer(ours)}
    hf_layer, rotary = source.model.layers[0], source.model.rotary_emb
    if dist.get_world_size() == 1:
        layers["transformers"] = hf_layer
    positions = torch.arange(s["seq"])[None]

    def forward(name: str, x: torch.Tensor) -> torch.Tensor:
        if name == "transformers":  # [b, s, h], the rotary factors from its model's module
            x = x.transpose(0, 1)
            out = hf_layer(x, attention_mask=None, position_embeddings=rotary(x, positions))
            return out.transpose(0, 1)
        out = layers[name](x, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out  # Megatron-core's: (output, context)

    generator = torch.Generator().manual_seed(dist.get_rank())

    def randn() -> torch.Tensor:
        return torch.randn(s["seq"], 1, s["hidden"], generator=generator)

    def prepare() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = randn().requires_grad_()
        return leaf, leaf * 1.0, randn()

    def step(name: str):
        def run(prepared) -> None:
            _, x, grad = prepared
            forward(name, x).backward(grad)

        return run

    def differences() -> dict[str, dict[str, float]]:
        leaf, _, grad = prepare()
        results = {}
        for name in layers:
            x = leaf.detach().clone().requires_grad_()
            out = forward(name, x * 1.0)
            out.backward(grad)
            results[name] = (out.detach(), x.grad)
        out, x_grad = results["megatron_ext"]
        scale = {"output_max_abs": float(out.abs().max()),
                 "update_max_abs": float((out - leaf.detach()).abs().max()),
                 "input_grad_max_abs": float(x_grad.abs().max()),
                 "grad_update_max_abs": float((x_grad - grad).abs().max())}
        return {name: {"output": float((o - out).abs().max()), "input_grad": float((g - x_grad).abs().max()),
                       **scale} for name, (o, g) in results.items()}

    experts = source.config._experts_implementation
    return {name: step(name) for name in layers}, prepare, differences, experts


def _worker(args) -> dict:
    """One CPU rank (gloo, one thread), float32, Megatron-core with the CPU patches."""
    torch.set_num_threads(1)
    from benchmarks.megatron_core_gpt import cpu_patches

    cpu_patches(full=True)
    variants, prepare, differences, experts = _variants(args.sizes)
    results = run_interleaved(variants, args.reps, prepare=prepare)
    difference = differences()
    ext_ps.destroy_model_parallel()
    return {"results": results, "differences": difference, "transformers_experts": experts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2], help="expert-parallel sizes (ranks)")
    p.add_argument("--seq", type=int, default=None, help="tokens per rank (one sequence)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny shapes, one repetition")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.sizes = dict(SIZES["quick" if args.quick else "v3/4"])
    if args.quick:
        args.reps = 1
    if args.seq is not None:
        args.sizes["seq"] = args.seq
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave the resident set
    load_at_start = os.getloadavg()
    summary, differences = {}, {}
    for ep in args.ep:
        per_rank = run_distributed(ep, _worker, args, timeout=3600)
        summary[str(ep)] = summarize([r["results"] for r in per_rank])
        differences[str(ep)] = {  # the largest of each over the ranks
            name: {key: max(r["differences"][name][key] for r in per_rank) for key in first}
            for name, first in per_rank[0]["differences"].items()
        }
    s = args.sizes
    print(f"DeepSeek-V3-style layer fwd+bwd per rank, float32, hidden {s['hidden']}, {s['heads']} heads, "
          f"q/kv latents {s['q_lora_rank']}/{s['kv_lora_rank']}, {s['experts']} experts top-{s['topk']} "
          f"({s['groups']} groups, {s['group_topk']} per token) + shared, expert width {s['ffn']}, "
          f"{s['seq']} tokens per rank, one CPU thread per rank")
    for ep, rows in summary.items():
        print_table(f"ep {ep}", rows, "Megatron-core")
        for name, d in differences[ep].items():
            print(f"  {name}: largest difference from megatron_ext: output {d['output']:.3g} (output up "
                  f"to {d['output_max_abs']:.3g}, the layer's update to its input up to "
                  f"{d['update_max_abs']:.3g}), input gradient {d['input_grad']:.3g} (up to "
                  f"{d['input_grad_max_abs']:.3g}, the layer's part up to {d['grad_update_max_abs']:.3g})")
    write_json("deepseek_layer", {"args": vars(args), "load_average_at_start": load_at_start,
                                  "transformers_experts_implementation": per_rank[0]["transformers_experts"],
                                  "summary": summary, "max_difference": differences}, args.json)


if __name__ == "__main__":
    main()
