"""Shows the process-group layout and a tensor-parallel MLP built from the regions.

    torchrun --standalone --nproc-per-node 4 examples/regions_demo.py --tp 2 --pp 2
"""

import argparse

import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(args.tp, args.pp)
    rank, world = dist.get_rank(), dist.get_world_size()
    row = [rank, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
           ps.get_data_parallel_rank(), dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
           dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
           dist.get_process_group_ranks(ps.get_data_parallel_group())]
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"world {world}: tp {args.tp} x pp {args.pp} x dp {world // (args.tp * args.pp)}")
        print(f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>3}  {'TP group':<14}{'PP group':<14}DP group")
        for r, t, p, d, tg, pg, dg in rows:
            print(f"{r:>4} {t:>3} {p:>3} {d:>3}  {str(tg):<14}{str(pg):<14}{dg}")

    # MLP Y = gelu(X A) B with A split by columns and B by rows: one all-reduce forward
    # (reduce region) and one backward (copy region), equal to the unsplit computation.
    torch.manual_seed(0)
    s, h, f = 8, 16, 32
    x = torch.randn(s, h, dtype=torch.float64, requires_grad=True)
    a = torch.randn(h, f, dtype=torch.float64)
    b = torch.randn(f, h, dtype=torch.float64)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    a_local = a.chunk(tp, dim=1)[tp_rank]
    b_local = b.chunk(tp, dim=0)[tp_rank]
    x_parallel = tensor_parallel.copy_to_tensor_model_parallel_region(x)
    y = tensor_parallel.reduce_from_tensor_model_parallel_region(
        torch.nn.functional.gelu(x_parallel @ a_local) @ b_local
    )
    y.sum().backward()
    x_serial = x.detach().clone().requires_grad_(True)
    y_serial = torch.nn.functional.gelu(x_serial @ a) @ b
    y_serial.sum().backward()
    err = max((y - y_serial).abs().max().item(), (x.grad - x_serial.grad).abs().max().item())
    if rank == 0:
        print(f"tensor-parallel MLP vs serial (float64): max |difference| = {err:.2e}")
        print(f"grad_fn of the reduce region's output: {y.grad_fn.name()}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if err > 1e-10:
        raise SystemExit(f"tensor-parallel MLP differs from serial by {err}")


if __name__ == "__main__":
    main()
