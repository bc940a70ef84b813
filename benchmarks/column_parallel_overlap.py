"""Backward of a column-parallel linear at TP=2 on CPU (gloo): the input-gradient all-reduce
overlapped with the weight-gradient GEMM (megatron_ext's C++ op) against the same computation with
the all-reduce waited on before the weight-gradient GEMM.

    PYTHONPATH=. python benchmarks/column_parallel_overlap.py [--tokens 4096 --hidden 1024 --reps 7]

Rows:
  megatron_ext op (overlap)   out.backward() through linear_with_grad_accumulation_and_async_allreduce
  torch ops, overlapped       the same GEMMs with dist.all_reduce(async_op=True) waited after the wgrad
  torch ops, not overlapped   the same GEMMs with a blocking dist.all_reduce before the wgrad
  parts: dgrad GEMM, wgrad GEMM (+ bias sum), all-reduce of the input gradient, each alone

A time is the slowest rank's, the median over ``--reps`` after ``--warmup`` runs. Prints a table
and writes JSON to benchmarks/results/column_parallel_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "column_parallel_overlap.json")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_ext import parallel_state
    from megatron_ext import tensor_parallel as tp_

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    out_per_rank = args.ffn // world
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_(True)
    w = (torch.randn(out_per_rank, args.hidden, generator=g) * 0.02).requires_grad_(True)
    b = torch.zeros(out_per_rank, requires_grad=True)
    grad = torch.randn(args.tokens, out_per_rank, generator=g)
    xd = x.detach()

    def ours() -> Callable[[], None]:
        # The op's forward runs before the timed region: only its backward is measured.
        x.grad = w.grad = b.grad = None
        out = tp_.linear_with_grad_accumulation_and_async_allreduce(
            x, w, b, gradient_accumulation_fusion=False, allreduce_dgrad=True, sequence_parallel=False
        )
        return lambda: out.backward(grad)

    def torch_ops(overlap: bool) -> Callable[[], None]:
        def run() -> None:
            grad_input = grad @ w.detach()
            work = dist.all_reduce(grad_input, group=group, async_op=overlap)
            grad_weight = grad.t() @ xd
            grad_bias = grad.sum(0)
            if overlap:
                work.wait()
            del grad_input, grad_weight, grad_bias

        return lambda: run

    dgrad_buffer = grad @ w.detach()
    variants: dict[str, Callable[[], Callable[[], None]]] = {
        "megatron_ext op (overlap)": ours,
        "torch ops, overlapped": torch_ops(True),
        "torch ops, not overlapped": torch_ops(False),
        "dgrad GEMM": lambda: lambda: grad @ w.detach(),
        "wgrad GEMM + bias sum": lambda: lambda: (grad.t() @ xd, grad.sum(0)),
        "all-reduce of the input gradient": lambda: lambda: dist.all_reduce(dgrad_buffer, group=group),
    }
    # Variants take turns within each repetition, so load from other processes on the machine
    # falls on all of them alike.
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.reps):
        for name, prepare in variants.items():
            run = prepare()
            dist.barrier()
            start = time.perf_counter()
            run()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[name].append(elapsed.item())
    rows = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        queue.put(rows)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096, help="full output size (split over TP)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.tp, port, args, queue)) for r in range(args.tp)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()

    baseline = rows["torch ops, not overlapped"]
    print(f"column-parallel linear backward, TP={args.tp} gloo on CPU, tokens={args.tokens}, "
          f"hidden={args.hidden} -> {args.ffn}/{args.tp}, float32, {args.threads} thread(s)/rank, "
          f"median of {args.reps}")
    print(f"{'':36s} {'ms':>9s} {'vs not overlapped':>18s}")
    for name, seconds in rows.items():
        ratio = f"{baseline / seconds:.2f}x" if not name.startswith(("dgrad", "wgrad", "all-reduce")) else ""
        print(f"{name:36s} {seconds * 1e3:9.1f} {ratio:>18s}")
    ideal = rows["dgrad GEMM"] + max(rows["wgrad GEMM + bias sum"], rows["all-reduce of the input gradient"])
    print(f"{'ideal overlap (dgrad + max(wgrad, AR))':36s} {ideal * 1e3:9.1f}")

    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(
            {
                "config": {**vars(args), "dtype": "float32", "backend": "gloo", "device": "cpu"},
                "machine": {
                    "cpus": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0],
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                },
                "median_ms": {name: seconds * 1e3 for name, seconds in rows.items()},
                "ideal_overlap_ms": ideal * 1e3,
            },
            f,
            indent=2,
        )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
