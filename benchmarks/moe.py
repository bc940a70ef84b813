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

    python benchmarks/moe.py [--ep 1 2 4] [--experts 8] [--topk 2] [--hidden 1024] [--ffn 2816]
                             [--tokens 2048] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import print_table, run_interleaved, summarize, write_json

from megatron_ext import parallel_state as ext_ps
from megatron_ext.transformer import TransformerConfig as ExtConfig
from megatron_ext.transformer.moe import MoELayer as ExtMoELayer
from tests.distributed import run_distributed

DTYPE = torch.float32


def _fields(args, dispatcher: str, grouped: bool) -> dict[str, Any]:
    return dict(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=args.ffn,
        moe_ffn_hidden_size=args.ffn, num_moe_experts=args.experts, moe_router_topk=args.topk,
        expert_model_parallel_size=dist.get_world_size(), moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=DTYPE, use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0, bias_activation_fusion=False, gradient_accumulation_fusion=False,
    )


def _megatron_core_layers(args) -> dict[str, torch.nn.Module]:
    """Megatron-core's MoELayer with SequentialMLP experts, per dispatcher."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from benchmarks.megatron_core_gpt import bind_te_general_gemm

    bind_te_general_gemm()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    layers = {}
    for dispatcher in ("allgather", "alltoall"):
        config = TransformerConfig(**_fields(args, dispatcher, False))
        spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False).submodules.mlp
        torch.manual_seed(1234)
        layers[dispatcher] = build_module(spec, config=config, layer_number=1)
    return layers


def _worker(args) -> dict:
    torch.set_num_threads(1)
    from benchmarks.megatron_core_gpt import cpu_patches

    cpu_patches(full=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = {} if args.without_megatron_core else _megatron_core_layers(args)
    ext_ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    ours = {}
    for name, dispatcher, grouped in (
        ("megatron_ext SequentialMLP allgather", "allgather", False),
        ("megatron_ext SequentialMLP alltoall", "alltoall", False),
        ("megatron_ext GroupedMLP alltoall", "alltoall", True),
    ):
        torch.manual_seed(1234)
        ours[name] = ExtMoELayer(ExtConfig(**_fields(args, dispatcher, grouped)), layer_number=1)
    if reference:  # the same weights: Megatron-core's (router and SequentialMLP store them alike)
        source = reference["allgather"]
        for layer in (reference["alltoall"], ours["megatron_ext SequentialMLP allgather"],
                      ours["megatron_ext SequentialMLP alltoall"]):
            layer.load_state_dict(source.state_dict(), strict=False)

    generator = torch.Generator().manual_seed(dist.get_rank())

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = torch.randn(args.tokens, 1, args.hidden, generator=generator, dtype=DTYPE).requires_grad_()
        return leaf, leaf * 1.0, torch.randn(args.tokens, 1, args.hidden, generator=generator, dtype=DTYPE)

    def step(layer: torch.nn.Module):
        def run(prepared) -> None:
            _, x, grad = prepared
            out, _ = layer(x)
            out.backward(grad)

        return run

    variants = {name: step(layer) for name, layer in ours.items()}
    variants.update({f"Megatron-core {d}": step(layer) for d, layer in reference.items()})
    results = run_interleaved(variants, args.reps, prepare=inputs)
    # The same weights and inputs give the same output (a check that the variants compare alike).
    _, x, _ = inputs()
    layers = {**ours, **{f"Megatron-core {d}": layer for d, layer in reference.items()}}
    outputs = {name: layer(x)[0].detach() for name, layer in layers.items()}
    first = outputs["megatron_ext SequentialMLP allgather"]
    differences = {name: float((out - first).abs().max()) for name, out in outputs.items()
                   if "GroupedMLP" not in name}
    ext_ps.destroy_model_parallel()
    return {"results": results, "max_output_difference": differences}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny shapes, ep 2, one repetition")
    p.add_argument("--without-megatron-core", action="store_true", help="megatron_ext only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.ep, args.experts, args.hidden, args.ffn, args.tokens, args.reps = [2], 4, 16, 24, 32, 1
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave the resident set
    summary, differences = {}, {}
    for ep in args.ep:
        per_rank = run_distributed(ep, _worker, args, timeout=3600)
        summary[str(ep)] = summarize([r["results"] for r in per_rank])
        differences[str(ep)] = max(
            (r["max_output_difference"] for r in per_rank), key=lambda d: max(d.values())
        )
    print(
        f"MoE layer fwd+bwd per rank, float32, E {args.experts} top-{args.topk}, hidden {args.hidden}, "
        f"ffn {args.ffn} (SwiGLU), {args.tokens} tokens per rank, one CPU thread per rank"
    )
    for ep, rows in summary.items():
        baseline = "Megatron-core allgather" if "Megatron-core allgather" in rows else None
        print_table(f"ep {ep}", rows, baseline)
        print(f"  largest output difference to megatron_ext SequentialMLP allgather: {differences[ep]}")
    write_json("moe", {"args": vars(args), "summary": summary, "max_output_difference": differences},
               args.json)


if __name__ == "__main__":
    main()
