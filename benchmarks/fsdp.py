"""The whole training step under fully sharded data parallelism on N CPU processes (gloo, one
thread each; dp N, tp 1), float32: megatron_ext's GPTModel (GPT: LayerNorm, GeLU, biases, learned
positions, tied embedding; or Llama-style: RMSNorm, SwiGLU, rotary, grouped-query attention,
untied output layer) wrapped six ways, each from the same starting weights:

- ``distopt``: megatron_ext's DistributedDataParallel with the distributed optimizer (the training
  program's settings: ``overlap_grad_reduce``, default buckets);
- ``fsdp optim``, ``fsdp optim_grads``, ``fsdp optim_grads_params``: megatron_ext's
  FullyShardedDataParallel with that ``data_parallel_sharding_strategy`` (units: the transformer
  layers; the rest is the root);
- ``fsdp ogp no reshard``: ``optim_grads_params`` with ``reshard_after_forward=False`` (a unit stays
  gathered from its first forward of a step to the optimizer step);
- ``torch fully_shard``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on every
  transformer layer, then on the whole model, with ``torch.optim.AdamW``.

All run ``--micro-batches`` micro-batches per step, Adam (decoupled weight decay 0.01, none on
biases and norms, as Megatron-core's parameter groups), gradient clipping at 1.0. megatron_ext's
variants: ``get_forward_backward_func`` (whose last backward calls ``finalize_model_grads``), then
``optimizer.step()`` of ``get_megatron_optimizer(use_distributed_optimizer=True)``; FSDP2: forward
and backward of the loss over the micro-batches (gradients reduce-scattered in every backward, as
megatron_ext's optim_grads strategies do), ``clip_grad_norm_``, ``step()``. Each repetition gets
fresh random tokens. Before timing, two steps on the same batch: their losses (the largest
difference from ``distopt``'s is reported; float32 rounding) and what they leave allocated.

Reported per variant: step time (min / median / max of the slowest rank), CPU seconds, peak extra
resident memory per rank during a step (benchmarks/common.py), and state bytes per rank: what the
model, its gradient buffers and shards and the optimizer state hold between steps (the distinct
CPU tensor storages alive after the first two steps minus before the model was built;
``torch.cuda.memory_allocated`` on a GPU); state + peak extra is the most a step holds.

Megatron-core 0.16.1's own Megatron-FSDP is not a variant: it cannot run on CPU processes (it
creates ``torch.cuda.Stream`` unconditionally and builds its device meshes on ``"cuda"``).

``--device cuda`` runs the same variants on one process per GPU (NCCL), each step ending in
``torch.cuda.synchronize``; peak extra and state memory are then ``torch.cuda`` allocator figures.
``--profile VARIANT...`` runs ``--profile-steps`` more steps of each variant named under cProfile
on rank 0 after the timing and prints the functions that cost the most (own time, cumulative;
``--profile-clock cpu``: CPU seconds instead of wall seconds, for a machine shared with others).

    ./dev.sh bench fsdp [--nproc 4] [--arch gpt] [--layers 4] [--hidden 256] [--seq 128] [--reps 5]
    python benchmarks/fsdp.py --device cuda [--json runs/gpu_fsdp.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import live_cpu_storages, print_table, run_interleaved, summarize, write_json  # noqa: E402
from megatron_core_gpt import Run, build_model, forward_step, transformer_config  # noqa: E402

VARIANTS = {
    # name: (FullyShardedDataParallel strategy or None for DistributedDataParallel, reshard_after_forward)
    "distopt": (None, True),
    "fsdp optim": ("optim", True),
    "fsdp optim_grads": ("optim_grads", True),
    "fsdp optim_grads_params": ("optim_grads_params", True),
    "fsdp ogp no reshard": ("optim_grads_params", False),
    "torch fully_shard": ("fully_shard", True),
}
# Per device: the model, the micro-batches (per rank and step) and the repetitions.
SIZES = {
    "cpu": dict(layers=4, hidden=256, heads=8, seq=128, vocab=4096, micro_batch=2, micro_batches=4, reps=5),
    "cuda": dict(layers=8, hidden=2048, heads=16, seq=2048, vocab=32000, micro_batch=1, micro_batches=4,
                 reps=10),
}
NOTES = (
    "Megatron-core 0.16.1's Megatron-FSDP is not measured: it cannot run on CPU processes (it creates "
    "torch.cuda.Stream unconditionally and builds its device meshes on 'cuda').",
    "fsdp ogp no reshard: optim_grads_params with reshard_after_forward=False.",
)


def _run(args: argparse.Namespace) -> Run:
    llama = args.arch == "llama"
    return Run(
        arch=args.arch, dtype=torch.float32, layers=args.layers, hidden=args.hidden, heads=args.heads,
        query_groups=max(1, args.heads // 4), ffn=(-(-8 * args.hidden // 3 // 32) * 32) if llama else None,
        seq=args.seq, vocab=args.vocab, micro_batch=args.micro_batch, lr=1e-4, optimizer="adam",
    )


def _allocated(device: torch.device) -> int:
    """Bytes held by tensors: the CUDA allocator's count, or the distinct CPU storages alive."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return sum(live_cpu_storages().values())


def _model(run: Run, device: torch.device) -> tuple[Any, torch.nn.Module]:
    """megatron_ext's GPTModel from the run's seed (the same weights for every variant)."""
    from megatron_ext import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(run.seed, force_reset_rng=True)
    torch.manual_seed(run.seed)
    config = transformer_config(run, "megatron_ext")
    (model,) = build_model(run, config, "megatron_ext")
    return config, model.to(device)


class MegatronExt:
    """DistributedDataParallel or FullyShardedDataParallel, the distributed optimizer, Megatron's
    schedule; set up as the training program sets them up."""

    def __init__(self, run: Run, device: torch.device, strategy: str | None, reshard: bool) -> None:
        from megatron_ext.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            FullyShardedDataParallel,
            finalize_model_grads,
        )
        from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron_ext.pipeline_parallel import get_forward_backward_func

        self.run, self.schedule = run, get_forward_backward_func()
        config, model = _model(run, device)
        ddp = dict(overlap_grad_reduce=True, use_distributed_optimizer=True)
        if strategy is None:
            self.model = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp), model)
        else:
            ddp_config = DistributedDataParallelConfig(
                **ddp, use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
            self.model = FullyShardedDataParallel(config, ddp_config, model, reshard_after_forward=reshard)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                            use_distributed_optimizer=True, bf16=False, fp16=False, params_dtype=run.dtype),
            [self.model])
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync

    def step(self, micro: list[tuple[torch.Tensor, ...]]) -> float:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.schedule(
            forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
            num_microbatches=len(micro), seq_length=self.run.seq, micro_batch_size=self.run.micro_batch,
            forward_only=False)
        self.optimizer.step()
        return _mean_over_ranks(torch.stack([m["lm loss"] for m in losses]).mean())


class TorchFullyShard:
    """PyTorch's FSDP2 over the same model: every transformer layer, then the root, fully_shard'ed
    over the whole world; AdamW with Megatron-core's weight-decay groups; clipping at 1.0."""

    def __init__(self, run: Run, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        _, self.model = _model(run, device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in self.model.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=run.lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda" or None)

    def step(self, micro: list[tuple[torch.Tensor, ...]]) -> float:
        losses = []
        for tokens, labels, mask, positions, _ in micro:
            out = self.model(tokens, positions, None, labels=labels)
            loss = (out * mask).sum() / mask.sum()
            (loss / len(micro)).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _mean_over_ranks(torch.stack(losses).mean())


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """A step's loss: the mean over micro-batches and data-parallel ranks."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _batches(run: Run, count: int, generator: torch.Generator, device: torch.device) -> list[tuple]:
    """``count`` micro-batches of random tokens: (tokens, labels, loss mask, positions, None)."""
    positions = torch.arange(run.seq, device=device).expand(run.micro_batch, run.seq)
    out = []
    for _ in range(count):
        data = torch.randint(0, run.vocab, (run.micro_batch, run.seq + 1), generator=generator).to(device)
        mask = torch.ones(run.micro_batch, run.seq, dtype=run.dtype, device=device)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous(), mask, positions, None))
    return out


def _worker(args: argparse.Namespace) -> dict:
    from megatron_ext import parallel_state as ps

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    ps.initialize_model_parallel(1, 1)
    run = _run(args)
    # The two steps before timing see the same batch in every variant (their losses compare the
    # variants); the timed ones fresh tokens (distinct per rank).
    same = _batches(run, args.micro_batches, torch.Generator().manual_seed(run.seed + dist.get_rank()),
                    device)
    stacks, state, losses = {}, {}, {}
    for name in args.variants:
        strategy, reshard = VARIANTS[name]
        before = _allocated(device)
        stacks[name] = (TorchFullyShard(run, device) if strategy == "fully_shard"
                        else MegatronExt(run, device, strategy, reshard))
        losses[name] = [stacks[name].step(same) for _ in range(2)]
        state[name] = _allocated(device) - before
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    generator = torch.Generator().manual_seed(run.seed + 1000 + dist.get_rank())
    gpu_peaks: dict[str, list[float]] = {name: [] for name in stacks}

    def timed(name: str) -> Callable[[list], None]:
        def step(micro: list) -> None:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                start = torch.cuda.memory_allocated(device)
            stacks[name].step(micro)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                gpu_peaks[name].append((torch.cuda.max_memory_allocated(device) - start) / 2**20)
        return step

    timing = run_interleaved({name: timed(name) for name in stacks}, args.reps,
                             prepare=lambda: _batches(run, args.micro_batches, generator, device))
    if device.type == "cuda":  # the device's peaks replace the host's resident-set figures
        for name, peaks in gpu_peaks.items():
            timing[name]["peak_extra_mib"] = peaks[-args.reps:]
    profiles = {}
    rank0 = dist.get_rank() == 0
    for name in args.profile or []:
        profiler = cProfile.Profile(time.process_time) if args.profile_clock == "cpu" else cProfile.Profile()
        for _ in range(args.profile_steps):
            micro = _batches(run, args.micro_batches, generator, device)
            if rank0:
                profiler.enable()
            stacks[name].step(micro)
            if rank0:
                profiler.disable()
        if rank0:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text).strip_dirs()
            stats.sort_stats("tottime").print_stats(args.profile_top)
            stats.sort_stats("cumulative").print_stats(args.profile_top)
            profiles[name] = text.getvalue()
    params = sum(p.numel() for p in stacks[args.variants[0]].model.parameters())
    stacks.clear()
    ps.destroy_model_parallel()
    return {"timing": timing, "state_bytes": state, "losses": losses, "profiles": profiles,
            "parameters": params}


def _cuda_rank(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        result = _worker(args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)


def _run_on_gpus(args: argparse.Namespace) -> list[dict]:
    """One process per GPU (NCCL); each rank's result, in rank order."""
    import tempfile

    import torch.multiprocessing as mp

    from tests.distributed import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_cuda_rank, args=(r, args.nproc, port, args, out_dir))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        for p in procs:  # a rank that failed leaves the others waiting in a collective: stopped here
            p.join(timeout=3600)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise SystemExit(f"benchmarks/fsdp.py: a GPU rank failed (exit codes {codes})")
        results = []
        for r in range(args.nproc):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                results.append(json.load(f))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: --nproc gloo processes; cuda: one NCCL process per GPU")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks (= dp; default 4 on cpu, every GPU on cuda)")
    p.add_argument("--arch", default="gpt", choices=["gpt", "llama"])
    for field in SIZES["cpu"]:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None,
                       help=f"default {SIZES['cpu'][field]} (cpu), {SIZES['cuda'][field]} (cuda)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--profile", nargs="+", default=None, choices=list(VARIANTS),
                   help="after timing, run each of these variants under cProfile on rank 0")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-clock", default="wall", choices=["wall", "cpu"],
                   help="cProfile's timer: wall seconds, or the process's CPU seconds (every thread's: "
                   "gloo's work is charged to what runs meanwhile, often a wait)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--json", default=None, help="results path (default benchmarks/results/fsdp.json)")
    args = p.parse_args()
    for field, default in SIZES[args.device].items():
        if getattr(args, field) is None:
            setattr(args, field, default)
    if set(args.profile or []) - set(args.variants):
        p.error(f"--profile {args.profile} names variants not among --variants {args.variants}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/fsdp.py --device cuda needs a CUDA GPU")
        args.nproc = args.nproc or torch.cuda.device_count()
        if args.nproc > torch.cuda.device_count():
            raise SystemExit(f"--nproc {args.nproc} > {torch.cuda.device_count()} GPUs")
        per_rank = _run_on_gpus(args)
    else:
        from tests.distributed import run_distributed

        args.nproc = args.nproc or 4
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave the resident set
        per_rank = run_distributed(args.nproc, _worker, args, timeout=3600)
    summary = summarize([r["timing"] for r in per_rank])
    first = per_rank[0]
    tokens = args.nproc * args.micro_batches * args.micro_batch * args.seq
    for name, s in summary.items():
        s["state_mib"] = max(r["state_bytes"][name] for r in per_rank) / 2**20
        s["losses"] = first["losses"][name]
        s["max_loss_difference"] = max(abs(a - b) for a, b in zip(s["losses"], first["losses"]["distopt"])) \
            if "distopt" in first["losses"] else None
        s["tokens_per_s"] = tokens / s["median_s"]
    print_table(f"\ntraining step, {args.arch}, {args.layers} layers x {args.hidden}, "
                f"{first['parameters']:,} parameters, dp {args.nproc} ({args.device}), float32, "
                f"{args.micro_batches} micro-batches of {args.micro_batch} x {args.seq} per rank, "
                f"{tokens} tokens per step",
                summary, baseline="distopt" if "distopt" in summary else None, unit="s")
    print(f"{'variant':<24} {'state MiB':>10} {'state + peak':>13} {'tokens/s':>9}  losses of the two "
          "same-batch steps (largest difference from distopt)")
    for name, s in summary.items():
        diff = "" if s["max_loss_difference"] is None else f" ({s['max_loss_difference']:.1e})"
        print(f"{name:<24} {s['state_mib']:>10.2f} {s['state_mib'] + s['peak_extra_mib']:>13.2f} "
              f"{s['tokens_per_s']:>9.0f}  {', '.join(f'{v:.6f}' for v in s['losses'])}{diff}")
    for note in NOTES:
        print(f"note: {note}")
    for name, text in first["profiles"].items():
        print(f"\ncProfile of {name}, rank 0, {args.profile_steps} steps:\n{text}")
    payload = {"args": vars(args), "parameters": first["parameters"], "tokens_per_step": tokens,
               "notes": list(NOTES), "summary": summary, "profiles": first["profiles"]}
    if args.device == "cuda":
        payload.update(device="cuda", backend="nccl", gpu=torch.cuda.get_device_name(0))
    write_json("fsdp", payload, args.json or ("runs/gpu_fsdp.json" if args.device == "cuda" else None))


if __name__ == "__main__":
    main()
