"""The Mamba-2 SSD scan forward+backward on one CPU thread: megatron_ext's ``mamba_chunk_scan_combined``
(one C++ op saving only the chunk-boundary states) against transformers' ``mamba2_chunk_scan``, the torch
path its ``Mamba2Mixer`` runs without mamba-ssm's kernels (chunked einsums over materialised
[chunks, chunk, chunk] decay masks), in the same run.

Both take x [1, L, H, P], dt [1, L, H], B and C [1, L, G, N], A, D and dt_bias [H] with ``dt_softplus``
(the mixer's call). Every run gets fresh inputs made by an op outside its time and memory; the output's
gradient is handed on with ``torch.autograd.grad`` to every input. Timing and memory method:
benchmarks/common.py. Each variant's largest difference from the first one (output and gradients,
relative to their largest value) is reported beside its time.

    ./dev.sh bench mamba_scan [--lengths 4096 16384] [--heads 8] [--headdim 64] [--dstate 64]
        [--groups 1] [--chunk 128] [--dtype float32] [--reps 3]
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from common import print_table, run_interleaved, summarize, write_json

from megatron_ext.fusions.mamba_ssd import mamba_chunk_scan_combined
from tests.distributed import run_distributed


def _transformers_scan() -> Callable | None:
    try:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    except ImportError:
        return None
    return mamba2_chunk_scan


def _prepare(args, length: int, dtype: torch.dtype) -> Callable:
    H, P, N, G = args.heads, args.headdim, args.dstate, args.groups

    def prepare():
        x = torch.randn(1, length, H, P).to(dtype).requires_grad_()
        dt = torch.randn(1, length, H).to(dtype).requires_grad_()
        B = torch.randn(1, length, G, N).to(dtype).requires_grad_()
        C = torch.randn(1, length, G, N).to(dtype).requires_grad_()
        return (x, dt, B, C), torch.randn(1, length, H, P).to(dtype)
    return prepare


def _step(fn: Callable, params: tuple[torch.Tensor, ...]) -> Callable:
    def run(inputs) -> None:
        tensors, grad = inputs
        torch.autograd.grad(fn(*tensors), (*tensors, *params), grad)
    return run


def _differences(fns: dict[str, Callable], params: tuple[torch.Tensor, ...], prepare: Callable) -> dict:
    tensors, grad = prepare()
    first, diffs = None, {}
    for name, fn in fns.items():
        out = fn(*tensors)
        grads = torch.autograd.grad(out, (*tensors, *params), grad)
        values = (out.detach().float(), *(g.float() for g in grads))
        first = first or values
        diffs[name] = max(((v - f).abs().max() / f.abs().max()).item() for v, f in zip(values, first))
    return diffs


def _worker(args) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    H = args.heads
    A = (-torch.exp(torch.rand(H) * 2 - 1)).requires_grad_()
    D = torch.ones(H).requires_grad_()
    dt_bias = (torch.rand(H) - 2).requires_grad_()
    params = (A, D, dt_bias)
    hf = _transformers_scan()
    rows = {}
    for length in args.lengths:
        def ours(x, dt, B, C):
            return mamba_chunk_scan_combined(x, dt, A, B, C, args.chunk, D=D, dt_bias=dt_bias,
                                             dt_softplus=True)

        fns = {"megatron_ext": ours}
        if hf is not None:
            fns["transformers torch path"] = lambda x, dt, B, C: hf(
                x, dt, A, B, C, args.chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        prepare = _prepare(args, length, dtype)
        diff = _differences(fns, params, prepare)
        timings = run_interleaved({name: _step(fn, params) for name, fn in fns.items()}, args.reps, prepare)
        rows[f"L={length}"] = {"timings": timings, "diff": diff}
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dstate", type=int, default=64)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    (rows,) = run_distributed(1, _worker, args, timeout=3600)
    summary = {}
    for case, row in rows.items():
        summary[case] = {"results": summarize([row["timings"]]), "relative_diff_vs_first": row["diff"]}
        names = list(summary[case]["results"])
        title = (f"SSD scan fwd+bwd {case} H={args.heads} P={args.headdim} N={args.dstate} G={args.groups} "
                 f"chunk={args.chunk} {args.dtype}, one CPU thread")
        print_table(title, summary[case]["results"], baseline=names[-1], unit="ms")
        print("max relative difference vs " + names[0] + ": "
              + ", ".join(f"{k} {v:.1e}" for k, v in row["diff"].items()))
        print()
    write_json("mamba_scan", {"args": vars(args), "summary": summary}, args.json)


if __name__ == "__main__":
    main()
