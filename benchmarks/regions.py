"""copy_to + reduce_from regions, forward+backward, on CPU with TP=2 (two gloo processes, one
thread each): megatron_ext against megatron-core 0.16.1 and two floors for what the pair must
communicate (the forward's reduce and the backward's reduce): two bare in-place all-reduces, the
collective megatron-core runs, and two bare exchanges (send/recv, then add), the two-rank sum
megatron_ext runs from 1 MiB on (smaller sums are copied and all-reduced). Each implementation's
overhead is its time above the floor of the collective it runs.
float32 at [4096, 1024] and [8, 1024]; each timed run repeats the step ``--inner`` times (more
for the small tensor) and reports the time per step. Timing and memory method:
benchmarks/common.py.

    ./dev.sh bench regions [--reps 15] [--without-megatron-core]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from common import (
    import_megatron_core,
    print_table,
    require_megatron_core,
    run_interleaved,
    summarize,
    write_json,
)

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from tests.distributed import run_distributed

SHAPES = ((4096, 1024), (8, 1024))


def _repeat(step, inner: int):
    def run() -> None:
        for _ in range(inner):
            step()

    return run


def _worker(reps: int, inner_small: int, inner_medium: int) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    mcore = import_megatron_core()
    if mcore is not None:
        mcore[0].initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    out = {}
    for shape in SHAPES:
        inner = inner_small if shape[0] < 64 else inner_medium
        g = torch.Generator().manual_seed(5)
        x = (torch.randn(*shape, generator=g) * 1e-3).requires_grad_(True)
        grad = torch.randn(*shape, generator=g)
        bare = torch.randn(*shape, generator=g)
        group = ps.get_tensor_model_parallel_group()

        def ours() -> None:
            tp_.reduce_from_tensor_model_parallel_region(tp_.copy_to_tensor_model_parallel_region(x)).backward(grad)
            x.grad = None

        def floor() -> None:
            dist.all_reduce(bare, group=group)
            dist.all_reduce(bare, group=group)

        peer = dist.get_global_rank(group, 1 - dist.get_rank(group))

        def exchange() -> torch.Tensor:
            out = torch.empty_like(bare)
            recv = dist.irecv(out, peer, group=group)
            send = dist.isend(bare, peer, group=group)
            recv.wait()
            send.wait()
            return out.add_(bare)

        def exchange_floor() -> None:
            exchange()
            exchange()

        variants = {"megatron_ext": _repeat(ours, inner)}
        if mcore is not None:
            mtp = mcore[1]

            def megatron_core() -> None:
                # Its reduce_from all-reduces the copy_to output in place, which is x itself; the
                # tiny values keep that from overflowing over the repetitions.
                mtp.reduce_from_tensor_model_parallel_region(mtp.copy_to_tensor_model_parallel_region(x)).backward(grad)
                x.grad = None

            variants["megatron-core"] = _repeat(megatron_core, inner)
        variants["two bare all-reduces"] = _repeat(floor, inner)
        variants["two bare exchanges"] = _repeat(exchange_floor, inner)
        timings = run_interleaved(variants, reps)
        for t in timings.values():
            t["times_s"] = [s / inner for s in t["times_s"]]
            t["cpu_s"] = [s / inner for s in t["cpu_s"]]
        out["x".join(map(str, shape))] = {"inner": inner, "timings": timings}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner-small", type=int, default=200)
    parser.add_argument("--inner-medium", type=int, default=5)
    parser.add_argument("--without-megatron-core", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_megatron_core(args.without_megatron_core)

    ranks = run_distributed(2, _worker, args.reps, args.inner_small, args.inner_medium, timeout=3600)
    results = {}
    for key in ranks[0]:
        summary = summarize([r[key]["timings"] for r in ranks])
        results[key] = summary
        print_table(
            f"copy_to + reduce_from fwd+bwd, float32 [{key.replace('x', ', ')}], TP=2 (gloo, CPU, 1 thread "
            f"per rank), per step",
            summary,
            baseline="two bare all-reduces",
            unit="ms",
        )
        # Overhead: median time above the floor of the collective each implementation runs
        # (megatron_ext exchanges sums of 1 MiB and more, all-reduces smaller ones).
        rows, cols = map(int, key.split("x"))
        ours_floor = "two bare exchanges" if rows * cols * 4 >= 2**20 else "two bare all-reduces"
        floors = {"megatron_ext": ours_floor, "megatron-core": "two bare all-reduces"}
        summary["overhead_ms"] = {
            name: (summary[name]["median_s"] - summary[floor]["median_s"]) * 1e3
            for name, floor in floors.items() if name in summary
        }
        print("overhead above its own floor (ms): "
              + ", ".join(f"{k} {v:.3f}" for k, v in summary["overhead_ms"].items()))
        print()
    write_json("regions", {"config": vars(args), "results": results}, args.out)


if __name__ == "__main__":
    main()
