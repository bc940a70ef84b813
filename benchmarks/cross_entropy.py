"""Forward+backward time and peak extra memory of vocab_parallel_cross_entropy against the same
loss written with plain torch ops the way Megatron-core computes it, on CPU with TP=2 (two gloo
processes, one thread each).

Memory method: before each variant the process's resident-set high-water mark is reset
(``echo 5 > /proc/self/clear_refs``, Linux); after forward+backward, peak extra memory is the
high-water mark (``VmHWM``) minus the resident size just before the call (``VmRSS``). The
logits and targets are resident before the call, so the figure counts everything the loss
allocates, including the logits' gradient (the same size as the logits in both variants).
torch's CPU allocator returns large blocks to the system when they are freed, so the resident
size tracks live tensors.

    python benchmarks/cross_entropy.py [--tokens 8192] [--vocab 32768] [--reps 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext import parallel_state as ps  # noqa: E402
from megatron_ext import tensor_parallel  # noqa: E402
from megatron_ext.tensor_parallel import VocabUtility, reduce_from_tensor_model_parallel_region  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

MIB = 2**20


def megatron_style_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Megatron-core's vocab-parallel cross-entropy as plain torch ops under autograd (without
    its in-place updates of the input): max, all-reduce MAX, subtract, masked target pick, exp,
    sum, two all-reduces SUM, log."""
    group = ps.get_tensor_model_parallel_group()
    logits_max = logits.detach().amax(dim=-1)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - logits_max.unsqueeze(-1)
    first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
        logits.size(-1), dist.get_rank(group), dist.get_world_size(group)
    )
    outside = (target < first) | (target >= last)
    local_target = (target - first).masked_fill(outside, 0)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    sum_exp = shifted.exp().sum(dim=-1)
    predicted = reduce_from_tensor_model_parallel_region(predicted)
    sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
    return sum_exp.log() - predicted


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(loss_fn, logits: torch.Tensor, target: torch.Tensor, reps: int) -> dict:
    def step() -> torch.Tensor:
        x = logits.detach().requires_grad_(True)
        loss = loss_fn(x, target)
        loss.sum().backward()
        return loss.detach()

    loss = step()  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _memory_kib("VmRSS")
    step()
    peak = _memory_kib("VmHWM")
    return {"median_s": statistics.median(times), "times_s": times,
            "peak_extra_mib": (peak - before) / 1024, "loss": loss}


def _bench_worker(tokens: int, vocab: int, reps: int) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    n, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(1234 + r)  # each rank draws only its own slice
    logits = torch.randn(tokens, vocab // n, generator=g, dtype=torch.float32) * 2
    target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(99))
    ours = _measure(tensor_parallel.vocab_parallel_cross_entropy, logits, target, reps)
    plain = _measure(megatron_style_cross_entropy, logits, target, reps)
    diff = (ours.pop("loss") - plain.pop("loss")).abs().max().item()
    return {"rank": r, "ours": ours, "megatron_style_torch_ops": plain, "max_abs_loss_diff": diff,
            "local_logits_mib": logits.numel() * logits.element_size() / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cross_entropy.json"))
    args = parser.parse_args()

    ranks = run_distributed(args.tp, _bench_worker, args.tokens, args.vocab, args.reps, timeout=1800)
    logits_mib = ranks[0]["local_logits_mib"]
    rows = []
    for name in ("ours", "megatron_style_torch_ops"):
        # The slowest rank sets the step time; memory is per rank.
        rows.append({
            "variant": name,
            "fwd_bwd_median_s": max(rk[name]["median_s"] for rk in ranks),
            "peak_extra_mib_per_rank": max(rk[name]["peak_extra_mib"] for rk in ranks),
        })
    print(f"vocab-parallel cross-entropy, float32, tokens={args.tokens}, vocab={args.vocab}, TP={args.tp} "
          f"(gloo, CPU, 1 thread per rank); local logits {logits_mib:.0f} MiB per rank")
    print("peak extra memory: resident-set high-water mark during forward+backward minus resident "
          "size before it (includes the logits gradient)")
    print(f"{'variant':<26} {'fwd+bwd median (s)':>19} {'peak extra (MiB/rank)':>22} {'x logits':>9}")
    for row in rows:
        print(f"{row['variant']:<26} {row['fwd_bwd_median_s']:>19.3f} {row['peak_extra_mib_per_rank']:>22.0f} "
              f"{row['peak_extra_mib_per_rank'] / logits_mib:>9.2f}")
    speedup = rows[1]["fwd_bwd_median_s"] / rows[0]["fwd_bwd_median_s"]
    print(f"speed-up {speedup:.2f}x; max |loss difference| {max(rk['max_abs_loss_diff'] for rk in ranks):.2e}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {**vars(args), "dtype": "float32", "device": "cpu", "backend": "gloo",
                              "threads_per_rank": 1, "torch": torch.__version__},
                   "memory_method": "VmHWM after clear_refs=5 minus VmRSS before forward+backward",
                   "local_logits_mib": logits_mib, "results": rows, "speedup": speedup, "per_rank": ranks},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
