"""The gated delta rule (Gated DeltaNet's linear attention) forward+backward on the CPU: megatron_ext's
``chunk_gated_delta_rule`` against transformers' Qwen3-Next ``torch_chunk_gated_delta_rule`` (the torch
fallback transformers runs without flash-linear-attention), in the same run.

q, k [1, T, H, K], v [1, T, H, V] in float32 (or bfloat16), g = -softplus(randn) / 4 (log decay), beta =
sigmoid(randn), q and k L2-normalised inside both (as Qwen3-Next calls them), chunks of 64, no initial
state. Every run gets fresh inputs made outside its time and memory; the output's gradient is handed to
q, k, v, g and beta with ``torch.autograd.grad``. Timing and memory method: benchmarks/common.py. The
largest difference of output and gradients from transformers', relative to their largest value, is
reported beside the times.

    ./dev.sh bench gated_delta_rule [--lengths 4096 16384] [--heads 4] [--head-dim 64] [--threads 1]
        [--dtype float32] [--reps 3] [--without-transformers]
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from common import print_table, run_interleaved, summarize, write_json

from megatron_ext.fusions import chunk_gated_delta_rule
from tests.distributed import run_distributed


def _transformers() -> Callable | None:
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError:
        return None
    return torch_chunk_gated_delta_rule


def _fresh(length: int, heads: int, dim: int, dtype: torch.dtype) -> Callable:
    def prepare():
        q, k = torch.randn(1, length, heads, dim), torch.randn(1, length, heads, dim)
        v = torch.randn(1, length, heads, dim)
        g = -F.softplus(torch.randn(1, length, heads)) / 4
        beta = torch.sigmoid(torch.randn(1, length, heads))
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [g.requires_grad_(), beta.to(dtype)]
        inputs[4].requires_grad_()
        return inputs, torch.randn(1, length, heads, dim).to(dtype)
    return prepare


def _variants(hf: Callable | None) -> dict[str, Callable]:
    fns = {"megatron_ext chunk_gated_delta_rule":
           lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0]}
    if hf is not None:
        fns["transformers torch_chunk_gated_delta_rule"] = (
            lambda q, k, v, g, b: hf(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0])
    return fns


def _step(fn: Callable) -> Callable:
    def run(prepared) -> None:
        inputs, grad = prepared
        torch.autograd.grad(fn(*inputs), inputs, grad)
    return run


def _differences(fns: dict[str, Callable], prepare: Callable) -> dict[str, float]:
    """Each variant's largest |difference| of output and gradients from the last variant's (transformers'
    where it runs), relative to the last's largest value."""
    inputs, grad = prepare()
    values = {}
    for name, fn in fns.items():
        out = fn(*inputs)
        values[name] = [out.detach().float()] + [t.float() for t in torch.autograd.grad(out, inputs, grad)]
    last = values[list(fns)[-1]]
    return {name: max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(vals, last))
            for name, vals in values.items()}


def _worker(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fns = _variants(None if args.without_transformers else _transformers())
    dtype = getattr(torch, args.dtype)
    rows = {}
    for length in args.lengths:
        prepare = _fresh(length, args.heads, args.head_dim, dtype)
        rows[f"T={length}"] = {
            "diff": _differences(fns, prepare),
            "timings": run_interleaved({name: _step(fn) for name, fn in fns.items()}, args.reps, prepare),
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--without-transformers", action="store_true", help="megatron_ext's variant only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    (rows,) = run_distributed(1, _worker, args, timeout=3600)
    summary = {}
    for label, row in rows.items():
        summary[label] = {"results": summarize([row["timings"]]), "relative_diff_vs_last": row["diff"]}
        names = list(summary[label]["results"])
        print_table(f"gated delta rule {label} H={args.heads} K=V={args.head_dim} {args.dtype} fwd+bwd, "
                    f"{args.threads} thread(s)", summary[label]["results"], baseline=names[-1], unit="ms")
        print("max relative difference vs " + names[-1] + ": "
              + ", ".join(f"{k} {v:.1e}" for k, v in row["diff"].items()))
        print()
    write_json("gated_delta_rule", {"args": vars(args), "summary": summary}, args.json)


if __name__ == "__main__":
    main()
