"""The mixture-of-experts layer's forward + backward per rank, float32, on CPU processes (gloo, one
thread each) at expert-parallel sizes 1, 2 and 4: megatron_ext's ``MoELayer`` (``SequentialMLP``
and ``GroupedMLP`` experts, both dispatchers) against Megatron-core 0.16.1's own ``MoELayer``
(its ``TopKRouter``, ``allgather`` and ``alltoall`` dispatchers and ``SequentialMLP``, run as it is
with the CPU patches of ``benchmarks/megatron_core_gpt.py``), in the same run, variants
interleaved. Both start from the same weights (Megatron-core's, copied).

Every rank holds its own ``--tokens`` tokens (the layer's input as a transformer layer hands it
over: a fresh non-leaf tensor each repetition) and the ``E / ep`` experts of its expert-parallel
rank; the output gets a fresh gradient each repetition (``output.backward(grad)``), as the next
layer would give it. Timing and memory method: benchmarks/common.py.

``--device cuda`` runs the same variants in one process on one GPU (ep 1), in bfloat16, Megatron-core
as it is (no CPU patches), each run timed with CUDA events (benchmarks/gpu.py's method: min /
median / max milliseconds and the peak extra device memory), at a Mixtral 8x7B layer's sizes
(hidden 4096, ffn 14336, 8192 tokens); ``./dev.sh gpu`` runs it.

Three layers each (``--variants``): SwiGLU experts with top-k softmax routing; gpt-oss's experts
(quick GEGLU with ``glu_linear_offset`` 1 and ``activation_func_clamp_value`` 7, biases in the
router and the experts); DeepSeek-V3's routing (group-limited sigmoid routing, 4 groups of which 2
per token, with the expert bias and the scaling factor). Megatron-core's local layer runs all
three on CPU (its unfused gated unit and its own group-limited top-k), the gpt-oss one from ep 2:
at ep 1 its biased expert MLP adds the bias in place to the output of an identity autograd
function, which torch refuses (megatron_ext's layers alone are timed there, on GPUs too).

    python benchmarks/moe.py [--ep 1 2 4] [--experts 8] [--topk 2] [--hidden 1024] [--ffn 2816]
                             [--tokens 2048] [--reps 3] [--variants swiglu gpt-oss group-limited] [--quick]
    python benchmarks/moe.py --device cuda [--json runs/gpu_moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import megatron_core_version, print_table, run_interleaved, summarize, write_json

from megatron_ext import parallel_state as ext_ps
from megatron_ext import tensor_parallel as ext_tp
from megatron_ext.fusions import quick_gelu as ext_quick_gelu
from megatron_ext.transformer import TransformerConfig as ExtConfig
from megatron_ext.transformer.moe import MoELayer as ExtMoELayer
from tests.distributed import run_distributed

DTYPE = torch.float32


# The layers timed: SwiGLU experts with top-k softmax routing; gpt-oss's experts (quick GEGLU with
# the offset and the clamp, biases in the router and the experts); DeepSeek-V3's routing
# (group-limited sigmoid routing with the expert bias and the scaling factor).
VARIANTS = {
    "swiglu": {},
    # Fused: Megatron-core's quick_gelu is a torch.compile function (a fused kernel keeping only its
    # input) whichever path; its fused path for the experts is weighted_bias_quick_geglu_impl.
    "gpt-oss": dict(activation_func="quick_gelu", glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                    add_bias_linear=True, bias_activation_fusion=True),
    "group-limited": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                          moe_router_num_groups=4, moe_router_group_topk=2,
                          moe_router_topk_scaling_factor=2.5),
}


def _fields(args, dispatcher: str, grouped: bool, quick_gelu) -> dict[str, Any]:
    """The layer's config for ``args.variant`` (``quick_gelu``: the library's own function); on a
    GPU in ``args.dtype``, with ``use_cpu_initialization=False`` (Megatron-core then draws its
    weights on the GPU; megatron_ext draws its experts on the CPU either way)."""
    on_gpu = args.device == "cuda"
    variant = {k: quick_gelu if v == "quick_gelu" else v for k, v in VARIANTS[args.variant].items()}
    return dict(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=args.ffn,
        moe_ffn_hidden_size=args.ffn, num_moe_experts=args.experts, moe_router_topk=args.topk,
        expert_model_parallel_size=dist.get_world_size(), moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=getattr(torch, args.dtype) if on_gpu else DTYPE,
        use_cpu_initialization=not on_gpu,
        moe_aux_loss_coeff=0.0, bias_activation_fusion=False, gradient_accumulation_fusion=False,
    ) | variant


def _megatron_core_layers(args) -> dict[str, torch.nn.Module]:
    """Megatron-core's MoELayer with SequentialMLP experts, per dispatcher."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from benchmarks.megatron_core_gpt import bind_te_general_gemm

    bind_te_general_gemm()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    tensor_parallel.model_parallel_cuda_manual_seed(
        1234, **({"inference_rng_tracker": True} if args.device == "cpu" else {}))
    layers = {}
    for dispatcher in ("allgather", "alltoall"):
        config = TransformerConfig(**_fields(args, dispatcher, False, quick_gelu))
        spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False).submodules.mlp
        torch.manual_seed(1234)
        layers[dispatcher] = build_module(spec, config=config, layer_number=1)
    return layers


def _variants(args, device: torch.device, dtype: torch.dtype):
    """The layers on ``device`` in ``dtype`` (with Megatron-core installed, megatron_ext's
    SequentialMLP layers start from its weights; the GroupedMLP layer draws its own) and, per
    variant, its prepare (a fresh input made by an op, and the output's gradient) and its run
    (forward, then the gradient handed to the input's producer). Also returns a function giving
    each layer's largest output difference from megatron_ext's SequentialMLP allgather layer."""
    # Megatron-core's biased expert MLP fails at ep 1: it adds its second bias in place to the
    # output of its identity reduction region (an autograd function's input returned as is).
    biased_at_ep_1 = args.variant == "gpt-oss" and dist.get_world_size() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = {} if args.without_megatron_core or biased_at_ep_1 else _megatron_core_layers(args)
    ext_ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    ext_tp.model_parallel_cuda_manual_seed(1234)  # the trackers a GPU initialisation draws from
    ours = {}
    for name, dispatcher, grouped in (
        ("megatron_ext SequentialMLP allgather", "allgather", False),
        ("megatron_ext SequentialMLP alltoall", "alltoall", False),
        ("megatron_ext GroupedMLP alltoall", "alltoall", True),
    ):
        torch.manual_seed(1234)
        # Weights about to be overwritten by Megatron-core's are not drawn (a Mixtral-sized
        # layer's experts are 1.4e9 draws on the CPU).
        fields = dict(_fields(args, dispatcher, grouped, ext_quick_gelu),
                      perform_initialization=grouped or not reference)
        ours[name] = ExtMoELayer(ExtConfig(**fields), layer_number=1)
    if reference:  # the same weights: Megatron-core's (router and SequentialMLP store them alike)
        source = reference["allgather"]
        for layer in (reference["alltoall"], ours["megatron_ext SequentialMLP allgather"],
                      ours["megatron_ext SequentialMLP alltoall"]):
            layer.load_state_dict(source.state_dict(), strict=False)
    layers = {**ours, **{f"Megatron-core {d}": layer for d, layer in reference.items()}}
    for layer in layers.values():  # as Megatron-LM's Float16Module: the whole layer in one dtype
        layer.to(device=device, dtype=dtype)

    generator = torch.Generator(device=device).manual_seed(dist.get_rank())

    def randn() -> torch.Tensor:
        return torch.randn(args.tokens, 1, args.hidden, generator=generator, device=device, dtype=dtype)

    def prepare() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = randn().requires_grad_()
        return leaf, leaf * 1.0, randn()

    def step(layer: torch.nn.Module):
        def run(prepared) -> None:
            _, x, grad = prepared
            out, _ = layer(x)
            out.backward(grad)

        return run

    def differences() -> dict[str, float]:
        _, x, _ = prepare()
        outputs = {name: layer(x)[0].detach().float() for name, layer in layers.items()}
        first = outputs["megatron_ext SequentialMLP allgather"]
        return {name: float((out - first).abs().max()) for name, out in outputs.items()
                if "GroupedMLP" not in name}

    return {name: step(layer) for name, layer in layers.items()}, prepare, differences


def _worker(args) -> dict:
    """One CPU rank (gloo, one thread), float32, Megatron-core with the CPU patches."""
    torch.set_num_threads(1)
    from benchmarks.megatron_core_gpt import cpu_patches

    cpu_patches(full=True)
    variants, prepare, differences = _variants(args, torch.device("cpu"), DTYPE)
    results = run_interleaved(variants, args.reps, prepare=prepare)
    # The same weights and inputs give the same output (a check that the variants compare alike).
    difference = differences()
    ext_ps.destroy_model_parallel()
    return {"results": results, "max_output_difference": difference}


def run_on_gpu(args) -> dict:
    """Every variant on one GPU (a one-rank NCCL group, ep 1), in ``args.dtype``, Megatron-core as
    it is; timed with CUDA events (benchmarks/gpu.py's ``time_variants``)."""
    from gpu import time_variants

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        variants, prepare, differences = _variants(args, device, getattr(torch, args.dtype))
        stats = time_variants({name: (prepare, run) for name, run in variants.items()}, args.reps, device)
        difference = differences()
    finally:
        ext_ps.destroy_model_parallel()
        dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name(device), "variants": stats,
            "max_output_difference": difference}


# Per device: hidden, ffn, tokens (per rank), repetitions. The GPU's: a Mixtral 8x7B layer at 8192 tokens.
SIZES = {"cpu": (1024, 2816, 2048, 3), "cuda": (4096, 14336, 8192, 10)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: --ep CPU processes each; cuda: one GPU, ep 1")
    p.add_argument("--ep", type=int, nargs="+", default=None, help="cpu only (default 1 2 4)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="cuda only")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="the layers: SwiGLU experts; gpt-oss's experts (clamped quick GEGLU, biases); "
                   "DeepSeek-V3's group-limited sigmoid routing")
    p.add_argument("--quick", action="store_true", help="tiny shapes, ep 2, one repetition")
    p.add_argument("--without-megatron-core", action="store_true", help="megatron_ext only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for field, default in zip(("hidden", "ffn", "tokens", "reps"), SIZES[args.device]):
        if getattr(args, field) is None:
            setattr(args, field, default)
    if args.device == "cuda":
        if args.ep not in (None, [1]):
            raise SystemExit(f"benchmarks/moe.py --device cuda runs on one GPU at ep 1, got --ep {args.ep}")
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/moe.py --device cuda needs a CUDA GPU")
        results = {}
        for variant in args.variants:
            args.variant = variant
            result = results[variant] = run_on_gpu(args)
            print(f"MoE layer fwd+bwd on {result['device']}, {args.dtype}, {variant}, E {args.experts} "
                  f"top-{args.topk}, hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens")
            rows = result["variants"]
            base = rows.get("Megatron-core allgather")
            for name, r in rows.items():
                ratio = f" {r['median_ms'] / base['median_ms']:6.2f}x Megatron-core allgather" if base else ""
                print(f"  {name:38s} {r['min_ms']:9.2f} {r['median_ms']:9.2f} {r['max_ms']:9.2f} ms "
                      f"peak extra {r['peak_extra_mib']:9.1f} MiB{ratio}")
            print(f"  largest output difference to megatron_ext SequentialMLP allgather: "
                  f"{result['max_output_difference']}")
        path = args.json or "runs/gpu_moe.json"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__,
                       "megatron_core": megatron_core_version(),
                       "timing_method": "variants interleaved rep by rep, first rep a warm-up; CUDA events "
                                        "around one forward + backward; min/median/max over reps",
                       "results": results}, f, indent=2)
        print(f"wrote {path}")
        return
    args.ep = args.ep or [1, 2, 4]
    if args.quick:
        args.ep, args.experts, args.hidden, args.ffn, args.tokens, args.reps = [2], 4, 16, 24, 32, 1
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave the resident set
    summary, differences = {}, {}
    for variant in args.variants:
        args.variant = variant
        for ep in args.ep:
            per_rank = run_distributed(ep, _worker, args, timeout=3600)
            summary.setdefault(variant, {})[str(ep)] = summarize([r["results"] for r in per_rank])
            differences.setdefault(variant, {})[str(ep)] = max(
                (r["max_output_difference"] for r in per_rank), key=lambda d: max(d.values())
            )
    print(
        f"MoE layer fwd+bwd per rank, float32, E {args.experts} top-{args.topk}, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.tokens} tokens per rank, one CPU thread per rank"
    )
    for variant, per_ep in summary.items():
        for ep, rows in per_ep.items():
            baseline = "Megatron-core allgather" if "Megatron-core allgather" in rows else None
            print_table(f"{variant}, ep {ep}", rows, baseline)
            print(f"  largest output difference to megatron_ext SequentialMLP allgather: "
                  f"{differences[variant][ep]}")
    args.variant = None
    write_json("moe", {"args": vars(args), "summary": summary, "max_output_difference": differences},
               args.json)


if __name__ == "__main__":
    main()
