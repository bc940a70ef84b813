"""Vocab-parallel cross-entropy, forward+backward, on CPU with TP=2 (two gloo processes, one thread
each): megatron_ext (default and ``overwrite_logits=True``) against the real megatron-core 0.16.1
(``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``) and PyTorch DTensor
(``torch.distributed.tensor.parallel.loss_parallel``), in the same run, variants interleaved rep by
rep, in float32 and bfloat16.

megatron-core is imported if installed (``./dev.sh bench cross_entropy`` installs it with
``pip install --no-deps megatron-core==0.16.1``); without it its rows are skipped.

Every rep of every variant starts from a fresh copy of the logits made before the timer starts
(megatron-core overwrites float32 logits in place). Time is the slowest rank's.

Peak extra memory per rank: before a measured rep the process's resident-set high-water mark is
reset (``echo 5 > /proc/self/clear_refs``, Linux); after forward+backward the figure is the
high-water mark (``VmHWM``) minus the resident size just before the call (``VmRSS``), with the
logits copy and the targets already resident. It counts everything the loss allocates, the
logits' gradient included. torch's CPU allocator returns large blocks to the system when they
are freed, so the resident size follows the live tensors.

    python benchmarks/cross_entropy.py [--tokens 8192] [--vocab 32768] [--reps 9] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext import parallel_state as ps  # noqa: E402
from megatron_ext import tensor_parallel  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

MIB = 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _variants(tp: int) -> dict:
    """name -> (loss function of (logits requiring grad, target), or None when unavailable)."""
    variants = {
        "megatron_ext": lambda x, t: tensor_parallel.vocab_parallel_cross_entropy(x, t),
        "megatron_ext overwrite_logits": lambda x, t: tensor_parallel.vocab_parallel_cross_entropy(
            x, t, overwrite_logits=True
        ),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as mcore_ps
            from megatron.core import tensor_parallel as mcore_tp

        mcore_ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        variants["megatron-core 0.16.1"] = lambda x, t: mcore_tp.vocab_parallel_cross_entropy(x, t)
    except ImportError:
        variants["megatron-core 0.16.1"] = None

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (tp,))

    def dtensor_loss(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # loss_parallel computes in the logits' dtype; its backward must run inside the context.
        dx = DTensor.from_local(x, mesh, [Shard(1)])
        with loss_parallel():
            loss = F.cross_entropy(dx, t, reduction="none")
            (grad,) = torch.autograd.grad(loss.full_tensor().sum(), x)
        return loss.full_tensor().detach(), grad

    variants["DTensor loss_parallel"] = dtensor_loss
    return variants


def _step(fn, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Forward, then the logits' gradient handed on with ``torch.autograd.grad``, as the output
    layer in front of the loss receives it in training. (``loss.sum().backward()`` into the leaf
    would add autograd's AccumulateGrad copy for whichever implementation returns its gradient in
    the logits' own storage, megatron-core's in float32: a cost training does not have.)"""
    x = logits.requires_grad_(True)
    out = fn(x, target)
    if isinstance(out, tuple):  # DTensor's step took its gradient inside loss_parallel
        loss, grad = out
    else:
        loss = out
        (grad,) = torch.autograd.grad(loss.sum(), x)
    del grad
    return loss.detach().float()


def _bench_worker(tokens: int, vocab: int, reps: int, dtype_names: list[str]) -> dict:
    n = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=n)
    r = ps.get_tensor_model_parallel_rank()
    variants = _variants(n)
    out: dict = {"rank": r, "results": {}}
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        g = torch.Generator().manual_seed(1234 + r)  # each rank draws only its own slice
        logits = (torch.randn(tokens, vocab // n, generator=g) * 2).to(dtype)
        target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(99))
        live = {k: v for k, v in variants.items() if v is not None}
        times: dict[str, list[float]] = {k: [] for k in live}
        losses = {}
        for rep in range(reps + 1):  # rep 0 warms up
            for name, fn in live.items():
                x = logits.clone()
                dist.barrier()
                start = time.perf_counter()
                loss = _step(fn, x, target)
                elapsed = time.perf_counter() - start
                del x
                if rep:
                    times[name].append(elapsed)
                else:
                    losses[name] = loss
        peaks = {}
        for name, fn in live.items():
            x = logits.clone()
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _memory_kib("VmRSS")
            _step(fn, x, target)
            peaks[name] = (_memory_kib("VmHWM") - before) / 1024
            del x
        reference = losses["megatron_ext"]
        out["results"][dtype_name] = {
            name: {
                "times_s": times[name],
                "peak_extra_mib": peaks[name],
                "max_abs_loss_diff_vs_megatron_ext": (losses[name] - reference).abs().max().item(),
            }
            for name in live
        }
        out["results"][dtype_name]["local_logits_mib"] = logits.numel() * logits.element_size() / MIB
    out["skipped"] = [k for k, v in variants.items() if v is None]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cross_entropy.json"))
    args = parser.parse_args()

    dtype_names = args.dtypes.split(",")
    ranks = run_distributed(
        args.tp, _bench_worker, args.tokens, args.vocab, args.reps, dtype_names, timeout=3000
    )
    import megatron_ext

    table = {}
    print(f"vocab-parallel cross-entropy fwd+bwd, tokens={args.tokens}, vocab={args.vocab}, TP={args.tp} "
          f"(gloo, CPU, 1 thread per rank), {args.reps} reps interleaved; CPU kernels: "
          f"{megatron_ext.build_info()['cpu_capability']}")
    if ranks[0]["skipped"]:
        print(f"skipped (not installed): {', '.join(ranks[0]['skipped'])}")
    for dtype_name in dtype_names:
        per_rank = [rk["results"][dtype_name] for rk in ranks]
        logits_mib = per_rank[0]["local_logits_mib"]
        print(f"\n{dtype_name}: local logits {logits_mib:.0f} MiB per rank")
        print(f"{'variant':<32} {'min (s)':>8} {'median (s)':>11} {'max (s)':>8} {'peak extra MiB/rank':>20}")
        rows = {}
        for name in (k for k in per_rank[0] if k != "local_logits_mib"):
            # The slowest rank sets each rep's time; memory is the larger rank's.
            step = [max(ts) for ts in zip(*(pr[name]["times_s"] for pr in per_rank))]
            row = {"min_s": min(step), "median_s": statistics.median(step), "max_s": max(step),
                   "peak_extra_mib_per_rank": max(pr[name]["peak_extra_mib"] for pr in per_rank),
                   "max_abs_loss_diff_vs_megatron_ext": max(pr[name]["max_abs_loss_diff_vs_megatron_ext"]
                                                            for pr in per_rank)}
            rows[name] = row
            print(f"{name:<32} {row['min_s']:>8.3f} {row['median_s']:>11.3f} {row['max_s']:>8.3f} "
                  f"{row['peak_extra_mib_per_rank']:>20.0f}")
        if "megatron-core 0.16.1" in rows:
            for name in ("megatron_ext", "megatron_ext overwrite_logits"):
                print(f"{name} speed-up over megatron-core (medians): "
                      f"{rows['megatron-core 0.16.1']['median_s'] / rows[name]['median_s']:.2f}x")
        table[dtype_name] = {"local_logits_mib": logits_mib, "variants": rows}

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {**vars(args), "device": "cpu", "backend": "gloo", "threads_per_rank": 1,
                              "torch": torch.__version__, "build_info": megatron_ext.build_info()},
                   "memory_method": "VmHWM after clear_refs=5 minus VmRSS before forward+backward, "
                                    "logits copy resident",
                   "results": table, "skipped": ranks[0]["skipped"]}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
