"""Tensor-parallel MLP (column-parallel linear -> GeLU -> row-parallel linear, 1024 -> 4096 ->
1024, biases, 4096 tokens) forward+backward in float32, on CPU with TP=2 (two gloo processes,
one thread each): megatron_ext's ColumnParallelLinear/RowParallelLinear against megatron-core
0.16.1's (use_cpu_initialization) and DTensor's ColwiseParallel/RowwiseParallel plan over
torch.nn.Linear. All start from the same master weights; the gradient of the input and of every
weight is computed. Timing and memory method: benchmarks/common.py.

    ./dev.sh bench mlp [--tokens 4096] [--hidden 1024] [--ffn 4096] [--reps 7] [--without-megatron-core]
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


class _Mlp(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc1(x)
        out = F.gelu(out[0] if isinstance(out, tuple) else out)
        out = self.fc2(out)
        return out[0] if isinstance(out, tuple) else out


def _parallel_mlp(layers, config, master: dict[str, torch.Tensor], rank: int, tp: int) -> _Mlp:
    fc1 = layers.ColumnParallelLinear(master["w1"].shape[1], master["w1"].shape[0], config=config,
                                      init_method=torch.nn.init.zeros_, bias=True, gather_output=False)
    fc2 = layers.RowParallelLinear(master["w2"].shape[1], master["w2"].shape[0], config=config,
                                   init_method=torch.nn.init.zeros_, bias=True, input_is_parallel=True,
                                   skip_bias_add=False)
    with torch.no_grad():
        fc1.weight.copy_(master["w1"].chunk(tp, 0)[rank])
        fc1.bias.copy_(master["b1"].chunk(tp, 0)[rank])
        fc2.weight.copy_(master["w2"].chunk(tp, 1)[rank])
        fc2.bias.copy_(master["b2"])
    return _Mlp(fc1, fc2)


def _dtensor_mlp(master: dict[str, torch.Tensor], tp: int) -> _Mlp:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fc1 = torch.nn.Linear(master["w1"].shape[1], master["w1"].shape[0])
    fc2 = torch.nn.Linear(master["w2"].shape[1], master["w2"].shape[0])
    with torch.no_grad():
        fc1.weight.copy_(master["w1"])
        fc1.bias.copy_(master["b1"])
        fc2.weight.copy_(master["w2"])
        fc2.bias.copy_(master["b2"])
    mesh = init_device_mesh("cpu", (tp,))
    return parallelize_module(_Mlp(fc1, fc2), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _worker(tokens: int, hidden: int, ffn: int, reps: int) -> dict:
    tp, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    g = torch.Generator().manual_seed(11)
    master = {
        "w1": torch.randn(ffn, hidden, generator=g) * 0.02,
        "b1": torch.randn(ffn, generator=g) * 0.02,
        "w2": torch.randn(hidden, ffn, generator=g) * 0.02,
        "b2": torch.randn(hidden, generator=g) * 0.02,
    }
    x = torch.randn(tokens, 1, hidden, generator=g).requires_grad_(True)
    grad = torch.randn(tokens, 1, hidden, generator=g)

    models = {
        "megatron_ext": _parallel_mlp(
            tp_,
            ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True),
            master,
            rank,
            tp,
        )
    }
    mcore = import_megatron_core()
    if mcore is not None:
        mps, mtp, MConfig = mcore
        mps.initialize_model_parallel(tensor_model_parallel_size=tp)
        models["megatron-core"] = _parallel_mlp(
            mtp, MConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True), master, rank, tp)
    models["DTensor"] = _dtensor_mlp(master, tp)

    outputs: dict[str, torch.Tensor] = {}

    def step(name: str, model: _Mlp):
        def run() -> None:
            out = model(x)
            out.backward(grad)
            outputs[name] = torch.stack([out.detach().norm(), x.grad.norm()])
            x.grad = None
            model.zero_grad(set_to_none=True)

        return run

    timings = run_interleaved({name: step(name, m) for name, m in models.items()}, reps)
    ref = outputs["megatron_ext"]
    diffs = {name: ((o - ref).abs() / ref.abs()).max().item() for name, o in outputs.items()}
    return {"timings": timings, "relative_diff_vs_megatron_ext": diffs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--without-megatron-core", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_megatron_core(args.without_megatron_core)

    ranks = run_distributed(2, _worker, args.tokens, args.hidden, args.ffn, args.reps, timeout=3600)
    summary = summarize([r["timings"] for r in ranks])
    baseline = "megatron-core" if "megatron-core" in summary else "megatron_ext"
    print_table(
        f"MLP {args.hidden}->{args.ffn}->{args.hidden} (column -> GeLU -> row), {args.tokens} tokens, "
        f"float32 fwd+bwd, TP=2 (gloo, CPU, 1 thread per rank)",
        summary,
        baseline=baseline,
        unit="ms",
    )
    diffs = {k: max(r["relative_diff_vs_megatron_ext"][k] for r in ranks) for k in summary}
    print("max relative difference of (|output|, |grad input|) vs megatron_ext: "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    write_json(
        "mlp", {"config": vars(args), "results": summary, "relative_diff_vs_megatron_ext": diffs}, args.out
    )


if __name__ == "__main__":
    main()
