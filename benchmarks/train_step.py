"""The whole training step on 4 CPU processes (gloo, one thread each), float32: megatron_ext's
GPTModel with its schedules, DDP, optimizer and scheduler against Megatron-core 0.16.1's own
GPTModel (local layer spec) on Megatron-core's parallel_state, schedules, DDP, optimizer and
scheduler, with the same configuration, the same starting weights (megatron_ext's model copies
Megatron-core's) and the same global batch. ``megatron_ext fused`` is megatron_ext's model with
its fused CPU kernels switched on (bias + GeLU / SwiGLU, bias + dropout + add, and for Llama
RMSNorm and rotary); Megatron-core's fusions need CUDA, so its run has them off, as has plain
``megatron_ext``.

Layouts: tp 2 x pp 2 (1F1B over 4 micro-batches) and dp 4. Configurations: GPT (LayerNorm, GeLU,
biases, learned positions, tied embedding) and Llama-style (RMSNorm, SwiGLU, no biases, rotary,
grouped-query attention, untied output layer). Adam, gradient clipping at 1.0, weight decay 0.01.

Reported per variant: step time (min / median / max over repetitions, the slowest rank each),
tokens per second at the median, peak extra resident memory during a step, resident memory the
model, gradient buffers and optimizer state hold (after the first step), and the largest
difference of a step's loss from Megatron-core's. Megatron-core's CUDA calls are pointed at the
CPU as ``benchmarks/megatron_core_gpt.py`` lists (those patches are in place for every variant;
they wrap ``torch.tensor`` and the other factory functions, a few microseconds per call).
Timing and memory method: benchmarks/common.py.

    ./dev.sh bench train_step [--arch gpt llama] [--layouts tp2pp2 dp4] [--reps 5] [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import memory_kib, print_table, require_megatron_core, run_interleaved, summarize, write_json
from megatron_core_gpt import Run, cpu_patches, setup, train_step

from tests.distributed import run_distributed

LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "dp4": dict(tp=1, pp=1)}
STACKS = {
    "megatron-core": "megatron.core",
    "megatron_ext": "megatron_ext",
    "megatron_ext fused": "megatron_ext",
}


def _run(args: argparse.Namespace, arch: str, layout: str) -> Run:
    return Run(
        arch=arch, dtype=torch.float32, layers=args.layers, hidden=args.hidden, heads=args.heads,
        query_groups=args.heads // 4, ffn=(-(-8 * args.hidden // 3 // 32) * 32) if arch == "llama" else None,
        seq=args.seq, vocab=args.vocab, micro_batch=args.micro_batch, global_batch=args.global_batch,
        steps=args.reps + 2, lr=1e-4, optimizer="adam", **LAYOUTS[layout],
    )


def _worker(args: argparse.Namespace) -> dict:
    cpu_patches(full=True)
    import megatron.core.parallel_state as mcore_ps

    from megatron_ext import parallel_state as ext_ps

    out = {}
    for arch in args.arch:
        for layout in args.layouts:
            run = _run(args, arch, layout)
            setups, resident = {}, {}
            losses: dict[str, list[float | None]] = {name: [] for name in STACKS}

            def step(name: str) -> None:
                model, optimizer, scheduler, variant_run, stack = setups[name]
                losses[name].append(
                    train_step(variant_run, model, optimizer, scheduler, len(losses[name]), stack)[0]
                )

            # Resident memory of the model, its gradient buffers and the optimizer state
            # (allocated at the first step): the growth over its setup and over its first step.
            for name, stack in STACKS.items():
                before = memory_kib("VmRSS")
                variant_run = Run(**{**run.__dict__, "fused": name.endswith("fused")})
                weights = None if stack == "megatron.core" else setups["megatron-core"][0]
                setups[name] = (*setup(variant_run, stack, weights_from=weights), variant_run, stack)
                resident[name] = memory_kib("VmRSS") - before
            for name in STACKS:
                before = memory_kib("VmRSS")
                step(name)
                resident[name] = (resident[name] + memory_kib("VmRSS") - before) / 1024
            result = run_interleaved({name: (lambda n=name: step(n)) for name in STACKS}, args.reps)
            out[f"{arch} {layout}"] = {"timing": result, "losses": losses, "resident_mib": resident}
            setups.clear()
            mcore_ps.destroy_model_parallel()
            ext_ps.destroy_model_parallel()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--json", default=None, help="results path (default benchmarks/results/train_step.json)"
    )
    args = parser.parse_args()
    require_megatron_core(allow_missing=False)

    per_rank = run_distributed(4, _worker, args, timeout=3600)
    tokens = args.global_batch * args.seq
    payload = {"args": vars(args), "tokens_per_step": tokens, "results": {}}
    for case in per_rank[0]:
        summary = summarize([r[case]["timing"] for r in per_rank])
        losses = {
            name: next(r[case]["losses"][name] for r in per_rank if r[case]["losses"][name][0] is not None)
            for name in STACKS
        }
        for name, s in summary.items():
            s["tokens_per_s"] = tokens / s["median_s"]
            s["resident_mib"] = max(r[case]["resident_mib"][name] for r in per_rank)
            s["losses"] = losses[name]
            s["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses[name], losses["megatron-core"]))
        print_table(f"\ntrain step, {case} (4 ranks, float32, {tokens} tokens per step)", summary,
                    baseline="megatron-core", unit="s")
        for name, s in summary.items():
            print(f"  {name:<20} {s['tokens_per_s']:>9.0f} tokens/s  resident {s['resident_mib']:>8.1f} MiB  "
                  f"largest loss difference {s['max_loss_difference']:.2e}  "
                  f"(losses {statistics.fmean(s['losses']):.4f} on average)")
        payload["results"][case] = summary
    write_json("train_step", payload, args.json)


if __name__ == "__main__":
    main()
