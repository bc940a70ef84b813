"""Output layer + vocab-parallel cross-entropy, forward+backward, on CPU with TP=2 (two gloo
processes, one thread each): megatron_ext's fused op against megatron_ext's unfused layers,
megatron-core 0.16.1 (its ColumnParallelLinear over the given embedding weight, then its
vocab_parallel_cross_entropy, as its GPTModel computes the loss) and DTensor (the weight
Shard(0), the hidden states Replicate(), ``F.linear`` and ``F.cross_entropy`` under
``loss_parallel``). Every variant computes the mean loss of the same tokens and its gradients
with respect to the hidden states and the weight. Timing and memory method: benchmarks/common.py.

    ./dev.sh bench output_layer_cross_entropy [--tokens 8192] [--hidden 1024] [--vocab 32768]
        [--reps 5] [--chunk-size N] [--without-megatron-core]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
from megatron_ext.model_parallel_config import ModelParallelConfig
from tests.distributed import run_distributed


def _worker(tokens: int, hidden_size: int, vocab: int, reps: int, chunk_size: int | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    tp = dist.get_world_size()
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    mcore = import_megatron_core()
    mesh = init_device_mesh("cpu", (tp,))

    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(tokens, 1, hidden_size, generator=g).requires_grad_(True)  # [s, b, h], replicated
    target = torch.randint(0, vocab, (tokens, 1), generator=g)
    local_vocab = vocab // tp
    weight = torch.randn(local_vocab, hidden_size, generator=torch.Generator().manual_seed(99 + rank)) * 0.02
    weight.requires_grad_(True)

    ours_config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
    ours_layer = tp_.ColumnParallelLinear(
        hidden_size,
        vocab,
        config=ours_config,
        init_method=torch.nn.init.zeros_,
        bias=False,
        gather_output=False,
        skip_weight_param_allocation=True,
    )
    results: dict[str, torch.Tensor] = {}

    def finish(name: str, loss: torch.Tensor) -> None:
        loss.backward()
        results[name] = torch.stack([loss.detach().reshape(()), hidden.grad.norm(), weight.grad.norm()])
        hidden.grad = weight.grad = None

    def fused() -> None:
        loss = tp_.vocab_parallel_linear_cross_entropy(hidden, weight, target, chunk_size=chunk_size)
        finish("megatron_ext fused", loss.mean())

    def unfused() -> None:
        logits, _ = ours_layer(hidden, weight=weight)
        finish("megatron_ext unfused", tp_.vocab_parallel_cross_entropy(logits, target).mean())

    def dtensor() -> None:
        h = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        w = DTensor.from_local(weight, mesh, [Shard(0)], run_check=False)
        logits = F.linear(h, w)  # Shard(-1): the vocabulary split
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            finish("DTensor loss_parallel", loss.to_local())

    variants = {"megatron_ext fused": fused, "megatron_ext unfused": unfused}
    if mcore is not None:
        mps, mtp, MConfig = mcore
        mps.initialize_model_parallel(tensor_model_parallel_size=tp)
        mcore_config = MConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        mcore_layer = mtp.ColumnParallelLinear(
            hidden_size,
            vocab,
            config=mcore_config,
            init_method=torch.nn.init.zeros_,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=True,
        )

        def megatron_core() -> None:
            logits, _ = mcore_layer(hidden, weight=weight)
            finish("megatron-core", mtp.vocab_parallel_cross_entropy(logits, target).mean())

        variants["megatron-core"] = megatron_core
    variants["DTensor loss_parallel"] = dtensor
    timings = run_interleaved(variants, reps)
    reference = results["megatron_ext fused"]
    diffs = {name: ((r - reference).abs() / reference.abs()).max().item() for name, r in results.items()}
    return {"timings": timings, "relative_diff_vs_fused": diffs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (default: ~16 MiB of logits)"
    )
    parser.add_argument("--without-megatron-core", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_megatron_core(args.without_megatron_core)

    ranks = run_distributed(
        args.tp, _worker, args.tokens, args.hidden, args.vocab, args.reps, args.chunk_size, timeout=3600
    )
    summary = summarize([r["timings"] for r in ranks])
    logits_mib = args.tokens * args.vocab // args.tp * 4 / 2**20
    baseline = "megatron-core" if "megatron-core" in summary else "megatron_ext unfused"
    print_table(
        f"output layer + cross-entropy fwd+bwd, float32, tokens={args.tokens}, hidden={args.hidden}, "
        f"vocab={args.vocab}, TP={args.tp} (gloo, CPU, 1 thread per rank); local logits {logits_mib:.0f} "
        f"MiB per rank",
        summary,
        baseline=baseline,
        unit="s",
    )
    diffs = {name: max(r["relative_diff_vs_fused"][name] for r in ranks) for name in summary}
    print("max relative difference of (loss, |grad hidden|, |grad weight|) vs fused: "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    write_json("output_layer_cross_entropy", {"config": vars(args), "local_logits_mib": logits_mib,
                                              "results": summary, "relative_diff_vs_fused": diffs}, args.out)


if __name__ == "__main__":
    main()
