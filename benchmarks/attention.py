"""Causal attention forward+backward (softmax(q k^T / sqrt(d)) v over given q, k, v), float32, one
CPU process with one thread, at sequence lengths 1k to 8k: megatron_ext's default attention
(torch's scaled_dot_product_attention), its unfused attention (``attention_backend="unfused"``,
the path it had before) and megatron-core 0.16.1's own unfused DotProductAttention (its local
backend). The peak extra memory is what matters: the unfused paths hold the ``[b, heads, s, s]``
scores and probabilities, SDPA does not. Timing and memory method: benchmarks/common.py.

    ./dev.sh bench attention [--seq 1024 2048 4096 8192] [--heads 8] [--head-dim 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from common import import_megatron_core, require_megatron_core, run_interleaved, summarize, write_json

from megatron_ext import parallel_state as ps
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.attention import ParallelAttention
from tests.distributed import run_distributed


def _ours(backend: str, heads: int, head_dim: int) -> ParallelAttention:
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               attention_dropout=0.0, use_cpu_initialization=True,
                               attention_backend=backend)
    return ParallelAttention(config)


def _megatron_core(heads: int, head_dim: int):
    """megatron-core's DotProductAttention (tp 1, its parallel_state initialised); its scores
    buffer comes from a global memory buffer it allocates on torch.cuda.current_device(), sent to
    the CPU here, and its dropout's CUDA RNG fork is skipped (dropout 0)."""
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig as McoreConfig

    mps.initialize_model_parallel()
    # Its dropout forks a CUDA RNG stream; with dropout 0 nothing is drawn: no fork on the CPU.
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    config = McoreConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                         attention_dropout=0.0, use_cpu_initialization=True)
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self")


def _worker(args) -> dict:
    torch.set_num_threads(1)
    ps.initialize_model_parallel()
    ours = {backend: _ours(backend, args.heads, args.head_dim) for backend in ("auto", "unfused")}
    mcore = None
    if not args.without_megatron_core and import_megatron_core() is not None:
        mcore = _megatron_core(args.heads, args.head_dim)
    results = {}
    for s in args.seq:
        shape = (1, args.heads, s, args.head_dim)  # [b, n, s, d]

        def inputs():
            # Fresh each rep, produced by an op as the QKV projection would produce them.
            base = torch.randn(3, *shape)
            q, k, v = (t.clone().requires_grad_() for t in base)
            return q, k, v

        def run_ours(layer):
            def step():
                q, k, v = inputs()
                out = layer.core_attention(q, k, v)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            return step

        variants = {
            "megatron_ext (sdpa)": run_ours(ours["auto"]),
            "megatron_ext unfused": run_ours(ours["unfused"]),
        }
        if mcore is not None:
            # Its default causal mask is made on "cuda": it is given the same mask on the CPU.
            causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)

            def run_mcore():
                q, k, v = inputs()
                # megatron-core takes [s, b, n, d]
                out = mcore(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), attention_mask=causal)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            variants["megatron-core DotProductAttention"] = run_mcore
        if args.only:
            variants = {name: run for name, run in variants.items() if name in args.only}
        results[str(s)] = run_interleaved(variants, args.reps)
    ps.destroy_model_parallel()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--without-megatron-core", action="store_true", help="megatron_ext's paths only")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these variants (a process that ran none of the others measures "
                        "its memory from a fresh heap)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    require_megatron_core(args.without_megatron_core)
    (per_seq,) = run_distributed(1, _worker, args, timeout=3600)
    summary = {s: summarize([r]) for s, r in per_seq.items()}
    print(f"causal attention fwd+bwd, float32, b 1, {args.heads} heads x {args.head_dim}, one CPU thread")
    print(f"{'seq':>6} {'variant':<36} {'median s':>9} {'min':>8} {'max':>8} {'peak extra MiB':>15}")
    for s, rows in summary.items():
        for name, r in rows.items():
            print(f"{s:>6} {name:<36} {r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['max_s']:>8.3f} "
                  f"{r['peak_extra_mib']:>15.1f}")
    write_json("attention", {"args": vars(args), "summary": summary}, args.json)


if __name__ == "__main__":
    main()
