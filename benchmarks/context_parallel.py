"""Causal attention forward+backward per rank under context parallelism, float32, CPU processes
(gloo, one thread each) at cp 1, 2 and 4 and growing sequence lengths: megatron_ext's
context_parallel_attention with each comm type (p2p, all_gather, a2a), against PyTorch's
experimental ``torch.distributed.tensor.experimental.context_parallel`` ring attention in the same
run, variants interleaved (torch's is given the whole sequence, which it shards in place; its
sharding is inside its time and memory). Each rank holds ``s / cp`` tokens (Megatron's
load-balanced layout); the peak extra memory per rank should fall as 1/cp. Timing and memory
method: benchmarks/common.py, with glibc's mmap threshold fixed so freed tensors leave the
resident set.

    ./dev.sh bench context_parallel [--seq 2048 4096 8192] [--cp 1 2 4] [--heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from common import print_table, run_interleaved, summarize, write_json

from megatron_ext.transformer.context_parallel import CP_COMM_TYPES, context_parallel_attention
from tests.distributed import run_distributed


def _torch_context_parallel(q, k, v):
    """torch's ring attention over the world's device mesh; None where this torch cannot run it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # It shards the buffers in place and restores them on exit, which a tensor that requires grad
    # refuses: the shards are taken as leaves inside.
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def _worker(args) -> dict:
    torch.set_num_threads(1)
    cp = dist.get_world_size()
    group = dist.group.WORLD
    results, peer_errors = {}, {}
    for s in args.seq:
        local = (1, args.heads, s // cp, args.head_dim)

        def inputs(shape=local, grad=True):
            base = torch.randn(3, *shape)
            return [t.clone().requires_grad_(grad) for t in base]

        def ours(comm):
            def step():
                q, k, v = inputs()
                out = context_parallel_attention(q, k, v, group, True, comm)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

            return step

        variants = {f"megatron_ext {comm}": ours(comm) for comm in (CP_COMM_TYPES if cp > 1 else ["p2p"])}
        if not args.without_torch:
            try:  # one try outside the timing: its error, if any, is reported instead
                full = (1, args.heads, s, args.head_dim)
                _torch_context_parallel(*inputs(full, False))
                variants["torch context_parallel"] = lambda: _torch_context_parallel(*inputs(full, False))
            except Exception as e:  # noqa: BLE001  (reported in the table's notes)
                peer_errors[str(s)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        results[str(s)] = run_interleaved(variants, args.reps)
    return {"results": results, "peer_errors": peer_errors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--without-torch", action="store_true", help="megatron_ext only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    # A fixed mmap threshold: glibc's moving one keeps freed tensors resident, and the next run's
    # peak would not show them (read at the ranks' start, which inherit it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    summary, errors = {}, {}
    for cp in args.cp:
        per_rank = run_distributed(cp, _worker, args, timeout=3600)
        errors[str(cp)] = per_rank[0]["peer_errors"]
        for s in per_rank[0]["results"]:
            summary.setdefault(s, {})[str(cp)] = summarize([r["results"][s] for r in per_rank])
    print(
        f"causal attention fwd+bwd per rank, float32, b 1, {args.heads} heads x {args.head_dim}, "
        "one CPU thread"
    )
    for s, by_cp in summary.items():
        for cp, rows in by_cp.items():
            print_table(f"seq {s}, cp {cp}", rows)
            if errors[cp].get(s):
                print(f"  torch context_parallel did not run: {errors[cp][s]}")
    write_json("context_parallel", {"args": vars(args), "summary": summary, "peer_errors": errors}, args.json)


if __name__ == "__main__":
    main()
